"""The memory store: LanceDB (source of truth, vectors) and Tantivy (BM25) behind one async interface.

Write order, which keeps both arms consistent through crashes:

* add: embed, then one LanceDB ``add`` per batch (durable), then Tantivy add + commit, then return.
* edit: LanceDB ``merge_insert`` (one commit), then Tantivy re-index + commit.
* delete / forget: LanceDB first, then Tantivy, so a crash can leave an orphan Tantivy document (removed
  by the repair, and never returned meanwhile: keyword hits are resolved against LanceDB's records) but
  never resurrect a deleted record.

After each write the LanceDB version that Tantivy reflects is noted in ``sync.json``. On open, if the
table moved past that note (a crash between the two arms), the startup repair compares every record's
signature in both and re-indexes what Tantivy lacks or holds stale, and drops what LanceDB no longer has.

Forgetting a user removes their rows from both indexes and the cache, then purges the bytes from disk:
the LanceDB fragments that held them are rewritten and old versions deleted, and the Tantivy index is
rebuilt from LanceDB. A ``purge.pending`` marker makes a crash during that step finish it at next open.
"""

from __future__ import annotations

import asyncio
import base64
import builtins
import contextlib
import dataclasses
import fcntl
import json
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import orjson
import pyarrow as pa
import pyarrow.compute as pc
import structlog
from pydantic import BaseModel, ConfigDict, Field

from proxy.memory.embedders.protocol import Embedder
from proxy.memory.errors import EmbedderError, EmbedderMismatch, InvalidCursor, StoreError
from proxy.memory.faults import StorageHealth
from proxy.memory.keyword import KeywordDoc, KeywordIndex, keyword_filter
from proxy.memory.lance import (
    RECORD_COLUMNS,
    BatchWriter,
    MemoryTable,
    Submission,
    Ticker,
    check_user_id,
    record_filter,
    valid_record_id,
)
from proxy.memory.records import Kind, MemoryRecord, Pool, arrow_schema, from_row, utcnow
from proxy.memory.vector_cache import UserVectors, VectorCache, estimated_bytes, single_thread_blas

__all__ = ["Hit", "MemoryStore", "Page", "StoreSettings"]

log = structlog.get_logger(__name__)

TOUCH_FLUSH_S = 1.0
OPTIMIZE_KEEP_VERSIONS = timedelta(minutes=10)
_FROZEN_FIELDS = frozenset({"id", "user_id", "embedding", "model_id"})
_KEYWORD_FIELDS = frozenset({"text", "kind", "valid", "created_at"})
_REPAIR_COLUMNS = ["id", "user_id", "kind", "text", "created_at", "valid"]


class StoreSettings(BaseModel):
    """Where the store keeps its data and how it batches, compacts and caches."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    path: Path
    flush_max_rows: int = Field(256, ge=1)
    flush_interval_ms: int = Field(20, ge=0)
    optimize_interval_s: float = Field(300.0, gt=0)
    ann_index_min_rows: int = Field(50_000, ge=1)
    vector_cache_bytes: int = Field(512 * 2**20, ge=0)  # a 100k-memory user fits (~290 MB)


@dataclass(frozen=True)
class Hit:
    """One search result: the record (without its vector) and its score."""

    record: MemoryRecord
    score: float


@dataclass(frozen=True)
class Page:
    """One page of a listing and the cursor of the next (None at the end)."""

    data: list[MemoryRecord]
    next_cursor: str | None


class MemoryStore:
    """Every memory of every user; open with ``async with`` (starts the writer and maintenance tasks)."""

    def __init__(self, settings: StoreSettings, embedder: Embedder, *, allow_mismatch: bool = False,
                 health: StorageHealth | None = None) -> None:
        self.settings = settings
        self.health = health or StorageHealth()
        self._embedder = embedder
        self._lance = MemoryTable(
            settings.path / "lance", embedder.model_id, embedder.dim, allow_mismatch=allow_mismatch
        )
        self._keyword = KeywordIndex(settings.path / "tantivy")
        self._cache = VectorCache(settings.vector_cache_bytes)
        self._lock = asyncio.Lock()
        self._touches: dict[str, dict[str, datetime]] = {}
        self._needs_repair = False
        self._purges = 0
        self._writer: BatchWriter[MemoryRecord] | None = None
        self._stack: AsyncExitStack | None = None

    @property
    def embedder(self) -> Embedder:
        """The embedder this store's vectors come from."""
        return self._embedder

    @property
    def cache(self) -> VectorCache:
        """The per-user vector cache (for metrics)."""
        return self._cache

    # lifecycle ------------------------------------------------------------------------------------------

    async def __aenter__(self) -> MemoryStore:
        single_thread_blas()
        self.settings.path.mkdir(parents=True, exist_ok=True)
        async with AsyncExitStack() as stack:
            stack.enter_context(_owned(self.settings.path / "LOCK"))
            await self._lance.open()
            stack.callback(self._lance.close)
            await stack.enter_async_context(self._keyword)
            stack.push_async_callback(self._cache.aclose)  # loads in flight stop before the tables close
            await self._recover()
            stack.push_async_callback(self._close_writes)
            self._writer = BatchWriter(
                self._flush, self.settings.flush_max_rows, self.settings.flush_interval_ms / 1000, health=self.health
            )
            await stack.enter_async_context(self._writer)
            await stack.enter_async_context(
                Ticker("memory-optimize", self.settings.optimize_interval_s, self.optimize, self.health)
            )
            await stack.enter_async_context(Ticker("memory-touch", TOUCH_FLUSH_S, self._flush_touches, self.health))
            self._stack = stack.pop_all()
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._stack is not None:
            await self._stack.aclose()
            self._stack = None

    async def _close_writes(self) -> None:
        await self._flush_touches()
        async with self._lock:
            await self._mark_synced()

    # consistency ----------------------------------------------------------------------------------------

    @property
    def _sync_path(self) -> Path:
        return self.settings.path / "sync.json"

    @property
    def _purge_path(self) -> Path:
        return self.settings.path / "purge.pending"

    async def _mark_synced(self) -> None:
        """Note that Tantivy reflects the live LanceDB table at its current version."""
        note = {"table": self._lance.manifest.table if self._lance.manifest else "", "version": 0}
        note["version"] = await self._lance.version()
        tmp = self._sync_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(note))
        os.replace(tmp, self._sync_path)

    def _synced_note(self) -> dict[str, Any]:
        try:
            return dict(json.loads(self._sync_path.read_text()))
        except (OSError, ValueError):
            return {}

    async def _recover(self) -> None:
        """Finish an interrupted purge, and repair Tantivy if it may lag behind LanceDB."""
        if self._purge_path.exists():
            await self._purge(None)
        note = self._synced_note()
        table = self._lance.manifest.table if self._lance.manifest else ""
        if self._keyword.fresh or note != {"table": table, "version": await self._lance.version()}:
            await self.repair()
        await self._mark_synced()

    async def repair(self) -> dict[str, int]:
        """Make Tantivy agree with LanceDB: index what it lacks or holds stale, drop what LanceDB lost."""
        indexed = await self._keyword.signatures()
        seen: set[str] = set()
        stale: list[KeywordDoc] = []
        async for batch in self._lance.batches(_REPAIR_COLUMNS):
            for doc in _keyword_docs(batch):
                seen.add(doc.id)
                if indexed.get(doc.id) != doc.sig:
                    stale.append(doc)
        orphans = [record_id for record_id in indexed if record_id not in seen]
        if stale or orphans:
            await self._keyword.remove_ids(orphans)
            await self._keyword.upsert(stale)
            await self._keyword.commit()
            log.warning("memory.repaired", reindexed=len(stale), dropped=len(orphans))
        return {"reindexed": len(stale), "dropped": len(orphans)}

    # writes ---------------------------------------------------------------------------------------------

    def _check_model(self) -> None:
        if self._lance.mismatch is not None:
            raise self._lance.mismatch

    async def add(self, records: Sequence[MemoryRecord]) -> list[MemoryRecord]:
        """Embed (where needed) and store ``records``; returns once both arms can find them.

        Idempotent by id: a record whose id is already stored is left as it is.
        """
        self._check_model()
        records = list(records)
        for record in records:
            check_user_id(record.user_id)
            if not valid_record_id(record.id):
                raise StoreError(f"invalid record id {record.id[:40]!r}")
        prepared = await self._embedded(records)
        if prepared:
            if self._writer is None:
                raise StoreError("the memory store is not open")
            await self._writer.submit(prepared)
        return prepared

    async def _embedded(self, records: list[MemoryRecord]) -> list[MemoryRecord]:
        """Records with a unit vector of this store's model each (one batched call for the missing)."""
        todo = [i for i, record in enumerate(records) if record.embedding is None]
        vectors = await self._embed([records[i].text for i in todo]) if todo else None
        fresh = dict(zip(todo, vectors if vectors is not None else [], strict=True))
        model, dim = self._embedder.model_id, self._embedder.dim
        out = []
        for i, record in enumerate(records):
            if i not in fresh and record.model_id not in ("", model):
                raise EmbedderMismatch(record.model_id, len(record.embedding or ()), model, dim)
            vector = fresh[i] if i in fresh else np.asarray(record.embedding, dtype=np.float32)
            if vector.shape != (dim,):
                raise StoreError(f"record {record.id} has a vector of shape {vector.shape}")
            same = record.model_id == model and record.embedding is vector
            out.append(record if same else record.replace(embedding=vector, model_id=model))
        return out

    async def _embed(self, texts: list[str]) -> npt.NDArray[np.float32]:
        vectors = np.asarray(await self._embedder.embed_documents(texts), dtype=np.float32)
        if vectors.shape != (len(texts), self._embedder.dim):
            raise EmbedderError(f"embedder returned shape {vectors.shape} for {len(texts)} texts")
        return vectors

    async def _flush(self, batch: list[Submission[MemoryRecord]]) -> list[BaseException | None]:
        """Write one batch of submissions: LanceDB, then cache, then Tantivy; one commit each."""
        unique: dict[str, MemoryRecord] = {}
        for submission in batch:
            for record in submission.items:
                unique.setdefault(record.id, record)
        async with self._lock:
            owners = await self._lance.existing(list(unique))
            errors: list[BaseException | None] = [_foreign_ids(s, owners) for s in batch]
            refused = {r.id for s, e in zip(batch, errors, strict=True) if e is not None for r in s.items}
            new = [r for r in unique.values() if r.id not in owners and r.id not in refused]
            if new:
                await self._write_new(new)
        return errors

    async def _write_new(self, records: list[MemoryRecord]) -> None:
        vectors = np.stack([np.asarray(record.embedding, dtype=np.float32) for record in records])
        await self._lance.add(_arrow_rows(records, vectors))
        self._cache.upsert(records, vectors)
        await self._index(lambda: self._keyword.add([KeywordDoc.of(record) for record in records]))

    async def _index(self, change: Callable[[], Awaitable[None]]) -> None:
        """Apply a change to Tantivy after LanceDB took it; if Tantivy fails, repair at the next optimize."""
        try:
            await change()
            await self._keyword.commit()
        except BaseException:
            self._needs_repair = True
            raise
        await self._mark_synced()

    async def update(self, user_id: str, id: str, **changes: Any) -> MemoryRecord | None:
        """Change fields of one record (re-embedding it if the text changes); None if it is not there."""
        check_user_id(user_id)
        bad = set(changes) & _FROZEN_FIELDS | set(changes) - {f.name for f in dataclasses.fields(MemoryRecord)}
        if bad:
            raise ValueError(f"cannot update {sorted(bad)}")
        if "kind" in changes:
            changes["kind"] = Kind(changes["kind"])
        vector = None
        if "text" in changes:
            self._check_model()
            vector = (await self._embed([str(changes["text"])]))[0]
        async with self._lock:
            return await self._update_locked(user_id, id, changes, vector)

    async def _update_locked(
        self, user_id: str, record_id: str, changes: dict[str, Any], vector: npt.NDArray[np.float32] | None
    ) -> MemoryRecord | None:
        found = await self._lance.records(user_id, [record_id])
        if not found:
            return None
        current = found[0]
        if vector is None:
            vector = np.asarray(current.embedding, dtype=np.float32)
        new = current.replace(**changes, updated_at=utcnow(), embedding=vector)
        await self._lance.replace(user_id, _arrow_rows([new], vector[None, :]))
        self._cache.upsert([new], vector[None, :])
        if _KEYWORD_FIELDS & set(changes):
            await self._index(lambda: self._keyword.upsert([KeywordDoc.of(new)]))
        else:
            await self._mark_synced()
        return self._touched(new)

    async def update_many(self, user_id: str, ids: Sequence[str], **changes: Any) -> builtins.list[MemoryRecord]:
        """Change the same fields (not the text) of several records of the user: one LanceDB commit and one index
        commit instead of one each per record; returns the updated records (missing ids are left out)."""
        check_user_id(user_id)
        bad = set(changes) & (_FROZEN_FIELDS | {"text", "kind"})
        bad |= set(changes) - {f.name for f in dataclasses.fields(MemoryRecord)}
        if bad:
            raise ValueError(f"cannot update {sorted(bad)} of several records at once")
        async with self._lock:
            found = await self._lance.records(user_id, ids)
            if not found:
                return []
            vectors = np.stack([np.asarray(record.embedding, dtype=np.float32) for record in found])
            now = utcnow()
            new = [r.replace(**changes, updated_at=now, embedding=v) for r, v in zip(found, vectors, strict=True)]
            await self._lance.replace(user_id, _arrow_rows(new, vectors))
            self._cache.upsert(new, vectors)
            if _KEYWORD_FIELDS & set(changes):
                await self._index(lambda: self._keyword.upsert([KeywordDoc.of(record) for record in new]))
            else:
                await self._mark_synced()
        return [self._touched(record) for record in new]

    async def supersede(self, user_id: str, old_id: str, new: MemoryRecord) -> MemoryRecord:
        """Store ``new`` and retire ``old_id`` (kept as history: invalid, superseded by ``new``)."""
        if new.user_id != user_id:
            raise StoreError("a record can only supersede a record of the same user")
        [added] = await self.add([new])
        await self.update(user_id, old_id, valid=False, superseded_by=added.id)
        return added

    async def touch(self, user_id: str, ids: Sequence[str], at: datetime | None = None) -> None:
        """Note that these records were used now (written to LanceDB within about a second)."""
        check_user_id(user_id)
        when = at or utcnow()
        pending = self._touches.setdefault(user_id, {})
        valid = [record_id for record_id in ids if valid_record_id(record_id)]
        for record_id in valid:
            pending[record_id] = max(when, pending.get(record_id, when))
        # The cached records show it at once (reads then need no overlay); LanceDB gets it at the next flush.
        self._cache.patch(user_id, valid, last_accessed_at=when)

    async def _flush_touches(self) -> None:
        if not self._touches:
            return
        async with self._lock:
            pending, self._touches = self._touches, {}
            at = max(when for per_user in pending.values() for when in per_user.values())
            try:
                await self._lance.touch({user: list(ids) for user, ids in pending.items()}, at)
            except Exception:
                for user, ids in pending.items():  # keep them for the next round
                    self._touches.setdefault(user, {}).update(ids)
                raise
            for user, ids in pending.items():
                self._cache.patch(user, list(ids), last_accessed_at=at)
            await self._mark_synced()

    def _touched(self, record: MemoryRecord) -> MemoryRecord:
        return self._toucher(record.user_id)(record)

    def _toucher(self, user_id: str) -> Callable[[MemoryRecord], MemoryRecord]:
        """Applies the user's pending (not yet written) access times to their records; identity when none."""
        touches = self._touches.get(user_id)
        if not touches:
            return _same

        def touched(record: MemoryRecord) -> MemoryRecord:
            at = touches.get(record.id)
            if at is None or (record.last_accessed_at is not None and record.last_accessed_at >= at):
                return record
            return record.replace(last_accessed_at=at)

        return touched

    async def delete(self, user_id: str, id: str) -> bool:
        """Delete one record from both arms and the cache; False if the user has no such record."""
        check_user_id(user_id)
        if not valid_record_id(id):
            return False
        async with self._lock:
            if not await self._lance.records(user_id, [id], embedding=False):
                return False
            await self._lance.delete(user_id, [id])
            self._cache.remove(user_id, [id])
            self._touches.get(user_id, {}).pop(id, None)
            await self._index(lambda: self._keyword.remove(user_id, [id]))
        return True

    async def forget_user(self, user_id: str, *, purge: bool = True) -> dict[str, int]:
        """Erase every record of the user from both arms, the cache and the files; counts by kind.

        The records are gone from every read at once. Their bytes leave the disk before this returns
        (``purge=True``, which rewrites the data files they shared with other users: time grows with the
        table) or at the next maintenance round (``purge=False``; a restart finishes it too).
        """
        check_user_id(user_id)
        async with self._lock:
            counts = await self._lance.kind_counts(user_id)
            if not counts:
                return {str(kind): 0 for kind in Kind}
            fragments = await self._lance.fragments_of(user_id)
            self._purge_path.write_text("1")
            await self._lance.delete(user_id)
            self._cache.drop(user_id)
            self._touches.pop(user_id, None)
            if purge:
                await self._purge(fragments)
            else:
                await self._index(lambda: self._keyword.remove_user(user_id))
        log.info("memory.user_forgotten", records=sum(counts.values()), purged=purge)
        return {str(kind): counts.get(str(kind), 0) for kind in Kind}

    async def _purge(self, fragments: Sequence[int] | None) -> None:
        """Remove deleted rows' bytes: rebuild Tantivy from LanceDB while LanceDB rewrites its fragments.

        Until the rebuilt index is swapped in, the old one may still match the deleted records, but keyword
        hits are resolved against LanceDB (and the cache), so they are never returned.
        """
        self._purges += 1
        try:
            async with asyncio.TaskGroup() as group:
                group.create_task(self._keyword.rebuild(self._all_keyword_docs()))
                group.create_task(self._lance.purge(fragments))
        except ExceptionGroup as failed:
            raise failed.exceptions[0] from failed
        await self._mark_synced()
        self._purge_path.unlink(missing_ok=True)

    async def _all_keyword_docs(self) -> AsyncIterator[list[KeywordDoc]]:
        async for batch in self._lance.batches(_REPAIR_COLUMNS):
            yield _keyword_docs(batch)

    async def optimize(self) -> None:
        """Compact LanceDB, fold new rows into its indexes, drop versions older than ten minutes.

        Also finishes a deferred purge, repairs Tantivy if a write reached LanceDB but failed in Tantivy
        since the last round, and builds the ANN index once the table is large enough (outside the write
        lock: it takes minutes).
        """
        async with self._lock:
            if self._purge_path.exists():  # a forget_user(purge=False) left bytes to remove
                await self._purge(None)
            await self._lance.optimize(OPTIMIZE_KEEP_VERSIONS)
            if self._needs_repair:
                await self.repair()
                self._needs_repair = False
            await self._mark_synced()
        purges = self._purges
        if await self._lance.ensure_ann_index(self.settings.ann_index_min_rows):  # slow: outside the lock
            async with self._lock:
                if purges != self._purges:  # a user was forgotten meanwhile: the new index may hold them
                    await self._lance.purge([])
                await self._mark_synced()

    async def reindex(self, progress: Callable[[int, int], None] | None = None) -> int:
        """Re-embed every record with this store's embedder into a fresh table and swap it in."""
        await self._flush_touches()
        async with self._lock:
            done = await self._lance.reindex(self._embed, progress)
            self._cache.clear()
            await self._mark_synced()
        log.info("memory.reindexed", records=done, model=self._embedder.model_id)
        return done

    # reads ----------------------------------------------------------------------------------------------

    async def get(self, user_id: str, id: str) -> MemoryRecord | None:
        """One record of the user, or None."""
        found = await self.get_many(user_id, [id])
        return found[0] if found else None

    async def get_many(self, user_id: str, ids: Sequence[str]) -> list[MemoryRecord]:
        """The user's records with these ids, in the order asked (missing ones left out)."""
        check_user_id(user_id)
        by_id = {record.id: record for record in await self._lance.records(user_id, ids)}
        return [self._touched(by_id[i]) for i in dict.fromkeys(ids) if i in by_id]

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
        keys = await self._lance.keys(user_id, kinds, include_invalid)
        ordered = keys.sort_by([("created_at", "descending"), ("id", "descending")])
        created = ordered["created_at"].cast(pa.int64()).to_numpy()
        ids = ordered["id"].to_pylist()
        start = _cursor_position(created, ids, cursor) if cursor else 0
        page_ids = ids[start : start + max(0, limit)]
        more = start + len(page_ids) < len(ids) and page_ids
        next_cursor = _encode_cursor(int(created[start + len(page_ids) - 1]), page_ids[-1]) if more else None
        return Page(await self.get_many(user_id, page_ids), next_cursor)

    async def user_turns(self, user_id: str, since: datetime, until: datetime) -> builtins.list[MemoryRecord]:
        """The user's valid turns created in [since, until], newest first (as ``list`` orders them), in one
        columnar read: for 10k turns ``list`` pages through keys and records at ~10x the CPU.

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
        touch = self._toucher(user_id)
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
        self._check_model()
        vector = np.asarray(query, dtype=np.float32).reshape(-1)
        if vector.shape != (self._embedder.dim,):
            raise StoreError(f"query vector has shape {vector.shape}, expected ({self._embedder.dim},)")
        entry = await self._cache.get_or_load(user_id, lambda: self._load_user(user_id))
        if entry is None:
            return list(await asyncio.gather(*(self._lance_vector_search(user_id, vector, pool) for pool in pools)))
        found = entry.search_pools(vector, pools)  # ~0.3 ms of single-thread BLAS: less than a thread hop costs
        touch = self._toucher(user_id)
        out = []
        for scored in found:
            records = entry.records([record_id for record_id, _ in scored])
            out.append([Hit(touch(r), score) for r, (_, score) in zip(records, scored, strict=True) if r is not None])
        return out

    async def _lance_vector_search(
        self, user_id: str, vector: npt.NDArray[np.float32], pool: Pool
    ) -> builtins.list[Hit]:
        where = record_filter(
            user_id, kinds=pool.kinds or None, since=pool.since, until=pool.until, include_invalid=pool.include_invalid
        )
        pairs = await self._lance.vector_search(user_id, vector, pool.k, where)
        touch = self._toucher(user_id)
        return [Hit(touch(record), score) for record, score in pairs]

    async def _load_user(self, user_id: str) -> UserVectors | None:
        rows = await self._lance.count(user_id)
        if estimated_bytes(rows, self._lance.stored_dim) > self._cache.max_bytes:
            return None
        table = await self._lance.user_rows(user_id)
        return await asyncio.to_thread(UserVectors, user_id, self._lance.stored_dim, table)

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
        ids = list(dict.fromkeys(record_id for scored in found for record_id, _ in scored))
        if not ids:
            return [[] for _ in pools]
        by_id = await self._records_by_id(user_id, ids)
        touch = self._toucher(user_id)
        return [
            [
                Hit(touch(record), score)
                for record_id, score in scored
                if (record := by_id.get(record_id)) is not None and _matches(record, user_id, pool)
            ]
            for pool, scored in zip(pools, found, strict=True)
        ]

    async def _records_by_id(self, user_id: str, ids: Sequence[str]) -> dict[str, MemoryRecord]:
        """The user's records with these ids, from the vector cache (loading the user) or LanceDB."""
        entry = (
            None if self._lance.mismatch else await self._cache.get_or_load(user_id, lambda: self._load_user(user_id))
        )
        if entry is not None:
            return {r.id: r for r in entry.records(ids) if r is not None}
        return {r.id: r for r in await self._lance.records(user_id, ids, embedding=False)}

    async def export(self, user_id: str) -> AsyncIterator[str]:
        """Every record of the user, history included, oldest first, as JSON lines (each ends in ``\\n``)."""
        check_user_id(user_id)
        tables = [batch async for batch in self._lance.batches(RECORD_COLUMNS, record_filter(user_id))]
        if not tables:
            return
        rows = pa.Table.from_batches(tables).sort_by([("created_at", "ascending"), ("id", "ascending")])
        for row in rows.to_pylist():
            yield orjson.dumps(self._touched(from_row(row)).public_dict()).decode() + "\n"

    async def records_with_vectors(self, user_id: str | None = None) -> AsyncIterator[MemoryRecord]:
        """Every record of one user (or of everyone), vectors included, streamed batch by batch (for export)."""
        where = record_filter(user_id) if user_id is not None else None
        async for batch in self._lance.batches([*RECORD_COLUMNS, "embedding"], where):
            for row in batch.to_pylist():
                yield self._touched(from_row(row))

    async def count(self, user_id: str | None = None) -> int:
        """How many records one user (or everyone) has, history included."""
        if user_id is not None:
            check_user_id(user_id)
        return await self._lance.count(user_id)

    async def user_ids(self) -> builtins.list[str]:
        """Every user with at least one record."""
        return await self._lance.user_ids()


# --- helpers -------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _owned(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive lock on the data directory: one process owns it (and its Tantivy writer)."""
    with lock_path.open("a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            raise StoreError(f"{lock_path.parent} is in use by another memproxy process") from exc
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _arrow_rows(records: Sequence[MemoryRecord], vectors: npt.NDArray[np.float32]) -> pa.Table:
    """Records as LanceDB rows, column by column, the vectors from one matrix (no per-float conversion)."""
    dim = vectors.shape[1]
    schema = arrow_schema(dim)
    columns = []
    for field in schema:
        if field.name == "embedding":
            flat = pa.array(np.ascontiguousarray(vectors, dtype=np.float32).reshape(-1))
            columns.append(pa.FixedSizeListArray.from_arrays(flat, dim))
            continue
        values = [getattr(record, field.name) for record in records]
        if field.name == "kind":
            values = [str(value) for value in values]
        elif pa.types.is_list(field.type):
            values = [list(value) for value in values]
        columns.append(pa.array(values, type=field.type))
    return pa.Table.from_arrays(columns, schema=schema)


def _keyword_docs(batch: pa.RecordBatch) -> list[KeywordDoc]:
    created = pc.cast(batch["created_at"], pa.int64()).to_pylist()
    columns = zip(
        batch["id"].to_pylist(),
        batch["user_id"].to_pylist(),
        batch["kind"].to_pylist(),
        batch["text"].to_pylist(),
        created,
        batch["valid"].to_pylist(),
        strict=True,
    )
    return [KeywordDoc(*values) for values in columns]


def _foreign_ids(submission: Submission[MemoryRecord], owners: dict[str, str]) -> StoreError | None:
    for record in submission.items:
        owner = owners.get(record.id)
        if owner is not None and owner != record.user_id:
            return StoreError(f"record id {record.id} is already used by another user")
    return None


def _same(record: MemoryRecord) -> MemoryRecord:
    return record


def _matches(record: MemoryRecord, user_id: str, pool: Pool) -> bool:
    """Whether a record found by the keyword index is in the pool (the cache may be newer than the index)."""
    return (
        record.user_id == user_id
        and (pool.include_invalid or record.valid)
        and (not pool.kinds or record.kind in pool.kinds)
        and (pool.since is None or record.created_at >= pool.since)
        and (pool.until is None or record.created_at <= pool.until)
    )


def _encode_cursor(created_us: int, record_id: str) -> str:
    raw = orjson.dumps([created_us, record_id])
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _decode_cursor(cursor: str) -> tuple[int, str]:
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        created_us, record_id = orjson.loads(raw)
    except (ValueError, TypeError) as exc:
        raise InvalidCursor("invalid cursor") from exc
    if not isinstance(created_us, int) or not isinstance(record_id, str):
        raise InvalidCursor("invalid cursor")
    return created_us, record_id


def _cursor_position(created: npt.NDArray[np.int64], ids: list[str], cursor: str) -> int:
    """Index of the first key strictly after the cursor in (created_at, id) descending order."""
    created_us, record_id = _decode_cursor(cursor)
    for i in range(int(np.searchsorted(-created, -created_us, side="left")), len(ids)):
        if created[i] < created_us or ids[i] < record_id:
            return i
    return len(ids)
