"""Waiting in a test for something a background task does (a maintenance round, a job, a replica)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

_T = TypeVar("_T")


async def eventually(check: Callable[[], Awaitable[_T]], within_s: float, every_s: float = 0.05) -> _T:
    """The first truthy result of ``check``, polled every ``every_s``; fails once ``within_s`` have passed."""
    deadline = time.monotonic() + within_s
    while True:
        result = await check()
        if result:
            return result
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(every_s)
