"""The weekly insight schedule on replicas over object storage: run by the store's lease holder only.

Activity triggers stay per replica (each writes its own users' jobs); the schedule looks at every user, so only
the replica holding the maintenance lease (``proxy.memory.store.lease``) runs it.
"""

from __future__ import annotations

from insights.scheduler import InsightScheduler
from insights.service import InsightSettings
from proxy.memory.store import ReplicatedStore
from proxy.memory.write import JobQueue


class LeaderInsightScheduler(InsightScheduler):
    """The weekly insight schedule, run by the lease holder only (activity triggers stay per replica)."""

    def __init__(self, store: ReplicatedStore, queue: JobQueue, settings: InsightSettings) -> None:
        super().__init__(store, queue, settings)
        self._lease = store.lease

    async def tick(self) -> list[str]:
        """Enqueue due users' jobs if this replica holds the lease."""
        if not self._lease.held:
            return []
        return await super().tick()
