"""proxy.heap: glibc's trim (the RSS it saves under load is measured by bench-writes, not here)."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path

import pytest

from proxy import heap

pytestmark = pytest.mark.skipif(heap._glibc() is None, reason="glibc only")
ROOT = Path(__file__).resolve().parent.parent


async def test_trim_hands_freed_pages_back() -> None:
    """After a large allocation is freed in small pieces, a trim lowers the resident set."""
    pieces, keep = [], []
    for _ in range(1024):  # 64 MB under the mmap threshold, each piece pinned by a small one after it
        pieces.append(bytearray(64 * 1024 - 64))
        keep.append(bytearray(1024))
    del pieces  # holes in the heap that free() leaves resident
    before = _rss_kb()
    await heap.trim_in_thread()
    assert _rss_kb() < before - 16 * 1024, (before, _rss_kb())
    del keep


def _rss_kb() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS"))


def test_a_fixed_mmap_threshold_maps_big_blocks_even_after_one_was_freed() -> None:
    """glibc raises its mmap threshold when a mapped block is freed; fixed, a 1 MB block made after that is
    still a mapping of its own, handed back when freed (mapped bytes: mallinfo2's ``hblkhd``). In a fresh
    process: a heap with free space reuses it for big blocks whatever the threshold."""
    script = (
        "import ctypes; from proxy import heap; from tests.test_heap import mapped_bytes; heap.fix_mmap_threshold(); "
        "del bytearray(8 * 2**20)[:]; before = mapped_bytes(); block = bytearray(2**20); during = mapped_bytes(); "
        "del block; print(during - before, mapped_bytes() - before)"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=ROOT)
    grew, left = (int(v) for v in out.stdout.split())
    assert grew >= 2**20
    assert left < 2**20


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks")
    ]


def mapped_bytes() -> int:
    """Bytes malloc holds in mappings of their own."""
    libc = heap._glibc()
    assert libc is not None
    libc.mallinfo2.restype = _MallInfo2
    return int(libc.mallinfo2().hblkhd)


class _Clocks:
    """A wall clock and a CPU clock the test moves."""

    def __init__(self) -> None:
        self.now, self.cpu = 1000.0, 50.0

    def step(self, seconds: float, busy_share: float) -> None:
        self.now += seconds
        self.cpu += seconds * busy_share


def test_the_trimmer_trims_once_quiet_after_work_and_each_minute_while_busy() -> None:
    clocks = _Clocks()
    trimmer = heap.QuietTrimmer(clock=lambda: clocks.now, cpu=lambda: clocks.cpu)
    seen = []
    for busy in [0.0] * 30 + [0.9] * 30 + [0.0] * 3:  # idle 150 s, busy 150 s, then quiet
        clocks.step(heap.QUIET_CHECK_S, busy)
        due = trimmer.due()
        if due:
            trimmer.trimmed()
        seen.append(due)
    assert not any(seen[:30])  # an idle process is left alone
    assert sum(seen[30:60]) == 2  # busy: once a minute (150 s)
    assert seen[60]  # the first quiet check after the work
    assert not any(seen[61:])  # then nothing more


async def test_every_check_asks_for_idle_caches_to_go_and_trims_when_any_went(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """At every check the trimmer asks ``release`` to drop idle users' caches (what is idle is the engine's
    call), and trims at once when it dropped any, busy or idle; otherwise the quiet/minute rule stands."""
    clocks, released, trims = _Clocks(), [0, 0, 3, 0], []
    calls: list[float] = []

    def release() -> int:
        calls.append(clocks.now)
        return released.pop(0)

    async def trim() -> None:
        trims.append(clocks.now)

    monkeypatch.setattr(heap, "trim_in_thread", trim)
    trimmer = heap.QuietTrimmer(clock=lambda: clocks.now, cpu=lambda: clocks.cpu, release=release)
    clocks.step(heap.QUIET_CHECK_S, 1.0)  # busy, nothing released: no trim before the minute
    await trimmer.tick()
    assert (len(calls), trims) == (1, [])
    clocks.step(heap.QUIET_CHECK_S, 0.0)  # quiet after work: trimmed for the work done
    await trimmer.tick()
    assert trims == [clocks.now]
    clocks.step(heap.QUIET_CHECK_S, 0.0)  # still quiet, nothing worked since: a trim only because 3 went
    await trimmer.tick()
    assert trims[-1] == clocks.now
    assert len(trims) == 2
    clocks.step(heap.QUIET_CHECK_S, 0.0)  # quiet, nothing released, nothing worked: no trim
    await trimmer.tick()
    assert len(calls) == 4
    assert len(trims) == 2


def test_start_up_objects_are_frozen_out_of_the_collectors_walks() -> None:
    import gc

    try:
        heap.freeze_startup_objects()
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()


@pytest.mark.parametrize(("env", "backend"), [({}, "system"), ({"ARROW_DEFAULT_MEMORY_POOL": "mimalloc"}, "mimalloc")])
def test_arrow_buffers_come_from_glibc_unless_the_operator_chose_a_pool(env: dict[str, str], backend: str) -> None:
    """The server puts Arrow on the system's malloc (so that trims hand its freed buffers back): a 32 MB Arrow
    buffer is then one of glibc's mappings. An operator's ARROW_DEFAULT_MEMORY_POOL wins."""
    script = (
        "from proxy import heap; from tests.test_heap import mapped_bytes; heap.arrow_on_system_malloc(); "
        "import pyarrow; before = mapped_bytes(); buffer = pyarrow.allocate_buffer(32 * 2**20); "
        "print(pyarrow.default_memory_pool().backend_name, mapped_bytes() - before)"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=ROOT, env={**os.environ, **env}
    )
    name, grew = out.stdout.split()
    assert name == backend
    assert (int(grew) >= 32 * 2**20) == (backend == "system")
