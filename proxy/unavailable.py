"""Memory that could not open because of the data directory: the chat is served without it.

A read-only, full or unwritable data directory at start-up used to crash memproxy on its lock file, taking the
chat down with memory. ``open_memory_or_unavailable`` opens the configured memory service and, if that fails
with a storage fault (``proxy.memory.store.faults``), logs one line and returns ``UnavailableMemory`` instead: every
request goes through unchanged, its headers say ``degraded=memory:storage:<reason>`` (read) and
``degraded=write:unavailable:<reason>`` (write), ``/readyz`` answers 200 with ``"memory": false`` and the reason,
and ``/metrics`` counts the degraded requests. Restart memproxy once the directory is writable again.
"""

from __future__ import annotations

import contextlib

import structlog

from proxy.memory import Exchange, Injection, MemoryService, ReadRequest
from proxy.memory.store import fault_reason, is_storage_fault

log = structlog.get_logger("memproxy.memory")


class UnavailableMemory:
    """No memory, because its storage could not open; says why on every request."""

    ready = False
    features = None
    admin = None

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def release_idle(self) -> int:
        """Nothing cached."""
        return 0

    async def jobs_busy(self) -> None:
        """No job queue."""
        return

    @property
    def storage_fault(self) -> str:
        """Why memory is off (``unavailable:<errno name>``)."""
        return f"unavailable:{self.reason}"

    async def inject(self, request: ReadRequest) -> Injection:
        """Nothing to inject; the headers say why."""
        return Injection(degraded={"memory": f"storage:{self.reason}"})

    def carried(self, request: ReadRequest) -> Injection:
        """Nothing carried."""
        return Injection()

    async def record(self, exchange: Exchange) -> None:
        """Nothing can be stored (the write-degraded header says so)."""


async def open_memory_or_unavailable(
    stack: contextlib.AsyncExitStack, memory: contextlib.AbstractAsyncContextManager[MemoryService]
) -> MemoryService:
    """``memory`` entered on ``stack``; ``UnavailableMemory`` if its storage cannot be opened."""
    try:
        return await stack.enter_async_context(memory)
    except Exception as error:
        if not is_storage_fault(error):
            raise
        reason = fault_reason(error)
        log.error(
            "memory.unavailable",
            reason=reason,
            detail=str(error)[:300],
            fix="make the data directory writable (and not full), then restart memproxy",
        )
        return UnavailableMemory(reason)
