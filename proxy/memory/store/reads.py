"""Reading the store: every read scoped to one user, served from the vector cache or LanceDB, with touches applied.

``StoreReads`` is what ``memory_store.MemoryStore`` reads with, beside its ``writes.StoreWrites``; both work on
the parts the store owns (``StoreParts``).
Keyword hits are resolved against LanceDB's records (or the cache, which is never older than LanceDB), so a
record deleted from LanceDB is never returned even while the keyword index still holds it. Every record
returned carries the user's pending access time (``touches.TouchBuffer``).
"""

from __future__ import annotations

import asyncio
import builtins
import functools
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import NamedTuple, cast

import numpy as np
import numpy.typing as npt
import orjson
import pyarrow as pa
import pyarrow.compute as pc

from proxy.memory.errors import StoreError
from proxy.memory.pieces import TermVectors, term_vectors_of
from proxy.memory.store.cursors import page_keys
from proxy.memory.store.filters import due_filter, record_filter
from proxy.memory.store.ids import check_user_id
from proxy.memory.store.keyword import KeywordIndex
from proxy.memory.store.keyword_schema import keyword_filter
from proxy.memory.store.records import Kind, MemoryRecord, Pool, from_row
from proxy.memory.store.settings import DocumentEmbedder
from proxy.memory.store.table import RECORD_COLUMNS, MemoryTable
from proxy.memory.store.touches import TouchBuffer
from proxy.memory.store.user_vectors import UserVectors, estimated_bytes
from proxy.memory.store.vector_cache import VectorCache


class Hit(NamedTuple):
    """One search result: the record (without its vector) and its score (a tuple: hundreds are made a request,
    at a fraction of a frozen dataclass's cost)."""

    record: MemoryRecord
    score: float


# ``Hit(*pair)`` in C: a NamedTuple's own ``__new__`` is a Python function, slower
_hit = cast("Callable[[tuple[MemoryRecord, float]], Hit]", functools.partial(tuple.__new__, Hit))


class Due(NamedTuple):
    """One user's rows that retention deletes: past their ``expires_at``, and turns older than the retention."""

    expired: list[str]
    old_turns: list[str]


@dataclass(frozen=True)
class Page:
    """One page of a listing and the cursor of the next (None at the end)."""

    data: list[MemoryRecord]
    next_cursor: str | None


@dataclass(frozen=True, slots=True)
class StoreParts:
    """What the store owns and its reads and writes share: the table of record, the keyword index, the vector
    cache, the pending access times, and the new records not yet published to the cache (by user)."""

    table: MemoryTable
    keyword: KeywordIndex
    cache: VectorCache
    touches: TouchBuffer
    # New records LanceDB holds and Tantivy does not yet (the write's keyword commit): a user's load into the
    # vector cache and LanceDB's own vector search leave them out, so that no read ranks them on the dense arm
    # alone; the write's publish then brings them into the cache (``StoreWrites._publish``).
    unpublished: dict[str, set[str]] = field(default_factory=dict)


class StoreReads:
    """The reads of every memory of every user, on the parts ``MemoryStore`` owns."""

    def __init__(self, parts: StoreParts, embedder: DocumentEmbedder) -> None:
        self._lance = parts.table
        self._keyword = parts.keyword
        self._cache = parts.cache
        self._touches = parts.touches
        self._unpublished = parts.unpublished
        self._embedder = embedder
        self._dim = embedder.dim
        # Whether a vector search went to LanceDB (its user not in the cache): only then does an ANN index pay
        # for its build (long, on every core and with GBs of RAM at 100k rows, while the chat waits).
        self.searched_lance = parts.cache.max_bytes == 0

    @property
    def cache(self) -> VectorCache:
        """The per-user vector cache (for metrics)."""
        return self._cache

    def at_hand(self, user_id: str) -> bool:
        """Whether the read path's lookups of ``user_id`` are served from memory, nothing to wait on: the user's
        vectors and records are in the cache, and they are this embedder's."""
        return self._lance.mismatch is None and self._cache.peek(user_id) is not None

    def check_model(self) -> None:
        """Raise ``EmbedderMismatch`` when the table's vectors are not this embedder's."""
        if self._lance.mismatch is not None:
            raise self._lance.mismatch

    def term_pieces(
        self, user_id: str, ids: Sequence[str], vectors: TermVectors
    ) -> builtins.list[npt.NDArray[np.int64] | None]:
        """The word pieces kept for these records of the user, where the vector cache holds them (None where it
        does not, and for all of them when ``vectors`` are not this store's model's)."""
        entry = self._cache.current(user_id)
        if entry is None or vectors is not term_vectors_of(self._embedder):
            return [None] * len(ids)
        return entry.pieces_of(ids)

    async def get(self, user_id: str, id: str) -> MemoryRecord | None:
        """One record of the user, or None."""
        found = await self.get_many(user_id, [id])
        return found[0] if found else None

    def _cached(self, user_id: str) -> UserVectors | None:
        """The user's vector-cache entry if the read side holds them (never loaded here): it holds every write
        once LanceDB has it, so it answers as LanceDB would, without a filtered scan of the table (which
        touches every fragment not yet compacted into the scalar indexes: after a burst of writes, hundreds)."""
        return None if self._lance.mismatch else self._cache.peek(user_id)

    async def get_many(self, user_id: str, ids: Sequence[str]) -> list[MemoryRecord]:
        """The user's records with these ids, vectors included, in the order asked (missing ones left out)."""
        check_user_id(user_id)
        wanted = list(dict.fromkeys(ids))
        entry = self._cached(user_id)
        if entry is not None:  # cached records carry their pending access times already (``_load_user``)
            found = [record for record in entry.records(wanted) if record is not None]
            return [record.replace(embedding=entry.vector(record.id)) for record in found]
        by_id = {record.id: record for record in await self._lance.records(user_id, wanted)}
        return [self._touches.touched(by_id[i]) for i in wanted if i in by_id]

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
        check_user_id(user_id)
        entry = self._cached(user_id)
        if entry is not None:
            keys = entry.keys(kinds, include_invalid)
        else:
            keys = await self._lance.keys(user_id, kinds, include_invalid)
        page_ids, next_cursor = page_keys(keys, cursor, limit)
        return Page(await self.get_many(user_id, page_ids), next_cursor)

    async def user_turns(self, user_id: str, since: datetime, until: datetime) -> builtins.list[MemoryRecord]:
        """The user's valid turns created in [since, until], newest first (as ``list`` orders them), in one
        columnar read: ``list`` pages through keys and records at many times the CPU.

        Each record's ``embedding`` is a read-only row of one float32 matrix (not a list of Python floats).
        """
        check_user_id(user_id)
        where = record_filter(user_id, kinds=[Kind.TURN], since=since, until=until, include_invalid=False)
        batches = [batch async for batch in self._lance.batches([*RECORD_COLUMNS, "embedding"], where)]
        if not batches:
            return []
        table = pa.Table.from_batches(batches).sort_by([("created_at", "descending"), ("id", "descending")])
        column = table["embedding"].combine_chunks()
        vectors = column.flatten().to_numpy().reshape(len(table), -1)
        vectors.setflags(write=False)
        rows = table.drop_columns(["embedding"]).to_pylist()
        touch = self._touches.toucher(user_id)
        return [touch(from_row(row).replace(embedding=vector)) for row, vector in zip(rows, vectors, strict=True)]

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
        pool = Pool(k, tuple(kinds or ()), since, until, include_invalid)
        return (await self.vector_search_pools(user_id, query, [pool]))[0]

    async def vector_search_pools(
        self, user_id: str, query: npt.NDArray[np.float32], pools: Sequence[Pool]
    ) -> builtins.list[builtins.list[Hit]]:
        """The records nearest to ``query`` (cosine) in each pool of the user's records, in one pass."""
        check_user_id(user_id)
        self.check_model()
        vector = np.asarray(query, dtype=np.float32).reshape(-1)
        if vector.shape != (self._dim,):
            raise StoreError(f"query vector has shape {vector.shape}, expected ({self._dim},)")
        entry = await self._cache.get_or_load(user_id, lambda: self._load_user(user_id))
        if entry is None:
            self.searched_lance = True  # a user the cache cannot hold: LanceDB's ANN index is worth building
            return list(await asyncio.gather(*(self._lance_vector_search(user_id, vector, pool) for pool in pools)))
        found = entry.search_rows(vector, pools)  # single-thread BLAS, cheaper than a hop to a thread
        # cached records carry their pending access times already (``_load_user``)
        made = entry.records_by_pool([rows for rows, _ in found])
        return [
            list(map(_hit, zip(records, scores, strict=True))) for records, (_, scores) in zip(made, found, strict=True)
        ]

    async def _lance_vector_search(
        self, user_id: str, vector: npt.NDArray[np.float32], pool: Pool
    ) -> builtins.list[Hit]:
        where = record_filter(
            user_id, kinds=pool.kinds or None, since=pool.since, until=pool.until, include_invalid=pool.include_invalid
        )
        pairs = await self._lance.vector_search(user_id, vector, pool.k, where)
        touch = self._touches.toucher(user_id)
        unpublished = self._unpublished.get(user_id, ())
        return [Hit(touch(record), score) for record, score in pairs if record.id not in unpublished]

    async def _load_user(self, user_id: str) -> UserVectors | None:
        rows = await self._lance.count(user_id)
        if estimated_bytes(rows, self._lance.stored_dim) > self._cache.max_bytes:
            return None
        table = await self._lance.user_rows(user_id)
        if unpublished := self._unpublished.get(user_id):  # their publish, replayed onto this load, adds them
            table = table.filter(pc.invert(pc.is_in(table["id"], pa.array(sorted(unpublished), pa.string()))))
        entry = await asyncio.to_thread(UserVectors, user_id, self._lance.stored_dim, table)
        # Access times noted before the load and not yet written: a cached record carries them, so reads from
        # the cache apply no touches (those noted during the load are replayed onto it by the cache).
        for record_id, at in self._touches.pending_of(user_id).items():
            entry.touch(record_id, at)
        return entry

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
        pool = Pool(k, tuple(kinds or ()), since, until, include_invalid)
        return (await self.keyword_search_pools(user_id, query, [pool]))[0]

    async def keyword_search_pools(
        self, user_id: str, query: str, pools: Sequence[Pool]
    ) -> builtins.list[builtins.list[Hit]]:
        """The best BM25 matches of ``query`` in each pool of the user's records, in one trip to the index."""
        check_user_id(user_id)
        searches = [(p.k, keyword_filter(p.kinds, p.since, p.until, p.include_invalid)) for p in pools]
        found = await self._keyword.search_pools(user_id, query, searches)
        if not any(found):
            return [[] for _ in pools]
        entry = await self._read_entry(user_id)
        if entry is not None:  # the filter columns say which hits are live and in their pool (records carry touches)
            held = [
                entry.rows_in_pool([record_id for record_id, _ in scored], pool)
                for pool, scored in zip(pools, found, strict=True)
            ]
            made = entry.records_by_pool([rows for rows, _ in held])
            return [
                list(map(_hit, zip(records, [scored[i][1] for i in kept], strict=True)))
                for records, (_, kept), scored in zip(made, held, found, strict=True)
            ]
        ids = list(dict.fromkeys(record_id for scored in found for record_id, _ in scored))
        by_id = await self._lance_records_by_id(user_id, ids)
        return [
            [
                _hit((record, score))
                for record_id, score in scored
                if (record := by_id.get(record_id)) is not None and _matches(record, user_id, pool)
            ]
            for pool, scored in zip(pools, found, strict=True)
        ]

    async def read_many(self, user_id: str, ids: Sequence[str]) -> builtins.list[MemoryRecord]:
        """``get_many`` for the read path: through the vector cache (loading the user), LanceDB when they do
        not fit; the cache holds every write once LanceDB and Tantivy have it, so the answer is the same."""
        check_user_id(user_id)
        by_id = await self._records_by_id(user_id, ids)
        return [by_id[i] for i in dict.fromkeys(ids) if i in by_id]

    async def newest(self, user_id: str, kinds: Sequence[Kind], limit: int) -> builtins.list[MemoryRecord]:
        """The user's newest valid records of ``kinds``, newest first (as ``list`` orders them), for the read
        path: from the vector cache when the user fits (no LanceDB scan per request: under sustained chat those
        listings took seconds each), else from a listing."""
        check_user_id(user_id)
        entry = await self._read_entry(user_id)
        if entry is None:
            return (await self.list(user_id, kinds, limit=limit)).data
        found = entry.records(entry.ordered_ids(kinds, include_invalid=False)[:limit])
        return [record for record in found if record is not None]

    async def _read_entry(self, user_id: str) -> UserVectors | None:
        """The user's cache entry for a read path lookup (loading it), or None: the user does not fit, or the
        table's vectors are not the embedder's (``mismatch``)."""
        if self._lance.mismatch:
            return None
        return await self._cache.get_or_load(user_id, lambda: self._load_user(user_id))

    async def _records_by_id(self, user_id: str, ids: Sequence[str]) -> dict[str, MemoryRecord]:
        """The user's records with these ids, pending access times applied: from the vector cache (loading the
        user; its records carry them) or LanceDB."""
        entry = await self._read_entry(user_id)
        if entry is not None:
            return {r.id: r for r in entry.records(ids) if r is not None}
        return await self._lance_records_by_id(user_id, ids)

    async def _lance_records_by_id(self, user_id: str, ids: Sequence[str]) -> dict[str, MemoryRecord]:
        """``_records_by_id`` for a user the cache does not hold: from LanceDB, pending access times applied."""
        touch = self._touches.toucher(user_id)
        return {r.id: touch(r) for r in await self._lance.records(user_id, ids, embedding=False)}

    async def export(self, user_id: str) -> AsyncIterator[str]:
        """Every record of the user, history included, oldest first, as JSON lines (each ends in ``\\n``)."""
        check_user_id(user_id)
        tables = [batch async for batch in self._lance.batches(RECORD_COLUMNS, record_filter(user_id))]
        if not tables:
            return
        rows = pa.Table.from_batches(tables).sort_by([("created_at", "ascending"), ("id", "ascending")])
        for row in rows.to_pylist():
            yield orjson.dumps(self._touches.touched(from_row(row)).public_dict()).decode() + "\n"

    async def records_with_vectors(self, user_id: str | None = None) -> AsyncIterator[MemoryRecord]:
        """Every record of one user (or of everyone), vectors included, streamed batch by batch (for export)."""
        where = record_filter(user_id) if user_id is not None else None
        async for batch in self._lance.batches([*RECORD_COLUMNS, "embedding"], where):
            for row in batch.to_pylist():
                yield self._touches.touched(from_row(row))

    async def count(self, user_id: str | None = None) -> int:
        """How many records one user (or everyone) has, history included."""
        if user_id is not None:
            check_user_id(user_id)
        return await self._lance.count(user_id)

    async def user_ids(self) -> builtins.list[str]:
        """Every user with at least one record."""
        return await self._lance.user_ids()

    async def due_for_deletion(self, now: datetime, turns_before: datetime | None) -> dict[str, Due]:
        """The rows retention deletes (``filters.due_filter``), by user: one scan of four columns."""
        due: dict[str, Due] = {}
        columns = ["id", "user_id", "kind", "expires_at"]
        async for batch in self._lance.batches(columns, due_filter(now, turns_before)):
            rows = batch.to_pydict()
            for id_, user, expires in zip(rows["id"], rows["user_id"], rows["expires_at"], strict=True):
                entry = due.setdefault(user, Due([], []))
                (entry.expired if expires is not None and expires <= now else entry.old_turns).append(id_)
        return due


def _matches(record: MemoryRecord, user_id: str, pool: Pool) -> bool:
    """Whether a record found by the keyword index is in the pool (the cache may be newer than the index)."""
    return (
        record.user_id == user_id
        and (pool.include_invalid or record.valid)
        and (not pool.kinds or record.kind in pool.kinds)
        and (pool.since is None or record.created_at >= pool.since)
        and (pool.until is None or record.created_at <= pool.until)
    )
