"""The replicated store: a ``MemoryStore`` on a shared table that announces its writes and applies the others'.

Caches and the Tantivy keyword index are per replica and derived from the table: every write is published on
the change feed (``changes.py``) before its commit and again after it, and for each user another replica
names, this one drops the user's cached vectors and re-indexes the user's keyword documents from the table
(``refresh_users``, driven by ``runtime.ClusterRuntime``). A forget also drops the user's queued jobs here
(``on_forget`` listeners) and deletes any row a job of theirs wrote meanwhile. Background work (compaction,
index builds, purges) runs on the lease holder only.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from datetime import timedelta
from typing import Any

from proxy.memory.store.changes import ChangeFeed, now_ms
from proxy.memory.store.cluster import ClusterSettings
from proxy.memory.store.consistency import table_keyword_docs
from proxy.memory.store.faults import StorageHealth
from proxy.memory.store.filters import record_filter
from proxy.memory.store.keyword_schema import KeywordDoc
from proxy.memory.store.lease import Lease
from proxy.memory.store.manifest import RemoteManifest
from proxy.memory.store.memory_store import DocumentEmbedder, MemoryStore, StoreSettings
from proxy.memory.store.objectstore import ObjectStore
from proxy.memory.store.records import MemoryRecord
from proxy.memory.store.table import SharedTable


def shared_table(cluster: ClusterSettings, objects: ObjectStore) -> SharedTable:
    """Where the replicas' shared table is, and how each one reads it."""
    return SharedTable(
        uri=cluster.location.child("lance"),
        storage_options=cluster.location.lance_options(),
        manifests=RemoteManifest(objects),
        read_consistency=timedelta(seconds=cluster.sync_interval_s),
        purge_cleanup=timedelta(seconds=max(60.0, 4 * cluster.sync_interval_s)),
    )


class ReplicatedStore(MemoryStore):
    """A ``MemoryStore`` on a shared table: announces its writes, applies others', maintains only when leader."""

    def __init__(
        self,
        settings: StoreSettings,
        embedder: DocumentEmbedder,
        cluster: ClusterSettings,
        objects: ObjectStore,
        replica: str,
        *,
        allow_mismatch: bool = False,
        health: StorageHealth | None = None,
    ) -> None:
        shared = shared_table(cluster, objects)
        self.feed = ChangeFeed(objects, replica, lookback_s=max(30.0, cluster.settle_s * 2))
        super().__init__(
            settings, embedder, allow_mismatch=allow_mismatch, health=health, shared=shared, announce=self.feed.publish
        )
        self.cluster = cluster
        self.objects = objects
        self.lease = Lease(objects, replica, cluster.lease_s)
        self._listeners: list[Callable[[str], Awaitable[object]]] = []
        self._forget_listeners: list[Callable[[str], Awaitable[object]]] = []

    def on_change(self, listener: Callable[[str], Awaitable[object]]) -> None:
        """Await ``listener(user_id)`` after the user's records changed elsewhere or were forgotten (read caches)."""
        self._listeners.append(listener)

    def on_forget(self, listener: Callable[[str], Awaitable[object]]) -> None:
        """Await ``listener(user_id)`` when another replica forgot the user (the local job queue)."""
        self._forget_listeners.append(listener)

    async def __aenter__(self) -> ReplicatedStore:
        self.feed.start_at(now_ms())
        await super().__aenter__()
        return self

    # writes announce themselves before and after their commit ----------------------------------------

    async def update(self, user_id: str, id: str, **changes: Any) -> MemoryRecord | None:
        """As ``MemoryStore.update``, announced to the other replicas."""
        await self.feed.publish([user_id])
        try:
            return await super().update(user_id, id, **changes)
        finally:
            await self.feed.publish([user_id])

    async def delete_many(self, user_id: str, ids: Sequence[str]) -> list[str]:
        """As ``MemoryStore.delete_many`` (and so ``delete``), announced to the other replicas."""
        await self.feed.publish([user_id])
        try:
            return await super().delete_many(user_id, ids)
        finally:
            await self.feed.publish([user_id])

    async def forget_user(self, user_id: str, *, purge: bool = True) -> dict[str, int]:
        """Forget the user here and everywhere: the rows go at once, their bytes at the lease holder's purge.

        The purge (rewriting shared data files) is left to the lease holder's next maintenance round, which
        also removes old versions; until then the deleted rows are unreachable by any read.
        """
        await self.feed.publish([user_id], op="forget")
        counts = await super().forget_user(user_id, purge=False)
        if any(counts.values()):  # the purge is the lease holder's, noted on object storage
            self.writes.data_dir.purge_done()
            await self.objects.put(f"purges/{now_ms():013d}-{uuid.uuid4().hex[:8]}", b"1")
        await self._notify(user_id)
        await self.feed.publish([user_id], op="forget")
        return counts

    # what other replicas did --------------------------------------------------------------------------

    async def refresh_users(self, user_ids: Iterable[str]) -> None:
        """Make this replica's caches and keyword index agree with the table for these users (one commit)."""
        users = sorted(set(user_ids))
        if not users:
            return
        for user_id in users:
            self._cache.drop(user_id)
        async with self.writes.lock:
            await self._lance.table.checkout_latest()
            docs = [doc for user_id in users async for batch in self._user_keyword_docs(user_id) for doc in batch]
            for user_id in users:
                await self._keyword.remove_user(user_id)
            await self._keyword.upsert(docs)
            await self._keyword.commit()
        for user_id in users:
            self._cache.drop(user_id)  # a load that started before the new version is not kept
            await self._notify(user_id)

    async def _notify(self, user_id: str) -> None:
        for listener in self._listeners:
            await listener(user_id)

    def _user_keyword_docs(self, user_id: str) -> AsyncIterator[list[KeywordDoc]]:
        return table_keyword_docs(self._lance, record_filter(user_id))

    async def apply_forget(self, user_id: str) -> None:
        """Another replica forgot the user: drop their queued jobs here, then any row a job wrote meanwhile."""
        for listener in self._forget_listeners:
            await listener(user_id)
        await self.writes.drain()
        async with self.writes.lock:
            await self._lance.table.checkout_latest()
            late = await self._lance.count(user_id)
            if late:
                await self._lance.delete(user_id)
            self._cache.drop(user_id)
            self._touches.drop_user(user_id)
            await self._keyword.remove_user(user_id)
            await self._keyword.commit()
        if late:  # rows written after the forget (here or elsewhere): every replica re-reads the user, or one
            await self.feed.publish([user_id])  # that cached them would go on serving them
        await self._notify(user_id)

    # background work: only the lease holder ----------------------------------------------------------

    async def optimize(self) -> None:
        """Compaction, index builds and purges, on the lease holder only."""
        if not self.lease.held:
            if self.writes.needs_repair:  # a local keyword-index write failed: that repair is ours
                async with self.writes.lock:
                    await self.repair()
                    self.writes.needs_repair = False
            return
        pending = await self.objects.list("purges/")
        if pending:
            self.writes.data_dir.mark_purge()
        await super().optimize()
        for key in pending:
            await self.objects.delete(key)
        await self.feed.cleanup(self.cluster.changes_keep_s)

    async def remove_old_versions(self) -> None:
        """Old versions removed on the lease holder only (as compaction)."""
        if self.lease.held:
            await super().remove_old_versions()
