"""Expiry and retention: memories past their ``expires_at`` and turns older than ``memory.turn_retention_days``
are deleted for good, by a sweep that runs now and then.

The read path never injects a memory past its ``expires_at`` (``read.selection``), so the sweep only has to
catch up, not be on time. A sweep is one scan of four columns of the whole table for the rows due
(``StoreReads.due_for_deletion``), then one delete per user that has some (``MemoryStore.delete_many``: one
LanceDB commit and one keyword commit). Summaries, facts, insights and subjects never age out; turns do only
when ``turn_retention_days`` is above 0. Each expired memory deleted is announced (``memory.deleted`` with
``reason: "expired"``); turns aged out are not (they were never announced).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta
from types import TracebackType

import structlog

from proxy.memory.events import MemoryEvents
from proxy.memory.store.background import Ticker
from proxy.memory.store.memory_store import MemoryStore
from proxy.memory.store.records import utcnow

log = structlog.get_logger("memproxy.retention")

SWEEP_INTERVAL_S = 300.0


class RetentionSweeper:
    """Owns the periodic sweep of one store (see the module doc); ``sweep`` runs one at once."""

    def __init__(
        self,
        store: MemoryStore,
        events: MemoryEvents,
        turn_retention_days: int = 0,
        *,
        interval_s: float = SWEEP_INTERVAL_S,
        clock: Callable[[], datetime] = utcnow,
        on_deleted: Callable[[str], object] | None = None,
    ) -> None:
        self._on_deleted = on_deleted  # told of each user the sweep deleted from (caches that carry their memories)
        self._store = store
        self._events = events
        self._retention = timedelta(days=turn_retention_days) if turn_retention_days > 0 else None
        self._clock = clock
        self._ticker = Ticker("memproxy-retention", interval_s, self._sweep_quietly, store.health)

    async def __aenter__(self) -> RetentionSweeper:
        await self._ticker.__aenter__()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self._ticker.__aexit__(exc_type, exc, tb)

    async def _sweep_quietly(self) -> None:
        await self.sweep()

    async def sweep(self) -> dict[str, int]:
        """Delete what is due now; how many expired memories and old turns went."""
        now = self._clock()
        turns_before = now - self._retention if self._retention is not None else None
        counts = {"expired": 0, "turns": 0}
        for user_id, due in (await self._store.due_for_deletion(now, turns_before)).items():
            expired = await self._store.get_many(user_id, due.expired) if due.expired else []
            gone = set(await self._store.delete_many(user_id, [*due.expired, *due.old_turns]))
            if gone and self._on_deleted is not None:
                self._on_deleted(user_id)
            announced = [record.replace(embedding=None) for record in expired if record.id in gone]
            if announced:
                await self._events.emit("memory.deleted", user_id, announced, reason="expired")
            counts["expired"] += len(announced)
            counts["turns"] += len(gone) - len(announced)
        if any(counts.values()):
            log.info("memory.retention_swept", **counts)
        return counts
