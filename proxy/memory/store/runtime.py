"""The replica's loops: lease renewal, the change feed's sync, the journal's heartbeat, sweep and adoption."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable

import structlog

from proxy.memory.errors import MemoryLayerError
from proxy.memory.store.cluster import ClusterSettings
from proxy.memory.store.journal import Journal
from proxy.memory.store.objectstore import ObjectStoreError
from proxy.memory.store.replicated import ReplicatedStore

log = structlog.get_logger("memproxy.cluster")


class ClusterRuntime:
    """Owns the replica's loops: lease, change feed, journal heartbeat/sweep/adoption (``async with``)."""

    def __init__(self, store: ReplicatedStore, journal: Journal, settings: ClusterSettings) -> None:
        self.store = store
        self.journal = journal
        self.settings = settings
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = asyncio.Event()
        self._recheck: dict[str, float] = {}
        self.synced_at = 0.0

    async def __aenter__(self) -> ClusterRuntime:
        await self.journal.heartbeat()
        await self.store.lease.refresh()
        self._tasks = [
            asyncio.create_task(self._every(self.settings.lease_s / 3, self.store.lease.refresh), name="lease"),
            asyncio.create_task(self._every(self.settings.sync_interval_s, self.sync), name="replica-sync"),
            asyncio.create_task(self._every(self.settings.dead_after_s / 5, self.journal.heartbeat), name="heartbeat"),
            asyncio.create_task(self._every(2.0, self._journal_round), name="journal"),
        ]
        log.info(
            "cluster.joined",
            replica=self.journal.replica,
            leader=self.store.lease.held,
            **self.settings.location.describe(),
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._stopping.set()  # rounds finish (a keyword-index write must not be cut off mid-way)
        _, late = await asyncio.wait(self._tasks, timeout=30.0)
        for task in late:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        with contextlib.suppress(ObjectStoreError):
            await self.journal.sweep()
        await self.store.lease.release()

    def gauges(self) -> dict[str, float]:
        """This replica's view of the cluster, as plain numbers (``memproxy_cluster_*`` in /metrics)."""
        objects = self.store.objects
        return {
            "lease_held": float(self.store.lease.held),
            "sync_age_seconds": time.time() - self.synced_at if self.synced_at else -1.0,
            "journal_adopted": float(self.journal.adopted),
            "object_store_requests": float(objects.requests),
        }

    async def _every(self, interval_s: float, fn: Callable[[], Awaitable[object]]) -> None:
        while not self._stopping.is_set():
            try:
                await fn()
            except (MemoryLayerError, OSError) as error:  # object store down: try again next round
                log.warning("cluster.round_failed", task=fn.__name__, error=repr(error))
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(interval_s):
                    await self._stopping.wait()

    async def sync(self) -> None:
        """Apply other replicas' changes: forgets, then writes (now and again ``settle_s`` later)."""
        now = time.monotonic()
        changes = await self.store.feed.poll()
        for user in dict.fromkeys(u for change in changes if change.op == "forget" for u in change.users):
            await self.store.apply_forget(user)
        changed = {user for change in changes for user in change.users}
        due = {user for user, at in self._recheck.items() if at <= now}
        for user in due:
            del self._recheck[user]
        for user in changed:
            self._recheck[user] = now + self.settings.settle_s
        await self.store.refresh_users(changed | due)
        self.synced_at = time.time()

    async def _journal_round(self) -> None:
        await self.journal.sweep()
        await self.journal.adopt_orphans()
