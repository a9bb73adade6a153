"""Answered means stored: finished exchanges are committed in tasks the app owns, and spooled through disk faults.

The chat handler commits an exchange to the write path's durable queue before the client can have the end of
its answer (see ``routes``). aiohttp cancels a handler whose client hangs up, so the commit never runs in the
handler itself: ``ExchangeCommitter.commit`` starts it as a task that this object owns and waits for it
shielded; the handler may be cancelled, the commit is not, and the app's cleanup waits for every commit still
running before the queue closes.

When the queue's own disk fails (read-only, full), the exchange cannot be made durable. The chat goes on: the
exchange waits in a bounded in-memory spool (``spool_max_bytes`` of text; past it the oldest is dropped and
counted) and a retry loop owned by this object hands it to the queue as soon as the disk takes writes again.
The response says so (``X-Memory-Arms: degraded=write:<reason>``), the metrics count it, and the log has one
line when spooling starts and one when the spool is drained. A kill -9 during such a fault loses what is in the
spool: there is no disk to keep it on.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from enum import StrEnum
from types import TracebackType

import structlog

from proxy.memory import Exchange, MemoryService
from proxy.memory.store import fault_reason, is_storage_fault
from proxy.metrics import Metrics

log = structlog.get_logger("memproxy.commit")

RETRY_MIN_S = 0.2
RETRY_MAX_S = 5.0


class Committed(StrEnum):
    """What became of one exchange handed to the write path."""

    DURABLE = "durable"  # in the queue, on disk
    SPOOLED = "spooled"  # in memory, waiting for the disk to take writes again
    FAILED = "failed"  # refused for another reason (logged and counted)


def exchange_bytes(exchange: Exchange) -> int:
    """Roughly what an exchange holds in memory (its texts)."""
    texts = [*exchange.user_messages, exchange.assistant_text, *(text for _, text in exchange.context)]
    return sum(len(text) for text in texts) + 256


class ExchangeCommitter:
    """Commits exchanges in owned tasks; spools them while the disk fails; open with ``async with``."""

    def __init__(self, memory: MemoryService, metrics: Metrics, spool_max_bytes: int = 64 * 2**20) -> None:
        self._memory = memory
        self._metrics = metrics
        self._spool: collections.deque[Exchange] = collections.deque()
        self._spool_bytes = 0
        self._spool_max_bytes = spool_max_bytes
        self._spool_reason: str | None = None
        self._tasks: set[asyncio.Task[Committed]] = set()
        self._wake = asyncio.Event()
        self._retry: asyncio.Task[None] | None = None
        self.dropped = 0
        self.committed = 0
        metrics.add_gauges("memproxy_write_spool", self.gauges)

    async def __aenter__(self) -> ExchangeCommitter:
        self._retry = asyncio.create_task(self._retry_forever(), name="memproxy-spool-retry")
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._tasks:
            await asyncio.wait(list(self._tasks))
        if self._retry is not None:
            self._retry.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._retry
        await self._drain_once()  # one last try: the disk may be back
        if self._spool:
            log.error("memory.spool_lost_at_shutdown", exchanges=len(self._spool))

    @property
    def degraded(self) -> str | None:
        """Why exchanges are not durable right now (None when they are)."""
        return self._spool_reason if self._spool else None

    def gauges(self) -> dict[str, float]:
        """Spooled exchanges and bytes, and exchanges dropped from a full spool, for ``/metrics``."""
        return {
            "exchanges": float(len(self._spool)),
            "bytes": float(self._spool_bytes),
            "dropped_total": float(self.dropped),
        }

    async def commit(self, exchange: Exchange) -> Committed:
        """Hand ``exchange`` to the write path; a cancelled caller stops waiting, the commit goes on."""
        task = asyncio.create_task(self._commit(exchange), name=f"memproxy-commit-{exchange.request_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return await asyncio.shield(task)

    async def _commit(self, exchange: Exchange) -> Committed:
        started = time.perf_counter()
        if self._spool:  # keep the order: an exchange never overtakes one waiting in the spool
            return self._to_spool(exchange, None)
        try:
            await self._memory.record(exchange)
        except Exception as error:  # a failing write path never fails the chat; it is counted and logged
            if is_storage_fault(error):
                return self._to_spool(exchange, error)
            self._metrics.memory_degraded.labels("write").inc()
            log.warning("memory.record_failed", error=type(error).__name__, detail=str(error)[:200])
            return Committed.FAILED
        self._metrics.observe("commit", time.perf_counter() - started)
        self.committed += 1
        return Committed.DURABLE

    def _to_spool(self, exchange: Exchange, error: BaseException | None) -> Committed:
        if not self._spool and error is not None:
            self._spool_reason = f"storage:{fault_reason(error)}"
            log.error("memory.spooling", reason=self._spool_reason, detail=str(error)[:200])
        self._spool.append(exchange)
        self._spool_bytes += exchange_bytes(exchange)
        while self._spool_bytes > self._spool_max_bytes and len(self._spool) > 1:
            oldest = self._spool.popleft()
            self._spool_bytes -= exchange_bytes(oldest)
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                log.error("memory.spool_full", dropped_total=self.dropped, max_bytes=self._spool_max_bytes)
        self._metrics.memory_degraded.labels("write").inc()
        self._wake.set()
        return Committed.SPOOLED

    async def _retry_forever(self) -> None:
        delay = RETRY_MIN_S
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._spool:
                if await self._drain_once():
                    delay = RETRY_MIN_S
                else:
                    await asyncio.sleep(delay)
                    delay = min(RETRY_MAX_S, delay * 2)

    async def _drain_once(self) -> bool:
        """Hand spooled exchanges to the queue, oldest first; False if the disk still refuses."""
        drained = 0
        while self._spool:
            exchange = self._spool[0]
            try:
                await self._memory.record(exchange)
            except Exception as error:
                if is_storage_fault(error):
                    return False
                log.warning("memory.record_failed", error=type(error).__name__, detail=str(error)[:200])
            if self._spool and self._spool[0] is exchange:  # a full spool may have dropped it meanwhile
                self._spool.popleft()
                self._spool_bytes -= exchange_bytes(exchange)
            drained += 1
        if drained:
            log.warning("memory.spool_drained", exchanges=drained)
        return True
