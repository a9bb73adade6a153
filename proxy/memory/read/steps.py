"""Guarded steps of one retrieval: each runs within its own timeout, and a failure only marks it degraded.

One arm failing must never fail the chat: a step that raises or times out is noted in the ``Report``
(``degraded``: step -> a short reason, ``timeout`` or the error's class name, never a message text) and returns
None, and the other steps still serve. The report also keeps every step's time.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

_T = TypeVar("_T")


@dataclass(slots=True)
class Report:
    """Degraded steps and per-step timings, filled in by the guarded steps of one retrieval."""

    degraded: dict[str, str] = field(default_factory=dict)
    timings_ms: dict[str, float] = field(default_factory=dict)


def reason(error: BaseException) -> str:
    """A short, header-safe reason: ``timeout`` or the error's class name (never its message)."""
    return "timeout" if isinstance(error, TimeoutError) else type(error).__name__


async def guarded(name: str, step: Awaitable[_T], timeout_s: float, report: Report) -> _T | None:
    """Run one step within its timeout; on failure note it as degraded and return None."""
    started = time.perf_counter()
    try:
        async with asyncio.timeout(timeout_s):
            return await step
    # One arm failing must never fail the chat, whatever the backend raised: the others still serve.
    except Exception as error:
        report.degraded[name] = reason(error)
        return None
    finally:
        report.timings_ms[name] = round((time.perf_counter() - started) * 1000, 3)


async def _nothing() -> None:
    """A step that is switched off."""


def step(
    name: str, make: Callable[[], Awaitable[_T]], enabled: bool, timeout_s: float, report: Report
) -> Awaitable[_T | None]:
    """A guarded step, or nothing when it is switched off (its coroutine is then never created)."""
    return guarded(name, make(), timeout_s, report) if enabled else _nothing()
