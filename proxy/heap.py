"""Freed heap pages handed back to the system (glibc's ``malloc_trim``): once a minute while the process
works, and as soon as it goes quiet after work (``QuietTrimmer``).

glibc keeps what the server's threads free (the event loop's, the model's, LanceDB's and Tantivy's pools, the
job queue's; up to 8 arenas per core) resident until the top of each heap is free, which under steady writes
it rarely is; the trim hands much of it back (``bench/writes.py --mode sustained`` shows RSS after the drain
with and without it). Capping the arenas (``MALLOC_ARENA_MAX=2``) once kept RSS lower still, but hardly does
now: what stays is free chunks of a few KB spread over pages that live allocations share; ``proxy.recycle``
hands that back by restarting the process in place once it is quiet. Elsewhere (musl, macOS) this is a no-op.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import functools
import gc
import os
import sys
import time
from collections.abc import Callable

TRIM_INTERVAL_S = 60.0
QUIET_CHECK_S = 5.0  # how often ``QuietTrimmer.tick`` looks
QUIET_CPU_SHARE = 0.05  # a check interval with less CPU than this share of one core is quiet
WORK_CPU_S = 1.0  # CPU seconds since the last trim that make a quiet interval worth a trim
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
    smaller allocations then pin, which no trim can hand back. With the threshold fixed, ``bench/writes.py
    --mode sustained`` leaves a smaller heap, less of it free, and a lower RSS after the drain, the write side
    as fast. Buffers reused on the read path keep it from mapping per request (``StaticModel._widened``). An
    operator's ``MALLOC_MMAP_THRESHOLD_`` or ``GLIBC_TUNABLES=glibc.malloc.mmap_threshold=...`` is left as it is.
    """
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or "mmap_threshold" in os.environ.get("GLIBC_TUNABLES", ""):
        return  # the operator chose one (glibc reads both at start-up)
    libc = _glibc()
    if libc is not None and hasattr(libc, "mallopt"):
        libc.mallopt(_M_MMAP_THRESHOLD, size)


def arrow_on_system_malloc() -> None:
    """Arrow's buffers (the rows of a user's load, of listings, exports and writes) from the system's malloc,
    which the trims hand back, instead of pyarrow's bundled mimalloc, which keeps what they freed (compare
    ``bench/load.py --skip-litellm`` with and without ``--env ARROW_DEFAULT_MEMORY_POOL=mimalloc``). An
    operator's ``ARROW_DEFAULT_MEMORY_POOL`` is left as it is."""
    if "ARROW_DEFAULT_MEMORY_POOL" in os.environ:
        return
    import pyarrow  # imported here: only the server calls this (and imports pyarrow with LanceDB anyway)

    pyarrow.set_memory_pool(pyarrow.system_memory_pool())


def freeze_startup_objects() -> None:
    """Leave what start-up made (modules, the model, settings, the app: ~100k objects the collector would
    otherwise walk at every full collection, for good) out of the cyclic collector's walks: collect once, then
    ``gc.freeze``. What the requests allocate is collected as before."""
    gc.collect()
    gc.freeze()


def trim() -> None:
    """Hand free heap pages back to the system."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


async def trim_in_thread() -> None:
    """``trim`` off the event loop (it holds the arenas' locks while it walks them)."""
    await asyncio.to_thread(trim)


class QuietTrimmer:
    """Decides when to trim: every ``TRIM_INTERVAL_S`` while the process works, and at the first quiet check
    (under ``QUIET_CPU_SHARE`` of a core since the previous one) after ``WORK_CPU_S`` of work, so that what a
    burst freed goes back within seconds of its end rather than up to a minute later. An idle process is not
    trimmed again. ``bench/writes.py --mode sustained --minutes 3``: see the commit that added it.

    ``release``, if given, is called at every check to drop the caches of users gone idle
    (``MemoryEngine.release_idle``, which decides what is idle); when it dropped any, the heap is trimmed at
    once, idle process or not.
    """

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        cpu: Callable[[], float] = time.process_time,
        release: Callable[[], int] | None = None,
    ) -> None:
        self._clock, self._cpu, self._release = clock, cpu, release
        self._checked_at, self._checked_cpu = clock(), cpu()
        self._trimmed_at, self._trimmed_cpu = self._checked_at, self._checked_cpu
        self.quiet = False  # whether the interval up to the last check was quiet (``proxy.recycle`` asks too)

    def due(self) -> bool:
        """Whether to trim now (call every ``QUIET_CHECK_S``)."""
        now, cpu = self._clock(), self._cpu()
        self.quiet = quiet = cpu - self._checked_cpu <= QUIET_CPU_SHARE * (now - self._checked_at)
        self._checked_at, self._checked_cpu = now, cpu
        worked = cpu - self._trimmed_cpu
        if quiet and worked < WORK_CPU_S:
            self._trimmed_at = now  # nothing done worth a trim: the minute counts from the end of the quiet
            return False
        return quiet or now - self._trimmed_at >= TRIM_INTERVAL_S

    def trimmed(self) -> None:
        """Note a trim just done."""
        self._trimmed_at, self._trimmed_cpu = self._clock(), self._cpu()

    async def tick(self) -> None:
        """Release idle users' caches; trim off the event loop when ``due`` or when that released any."""
        due = self.due()
        if self._release is not None and self._release() > 0:
            due = True
        if due:
            await trim_in_thread()
            self.trimmed()
