"""proxy.heap: glibc's trim (the RSS it saves under load is measured by bench-writes, not here)."""

from __future__ import annotations

import pytest

from proxy import heap

pytestmark = pytest.mark.skipif(heap._glibc() is None, reason="glibc only")


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
