"""The memory store: LanceDB (source of truth, vectors) and Tantivy (BM25) behind one async interface.

``MemoryStore`` owns the parts (table, keyword index, vector cache, touch buffer: ``reads.StoreParts``) and their
lifecycle, and holds a reads object (``reads.StoreReads``) and a writes object (``writes.StoreWrites``) that work
on them; its methods are theirs. The order of the writes that keeps both arms consistent through crashes is
described in ``writes.py``.
"""

from __future__ import annotations

import builtins
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Iterable, Sequence
from contextlib import AsyncExitStack
from datetime import datetime, timedelta
from typing import Any

import numpy as np
import numpy.typing as npt

from proxy.memory.errors import StoreError
from proxy.memory.pieces import TermVectors
from proxy.memory.store.adapters import AdapterTable
from proxy.memory.store.background import BatchWriter, Ticker
from proxy.memory.store.compaction import CLEANUP_EVERY_S
from proxy.memory.store.exact_search import single_thread_blas
from proxy.memory.store.faults import StorageHealth
from proxy.memory.store.keyword import KeywordIndex
from proxy.memory.store.reads import Due, Hit, Page, StoreParts, StoreReads
from proxy.memory.store.records import Kind, MemoryRecord, Pool, utcnow
from proxy.memory.store.settings import DocumentEmbedder, StoreSettings, StoreTuning
from proxy.memory.store.table import MemoryTable, SharedTable
from proxy.memory.store.touches import TouchBuffer
from proxy.memory.store.vector_cache import VectorCache
from proxy.memory.store.vector_spill import SPILL_DIR, VectorSpill
from proxy.memory.store.writes import StoreWrites

__all__ = ["DocumentEmbedder", "MemoryStore", "StoreSettings", "StoreTuning"]


async def _no_announcement(users: Iterable[str]) -> None:
    """A local store tells no other replica of its writes."""


class MemoryStore:
    """Every memory of every user; open with ``async with`` (starts the writer and maintenance tasks)."""

    def __init__(
        self,
        settings: StoreSettings,
        embedder: DocumentEmbedder,
        *,
        allow_mismatch: bool = False,
        health: StorageHealth | None = None,
        shared: SharedTable | None = None,
        announce: Callable[[Iterable[str]], Awaitable[object]] = _no_announcement,
        follower: bool = False,
    ) -> None:
        """``shared``: the table is on object storage, used by several replicas; ``announce(users)`` is awaited
        before and after each commit of new records (``replicated.ReplicatedStore`` tells the others).
        ``follower``: a chat process's read-only view of the store the memory writer process owns (no writes,
        no maintenance; the writer's cache writes and keyword commits reach it through ``follow``)."""
        self.settings = settings
        self.follower = follower
        self.health = health or StorageHealth()
        self._embedder = embedder
        table = MemoryTable(
            settings.path / "lance",
            embedder.model_id,
            embedder.dim,
            allow_mismatch=allow_mismatch,
            shared=shared,
            cache_bytes=settings.lance_cache_bytes,
            follower=follower,
        )
        keyword = KeywordIndex(settings.path / "tantivy", follower=follower)
        spill = (
            VectorSpill(settings.path / SPILL_DIR, settings.vector_spill_bytes) if settings.vector_spill_bytes else None
        )
        cache = VectorCache(settings.vector_cache_bytes, spill=spill)
        touches = TouchBuffer(timedelta(seconds=settings.touch_granularity_s))
        parts = StoreParts(table, keyword, cache, touches)
        self._lance, self._keyword, self._cache, self._touches = table, keyword, cache, touches
        self.reads = StoreReads(parts, embedder)
        self.writes = StoreWrites(settings, embedder, parts, self.reads, announce)
        # the per-user query adapters, beside the memory table (its directory drops tables it does not know)
        self.adapters = (
            AdapterTable(settings.path / "adapters")
            if shared is None
            else AdapterTable(shared.uri.rstrip("/") + "-adapters", shared.storage_options)
        )
        self._stack: AsyncExitStack | None = None

    @property
    def embedder(self) -> DocumentEmbedder:
        """The embedder this store's vectors come from."""
        return self._embedder

    # lifecycle ------------------------------------------------------------------------------------------

    async def __aenter__(self) -> MemoryStore:
        single_thread_blas()
        if self.follower:
            return await self._open_following()
        self.settings.path.mkdir(parents=True, exist_ok=True)
        writes = self.writes
        async with AsyncExitStack() as stack:
            stack.enter_context(writes.data_dir.owned())
            await self._lance.open()
            stack.callback(self._lance.close)
            await stack.enter_async_context(self._keyword)
            stack.push_async_callback(self._cache.aclose)  # loads in flight stop before the tables close
            await writes.recover()
            self._keyword.committed_at = None  # the opening's own repair is no sign of a busy write side
            stack.push_async_callback(writes.close)
            writes.writer = BatchWriter(
                writes.flush, self.settings.flush_max_rows, self.settings.flush_interval_ms / 1000, health=self.health
            )
            await stack.enter_async_context(writes.writer)
            writes.optimizer = Ticker("memory-optimize", self.settings.optimize_interval_s, self.optimize, self.health)
            await stack.enter_async_context(writes.optimizer)
            # its first round now, not after a whole interval: until then updates scan the table, and searches
            # walk a fragmented keyword index
            if await self._lance.lacks_scalar_indexes() or await writes.keyword_fragmented():
                writes.optimizer.wake()
            await stack.enter_async_context(
                Ticker("memory-touch", self.settings.touch_flush_s, writes.flush_touches, self.health)
            )
            await stack.enter_async_context(
                Ticker("memory-versions", CLEANUP_EVERY_S, self.remove_old_versions, self.health)
            )
            self._stack = stack.pop_all()
        return self

    async def _open_following(self) -> MemoryStore:
        async with AsyncExitStack() as stack:
            await self._lance.open()
            stack.callback(self._lance.close)
            await stack.enter_async_context(self._keyword)
            stack.push_async_callback(self._cache.aclose)
            self._stack = stack.pop_all()
        return self

    async def follow(self, op: str, args: tuple[Any, ...]) -> None:
        """Apply one write the memory writer made (``VectorCache.mirror``'s ops, and ``keyword`` for a commit of
        the keyword index) to this follower."""
        if op == "keyword":
            await self._keyword.reload()
        elif op == "upsert":
            self._cache.upsert(*args)
        elif op == "patch":
            user_id, ids, changes = args
            self._cache.patch(user_id, ids, **changes)
        elif op == "remove":
            self._cache.remove(*args)
        elif op == "drop":
            self._cache.drop(*args)
        elif op == "clear":
            self._cache.clear()

    def mirror_to(self, emit: Callable[[str, tuple[Any, ...]], object]) -> None:
        """Send every write this (writing) store applies to its cache and keyword index to ``emit``."""
        self._cache.mirror = emit
        self._keyword.on_commit = lambda: emit("keyword", ())

    async def __aexit__(self, *exc: object) -> None:
        if self._stack is not None:
            await self._stack.aclose()
            self._stack = None

    # the vector cache -----------------------------------------------------------------------------------

    @property
    def cache(self) -> VectorCache:
        """The per-user vector cache (for metrics)."""
        return self._cache

    @property
    def lance_cache_bytes(self) -> int:
        """Bytes LanceDB's session caches hold now (its index and metadata caches)."""
        session = self._lance.session
        return int(session.size_bytes) if session is not None else 0

    @property
    def searched_lance(self) -> bool:
        """Whether a vector search went to LanceDB (``StoreReads.searched_lance``)."""
        return self.reads.searched_lance

    def release_idle(self, now: float | None = None) -> builtins.list[str]:
        """Drop the vector cache's users no read has used for ``vector_cache_idle_s`` (``VectorCache.release_idle``;
        ``now``: its clock, ``time.monotonic``); returns them."""
        idle_s = self.settings.vector_cache_idle_s
        return self._cache.release_idle(idle_s, now) if idle_s > 0 else []

    @property
    def cached_users(self) -> int:
        """How many users the vector cache holds."""
        return len(self._cache)

    # reads (``StoreReads``) -----------------------------------------------------------------------------

    def at_hand(self, user_id: str) -> bool:
        """Whether the read path's lookups of ``user_id`` are served from memory (``StoreReads.at_hand``)."""
        return self.reads.at_hand(user_id)

    def term_pieces(
        self, user_id: str, ids: Sequence[str], vectors: TermVectors
    ) -> builtins.list[npt.NDArray[np.int64] | None]:
        """The word pieces kept for these records of the user (``StoreReads.term_pieces``)."""
        return self.reads.term_pieces(user_id, ids, vectors)

    async def get(self, user_id: str, id: str) -> MemoryRecord | None:
        """One record of the user, or None."""
        return await self.reads.get(user_id, id)

    async def get_many(self, user_id: str, ids: Sequence[str]) -> builtins.list[MemoryRecord]:
        """The user's records with these ids, vectors included, in the order asked (missing ones left out)."""
        return await self.reads.get_many(user_id, ids)

    async def list(
        self,
        user_id: str,
        kinds: Sequence[Kind] | None = None,
        *,
        limit: int = 50,
        cursor: str | None = None,
        include_invalid: bool = False,
    ) -> Page:
        """The user's records, newest first (created_at, then id, descending), ``limit`` at a time."""
        return await self.reads.list(user_id, kinds, limit=limit, cursor=cursor, include_invalid=include_invalid)

    async def user_turns(self, user_id: str, since: datetime, until: datetime) -> builtins.list[MemoryRecord]:
        """The user's valid turns created in [since, until], newest first (``StoreReads.user_turns``)."""
        return await self.reads.user_turns(user_id, since, until)

    async def vector_search(
        self,
        user_id: str,
        query: npt.NDArray[np.float32],
        k: int,
        *,
        kinds: Sequence[Kind] | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
        include_invalid: bool = False,
    ) -> builtins.list[Hit]:
        """The ``k`` records nearest to ``query`` (cosine), valid ones only by default."""
        found = self.reads.vector_search(
            user_id, query, k, kinds=kinds, since=since, until=until, include_invalid=include_invalid
        )
        return await found

    async def vector_search_pools(
        self, user_id: str, query: npt.NDArray[np.float32], pools: Sequence[Pool]
    ) -> builtins.list[builtins.list[Hit]]:
        """The records nearest to ``query`` (cosine) in each pool of the user's records, in one pass."""
        return await self.reads.vector_search_pools(user_id, query, pools)

    async def keyword_search(
        self,
        user_id: str,
        query: str,
        k: int,
        *,
        kinds: Sequence[Kind] | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
        include_invalid: bool = False,
    ) -> builtins.list[Hit]:
        """The ``k`` best BM25 matches of ``query`` among the user's records, valid ones only by default."""
        found = self.reads.keyword_search(
            user_id, query, k, kinds=kinds, since=since, until=until, include_invalid=include_invalid
        )
        return await found

    async def keyword_search_pools(
        self, user_id: str, query: str, pools: Sequence[Pool]
    ) -> builtins.list[builtins.list[Hit]]:
        """The best BM25 matches of ``query`` in each pool of the user's records, in one trip to the index."""
        return await self.reads.keyword_search_pools(user_id, query, pools)

    async def read_many(self, user_id: str, ids: Sequence[str]) -> builtins.list[MemoryRecord]:
        """``get_many`` for the read path (``StoreReads.read_many``)."""
        return await self.reads.read_many(user_id, ids)

    async def newest(self, user_id: str, kinds: Sequence[Kind], limit: int) -> builtins.list[MemoryRecord]:
        """The user's newest valid records of ``kinds``, newest first (``StoreReads.newest``)."""
        return await self.reads.newest(user_id, kinds, limit)

    def export(self, user_id: str) -> AsyncIterator[str]:
        """Every record of the user, history included, oldest first, as JSON lines (each ends in ``\\n``)."""
        return self.reads.export(user_id)

    def records_with_vectors(self, user_id: str | None = None) -> AsyncIterator[MemoryRecord]:
        """Every record of one user (or of everyone), vectors included, streamed batch by batch (for export)."""
        return self.reads.records_with_vectors(user_id)

    async def count(self, user_id: str | None = None) -> int:
        """How many records one user (or everyone) has, history included."""
        return await self.reads.count(user_id)

    async def user_ids(self) -> builtins.list[str]:
        """Every user with at least one record."""
        return await self.reads.user_ids()

    async def due_for_deletion(self, now: datetime, turns_before: datetime | None) -> dict[str, Due]:
        """The rows retention deletes, by user (``StoreReads.due_for_deletion``)."""
        return await self.reads.due_for_deletion(now, turns_before)

    # writes (``StoreWrites``) ---------------------------------------------------------------------------

    async def add(self, records: Sequence[MemoryRecord]) -> builtins.list[MemoryRecord]:
        """Embed (where needed) and store ``records``; returns once both arms can find them (idempotent by id)."""
        return await self.writes.add(records)

    async def update(self, user_id: str, id: str, **changes: Any) -> MemoryRecord | None:
        """Change fields of one record (re-embedding it if the text changes); None if it is not there."""
        return await self.writes.update(user_id, id, **changes)

    async def update_many(self, user_id: str, ids: Sequence[str], **changes: Any) -> builtins.list[MemoryRecord]:
        """Change the same fields (not the text) of several records of the user, in one commit of each arm."""
        return await self.writes.update_many(user_id, ids, **changes)

    async def supersede(self, user_id: str, old_id: str, new: MemoryRecord) -> MemoryRecord:
        """Store ``new`` and retire ``old_id`` (kept as history: invalid, superseded by ``new``)."""
        if new.user_id != user_id:
            raise StoreError("a record can only supersede a record of the same user")
        [added] = await self.add([new])
        await self.update(user_id, old_id, valid=False, superseded_by=added.id)
        return added

    async def touch(
        self, user_id: str, ids: Sequence[str], at: datetime | None = None, young: Collection[str] | None = None
    ) -> None:
        """Note that these records were used now (reads see it at once; LanceDB within ``touch_flush_s``, but for
        ``young`` ones: ``young_of``; None: as this store's cache knows them)."""
        when = at or utcnow()
        await self.writes.touch(user_id, ids, when, self.young_of(user_id, ids, when) if young is None else young)

    def young_of(self, user_id: str, ids: Sequence[str], at: datetime) -> frozenset[str]:
        """Those of ``ids`` created within the touch granularity before ``at``, as far as the vector cache holds
        the user (their access time is shown, never written: ``touches.TouchBuffer``)."""
        entry, granularity = self._cache.current(user_id), self._touches.granularity
        return entry.created_after(ids, at - granularity) if entry is not None and granularity else frozenset()

    async def delete(self, user_id: str, id: str) -> bool:
        """Delete one record from both arms and the cache; False if the user has no such record."""
        return bool(await self.delete_many(user_id, [id]))

    async def delete_many(self, user_id: str, ids: Sequence[str]) -> builtins.list[str]:
        """Delete the user's records with these ids from both arms and the cache; the ids that were there."""
        return await self.writes.delete_many(user_id, ids)

    async def forget_user(self, user_id: str, *, purge: bool = True) -> dict[str, int]:
        """Erase every record of the user from both arms, the cache and the files (``StoreWrites.forget_user``),
        and their query adapter."""
        counts = await self.writes.forget_user(user_id, purge=purge)
        await self.adapters.delete(user_id)
        return counts

    async def repair(self) -> dict[str, int]:
        """Make Tantivy agree with LanceDB: index what it lacks or holds stale, drop what LanceDB lost."""
        return await self.writes.repair()

    async def optimize(self) -> None:
        """One maintenance round (``StoreWrites.optimize``); the ticker runs it every ``optimize_interval_s``."""
        await self.writes.optimize()

    async def remove_old_versions(self) -> None:
        """Old LanceDB versions removed (``StoreWrites.remove_old_versions``); its ticker runs it every
        ``compaction.CLEANUP_EVERY_S``, beside the maintenance rounds."""
        await self.writes.remove_old_versions()

    async def reindex(self, progress: Callable[[int, int], None] | None = None) -> int:
        """Re-embed every record with this store's embedder into a fresh table and swap it in."""
        return await self.writes.reindex(progress)
