"""Freed heap pages handed back to the system once a minute (glibc's ``malloc_trim``).

glibc keeps what the server's threads free (the event loop's, the model's, LanceDB's and Tantivy's pools, the
job queue's; up to 8 arenas per core) resident until the top of each heap is free, which under steady writes
it rarely is. ``bench/writes.py --mode sustained --minutes 3`` (one run each): RSS after the drain 1,744 MB
without the trim, 1,138 MB with it. Capping the arenas (``MALLOC_ARENA_MAX``) kept RSS lower still but slowed
the write side under a chat load: left to operators. Elsewhere (musl, macOS) this is a no-op.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import functools
import sys

TRIM_INTERVAL_S = 60.0


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


def trim() -> None:
    """Hand free heap pages back to the system."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


async def trim_in_thread() -> None:
    """``trim`` off the event loop (it holds the arenas' locks while it walks them)."""
    await asyncio.to_thread(trim)
