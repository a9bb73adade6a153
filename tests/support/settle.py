"""Waiting for the write path of an in-process proxy to finish what is due."""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp.test_utils import TestClient

from proxy.state import STATE


async def settled(proxy: TestClient[Any, Any], wait_s: float = 30.0) -> None:
    """Wait until the write path has no job due now (scheduled summaries/insights may stay pending)."""
    engine = proxy.app[STATE].memory
    deadline = asyncio.get_running_loop().time() + wait_s
    while asyncio.get_running_loop().time() < deadline:
        metrics = await engine.jobs.metrics()
        if metrics.ready == 0 and metrics.running == 0:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("write path did not settle")
