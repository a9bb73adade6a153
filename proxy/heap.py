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
import os
import sys

TRIM_INTERVAL_S = 60.0
MMAP_THRESHOLD_BYTES = 128 * 1024  # glibc's initial value; set explicitly, it stops growing
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


def fix_mmap_threshold(size: int = MMAP_THRESHOLD_BYTES) -> None:
    """Serve every allocation of ``size`` bytes or more by its own mapping, returned to the system when freed.

    glibc raises this threshold (up to 32 MiB) each time a mapped block is freed, after which the big, short-
    lived buffers of loads, embeddings and LanceDB's writes come from the heap and leave holes there that
    smaller allocations then pin, which no trim can hand back. ``bench/writes.py --mode sustained --minutes 3``
    (one run each): after the drain, glibc's own count was 579 MB of heap of which 394 MB free; with the
    threshold fixed, 288 MB of which 176 MB free, and RSS 867 -> 694 MB after the drain (677 -> 588 a minute
    later; 313 -> 278 MB before the load), the write side as fast. Buffers reused on the read path keep it
    from mapping per request (``StaticModel._widened``). An operator's ``MALLOC_MMAP_THRESHOLD_`` or
    ``GLIBC_TUNABLES=glibc.malloc.mmap_threshold=...`` is left as it is.
    """
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or "mmap_threshold" in os.environ.get("GLIBC_TUNABLES", ""):
        return  # the operator chose one (glibc reads both at start-up)
    libc = _glibc()
    if libc is not None and hasattr(libc, "mallopt"):
        libc.mallopt(_M_MMAP_THRESHOLD, size)


def trim() -> None:
    """Hand free heap pages back to the system."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


async def trim_in_thread() -> None:
    """``trim`` off the event loop (it holds the arenas' locks while it walks them)."""
    await asyncio.to_thread(trim)
