"""The memory store: LanceDB (source of truth, vectors) and Tantivy (BM25) behind one async interface.

``MemoryStore`` owns the parts (table, keyword index, vector cache, touch buffer, data directory), their
lifecycle and every write; its reads are ``reads.StoreReader``'s. Write order, which keeps both arms
consistent through crashes:

* add: embed, then one LanceDB ``add`` per batch (durable), then Tantivy add + commit, then the vector
  cache, then return: a cached user's reads and listing show a record once both arms can find it (not
  ranked on the dense arm alone while Tantivy commits).
* edit: LanceDB ``merge_insert`` (one commit), then Tantivy re-index + commit, then the vector cache.
* delete / forget: LanceDB first, then Tantivy, so a crash can leave an orphan Tantivy document (removed
  by the repair, and never returned meanwhile: keyword hits are resolved against LanceDB's records) but
  never resurrect a deleted record.

After each write the LanceDB version that Tantivy reflects is noted in ``sync.json`` (``datadir.py``). On
open, if the table moved past that note (a crash between the two arms), the startup repair
(``consistency.py``) re-indexes what Tantivy lacks or holds stale, and drops what LanceDB no longer has.

Forgetting a user removes their rows from both indexes and the cache, then purges the bytes from disk:
the LanceDB fragments that held them are rewritten and old versions deleted, and the Tantivy index is
rebuilt from LanceDB. A ``purge.pending`` marker makes a crash during that step finish it at next open.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AsyncExitStack
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
import structlog
from pydantic import BaseModel, ConfigDict, Field

from proxy.memory.errors import EmbedderError, EmbedderMismatch, StoreError
from proxy.memory.pieces import TermVectors, memory_pieces, term_vectors_of
from proxy.memory.store.background import BatchWriter, Submission, Ticker
from proxy.memory.store.consistency import repair_keyword_index, table_keyword_docs
from proxy.memory.store.datadir import DataDir
from proxy.memory.store.exact_search import single_thread_blas
from proxy.memory.store.faults import StorageHealth
from proxy.memory.store.ids import check_user_id, valid_record_id
from proxy.memory.store.keyword import KeywordIndex
from proxy.memory.store.keyword_schema import KeywordDoc
from proxy.memory.store.reads import StoreReader
from proxy.memory.store.records import Kind, MemoryRecord, arrow_rows, utcnow
from proxy.memory.store.table import MemoryTable
from proxy.memory.store.touches import TouchBuffer, touch_chunks
from proxy.memory.store.vector_cache import VectorCache

__all__ = ["DocumentEmbedder", "MemoryStore", "StoreSettings"]

log = structlog.get_logger(__name__)

OPTIMIZE_KEEP_VERSIONS = timedelta(minutes=10)
TOUCH_CHUNK = 1_000  # access times per LanceDB update (10k at 40k rows held the write lock 1.2 s)
# A keyword index in more segments than this, after a maintenance interval without writes, is rewritten as one
# (each search walks every segment: the read path's two searches at 10k memories cost ~25% more CPU in six
# segments than in one); only up to KEYWORD_REWRITE_MAX_DOCS documents (the rewrite indexes each again: ~0.5 s
# of CPU per 10k, holding writes up), above which Tantivy's own merging is left to keep the count down.
KEYWORD_MAX_SEGMENTS = 3
KEYWORD_REWRITE_MAX_DOCS = 100_000
SLOW_HOLD_MS = 1000.0  # a maintenance step or flush holding writes up longer than this is logged
_FROZEN_FIELDS = frozenset({"id", "user_id", "embedding", "model_id"})
_KEYWORD_FIELDS = frozenset({"text", "kind", "valid", "created_at"})


class DocumentEmbedder(Protocol):
    """What the store needs of an embedder (any ``proxy.memory.embedders`` embedder is one): documents in."""

    @property
    def model_id(self) -> str: ...

    @property
    def dim(self) -> int: ...

    async def embed_documents(self, texts: Sequence[str]) -> npt.NDArray[np.float32]:
        """One unit vector per text, shape ``(len(texts), dim)``."""
        ...


class StoreTuning(BaseModel):
    """``[store]``: how the store batches, compacts and caches (its data directory is ``storage.path``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    flush_max_rows: int = Field(256, ge=1)
    flush_interval_ms: int = Field(20, ge=0)
    optimize_interval_s: float = Field(300.0, gt=0)
    # ...or sooner, after this many appends: each makes a fragment, and a write's id check and a user's first
    # read walk every fragment not yet compacted (at 1,100 fragments an append took 180 ms instead of 50)
    optimize_after_commits: int = Field(200, ge=1)
    # Seconds between writes of access times to LanceDB (reads see them at once; a write rewrites the touched
    # rows and marks deletions in their fragments: once a second under load, it held the write lock 1-2 s of
    # every second).
    touch_flush_s: float = Field(60.0, gt=0)
    # A memory's access time reaches LanceDB at most once per this many seconds (reads see every access at once;
    # recency counts in hours and days, and rewriting the same rows every minute held writes up for seconds). A
    # kill -9 loses at most about this much access-time history (plus touch_flush_s), never a memory.
    touch_granularity_s: float = Field(3600.0, ge=0)
    ann_index_min_rows: int = Field(50_000, ge=1)
    vector_cache_bytes: int = Field(512 * 2**20, ge=0)  # a 100k-memory user fits (~290 MB)
    # Once no read has come for 5 s, a user whose cached vectors no read has used for this many seconds is
    # dropped (their next read loads them again); 0 keeps every user until the byte budget evicts them.
    vector_cache_idle_s: float = Field(20.0, ge=0)
    # LanceDB's own caches (opened indexes, file metadata and manifests). Its default (6 GB + 1 GB) kept the
    # metadata of every version a busy write side made: 275 MB after 3,000 commits, growing without end.
    lance_cache_bytes: int = Field(64 * 2**20, ge=1 * 2**20)


class StoreSettings(StoreTuning):
    """Where the store keeps its data, and how it batches, compacts and caches."""

    path: Path


class MemoryStore(StoreReader):
    """Every memory of every user; open with ``async with`` (starts the writer and maintenance tasks)."""

    def __init__(
        self,
        settings: StoreSettings,
        embedder: DocumentEmbedder,
        *,
        allow_mismatch: bool = False,
        health: StorageHealth | None = None,
    ) -> None:
        super().__init__(
            MemoryTable(
                settings.path / "lance",
                embedder.model_id,
                embedder.dim,
                allow_mismatch=allow_mismatch,
                cache_bytes=settings.lance_cache_bytes,
            ),
            KeywordIndex(settings.path / "tantivy"),
            VectorCache(settings.vector_cache_bytes),
            TouchBuffer(timedelta(seconds=settings.touch_granularity_s)),
            embedder.dim,
        )
        self.settings = settings
        self.health = health or StorageHealth()
        self._embedder = embedder
        self._dir = DataDir(settings.path)
        self._lock = asyncio.Lock()
        self._needs_repair = False
        self._purges = 0
        self._writer: BatchWriter[MemoryRecord] | None = None
        self._optimizer: Ticker | None = None
        self._appends = 0  # since the last optimize
        self._keyword_commits = 0  # the keyword index's commit count at the end of the last maintenance round
        self._stack: AsyncExitStack | None = None

    @property
    def embedder(self) -> DocumentEmbedder:
        """The embedder this store's vectors come from."""
        return self._embedder

    # lifecycle ------------------------------------------------------------------------------------------

    async def __aenter__(self) -> MemoryStore:
        single_thread_blas()
        self.settings.path.mkdir(parents=True, exist_ok=True)
        async with AsyncExitStack() as stack:
            stack.enter_context(self._dir.owned())
            await self._lance.open()
            stack.callback(self._lance.close)
            await stack.enter_async_context(self._keyword)
            stack.push_async_callback(self._cache.aclose)  # loads in flight stop before the tables close
            await self._recover()
            self._keyword_commits = self._keyword.commits
            stack.push_async_callback(self._close_writes)
            self._writer = BatchWriter(
                self._flush, self.settings.flush_max_rows, self.settings.flush_interval_ms / 1000, health=self.health
            )
            await stack.enter_async_context(self._writer)
            self._optimizer = Ticker("memory-optimize", self.settings.optimize_interval_s, self.optimize, self.health)
            await stack.enter_async_context(self._optimizer)
            # its first round now, not after a whole interval: until then updates scan the table, and searches
            # walk a fragmented keyword index
            if await self._lance.lacks_scalar_indexes() or await self._keyword_fragmented():
                self._optimizer.wake()
            await stack.enter_async_context(
                Ticker("memory-touch", self.settings.touch_flush_s, self._flush_touches, self.health)
            )
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

    @contextlib.asynccontextmanager
    async def _holding(self, step: str) -> AsyncIterator[None]:
        """The write lock for ``step``; one ``memory.write_lock_held`` line when it held writes up for long."""
        async with self._lock:
            started = time.perf_counter()
            try:
                yield
            finally:
                held_ms = (time.perf_counter() - started) * 1000
                if held_ms >= SLOW_HOLD_MS:
                    log.info("memory.write_lock_held", step=step, ms=round(held_ms))

    # consistency ----------------------------------------------------------------------------------------

    async def _mark_synced(self) -> None:
        """Note that Tantivy reflects the live LanceDB table at its current version."""
        table = self._lance.manifest.table if self._lance.manifest else ""
        self._dir.write_sync_note(table, await self._lance.version())

    async def _recover(self) -> None:
        """Finish an interrupted purge, and repair Tantivy if it may lag behind LanceDB."""
        if self._dir.purge_pending:
            await self._purge(None)
        note = self._dir.sync_note()
        table = self._lance.manifest.table if self._lance.manifest else ""
        if self._keyword.fresh or note != {"table": table, "version": await self._lance.version()}:
            await self.repair()
        await self._mark_synced()

    async def repair(self) -> dict[str, int]:
        """Make Tantivy agree with LanceDB: index what it lacks or holds stale, drop what LanceDB lost."""
        return await repair_keyword_index(self._lance, self._keyword)

    # writes ---------------------------------------------------------------------------------------------

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
        """Write one batch of submissions: LanceDB, then Tantivy, then the cache; one commit each."""
        unique: dict[str, MemoryRecord] = {}
        for submission in batch:
            for record in submission.items:
                unique.setdefault(record.id, record)
        async with self._holding("flush"):
            owners = await self._lance.existing(self._maybe_stored(list(unique)))
            errors: list[BaseException | None] = [_foreign_ids(s, owners) for s in batch]
            refused = {r.id for s, e in zip(batch, errors, strict=True) if e is not None for r in s.items}
            new = [r for r in unique.values() if r.id not in owners and r.id not in refused]
            if new:
                await self._write_new(new)
        return errors

    def _maybe_stored(self, ids: list[str]) -> list[str]:
        """The ids that LanceDB may hold already: on a local store, those Tantivy holds (it has every committed
        record: writes reach it within the write lock, a failed one marks it for repair, and the open repairs
        it), so that a write of new records does not scan every fragment not yet compacted (50 ms to seconds
        under load). On a shared table another replica's commits reach Tantivy later: all of them."""
        if self._lance.shared is not None or self._needs_repair:
            return ids
        return sorted(self._keyword.holding(ids))

    def _pieces(self, texts: Sequence[str]) -> list[npt.NDArray[np.int64]] | None:
        """The texts' word pieces by this store's model (``memory.pieces``; None: the model has no term
        vectors). On the event loop, as the read path's term matching: the model's word cache is not shared
        with threads."""
        vectors = term_vectors_of(self._embedder)
        return None if vectors is None else [memory_pieces(vectors, text) for text in texts]

    def term_pieces(self, user_id: str, ids: Sequence[str], vectors: TermVectors) -> list[npt.NDArray[np.int64] | None]:
        """The word pieces kept for these records of the user, where the vector cache holds them (None where it
        does not, and for all of them when ``vectors`` are not this store's model's)."""
        entry = self._cache.peek(user_id)
        if entry is None or vectors is not term_vectors_of(self._embedder):
            return [None] * len(ids)
        return entry.pieces_of(ids)

    async def _write_new(self, records: list[MemoryRecord]) -> None:
        vectors = np.stack([np.asarray(record.embedding, dtype=np.float32) for record in records])
        pieces = self._pieces([record.text for record in records])
        for record in records:  # until published: no cache load nor LanceDB vector search shows them
            self._unpublished.setdefault(record.user_id, set()).add(record.id)
        try:
            await self._lance.add(arrow_rows(records, vectors, pieces))
            self._appends += 1
            if self._appends >= self.settings.optimize_after_commits and self._optimizer is not None:
                self._appends = 0
                self._optimizer.wake()
        except BaseException:
            self._published(records)
            raise
        await self._publish(
            records, vectors, pieces, lambda: self._keyword.add([KeywordDoc.of(record) for record in records])
        )

    async def _publish(
        self,
        records: list[MemoryRecord],
        vectors: npt.NDArray[np.float32],
        pieces: list[npt.NDArray[np.int64]] | None,
        change: Callable[[], Awaitable[None]] | None,
    ) -> None:
        """After LanceDB took ``records``: Tantivy's ``change`` (None: none, only the sync note), then the vector
        cache, so that a cached user's reads see the records once both arms have them (even if Tantivy failed)."""
        try:
            if change is None:
                await self._mark_synced()
            else:
                await self._index(change)
        finally:
            self._cache.upsert(records, vectors, pieces)
            self._published(records)

    def _published(self, records: list[MemoryRecord]) -> None:
        """Forget that ``records`` await their publish (``_unpublished``)."""
        for record in records:
            pending = self._unpublished.get(record.user_id)
            if pending is not None:
                pending.discard(record.id)
                if not pending:
                    del self._unpublished[record.user_id]

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
        pieces = self._pieces([new.text])
        await self._lance.replace(user_id, arrow_rows([new], vector[None, :], pieces))
        keyword = (lambda: self._keyword.upsert([KeywordDoc.of(new)])) if _KEYWORD_FIELDS & set(changes) else None
        await self._publish([new], vector[None, :], pieces, keyword)
        return self._touches.touched(new)

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
            pieces = self._pieces([record.text for record in new])
            await self._lance.replace(user_id, arrow_rows(new, vectors, pieces))
            reindexed = _KEYWORD_FIELDS & set(changes)
            keyword = (lambda: self._keyword.upsert([KeywordDoc.of(record) for record in new])) if reindexed else None
            await self._publish(new, vectors, pieces, keyword)
        return [self._touches.touched(record) for record in new]

    async def supersede(self, user_id: str, old_id: str, new: MemoryRecord) -> MemoryRecord:
        """Store ``new`` and retire ``old_id`` (kept as history: invalid, superseded by ``new``)."""
        if new.user_id != user_id:
            raise StoreError("a record can only supersede a record of the same user")
        [added] = await self.add([new])
        await self.update(user_id, old_id, valid=False, superseded_by=added.id)
        return added

    async def touch(self, user_id: str, ids: Sequence[str], at: datetime | None = None) -> None:
        """Note that these records were used now (reads see it at once; LanceDB within ``touch_flush_s``)."""
        check_user_id(user_id)
        when = at or utcnow()
        valid = [record_id for record_id in ids if valid_record_id(record_id)]
        noted = self._touches.note(user_id, valid, when)
        # The cached records show it at once (reads from the cache apply no touches); LanceDB gets it at the next
        # flush. Records whose time was written within the granularity keep that one, in the cache as on disk.
        if noted:
            self._cache.patch(user_id, noted, last_accessed_at=when)

    async def _flush_touches(self) -> None:
        """Write the pending access times to LanceDB, ``TOUCH_CHUNK`` records per update with the write lock
        released in between: one update of every pending time held the store's writes up for 3-11 s."""
        if not self._touches:
            return
        chunks = touch_chunks(self._touches.take(), TOUCH_CHUNK)
        for done, chunk in enumerate(chunks):
            async with self._holding("touches"):
                at = max(when for per_user in chunk.values() for when in per_user.values())
                try:
                    await self._lance.touch({user: list(ids) for user, ids in chunk.items()}, at)
                except Exception:
                    for left in chunks[done:]:  # kept for the next round
                        self._touches.restore(left)
                    raise
                self._touches.wrote(chunk, at)
                for user, ids in chunk.items():
                    self._cache.patch(user, list(ids), last_accessed_at=at)
                await self._mark_synced()

    def release_idle(self, now: float | None = None) -> list[str]:
        """Drop the vector cache's users no read has used for ``vector_cache_idle_s`` (``VectorCache.release_idle``;
        ``now``: its clock, ``time.monotonic``); returns them."""
        idle_s = self.settings.vector_cache_idle_s
        return self._cache.release_idle(idle_s, now) if idle_s > 0 else []

    @property
    def cached_users(self) -> int:
        """How many users the vector cache holds."""
        return len(self._cache)

    async def delete(self, user_id: str, id: str) -> bool:
        """Delete one record from both arms and the cache; False if the user has no such record."""
        return bool(await self.delete_many(user_id, [id]))

    async def delete_many(self, user_id: str, ids: Sequence[str]) -> builtins.list[str]:
        """Delete the user's records with these ids from both arms and the cache (one commit of each); the ids
        that were there."""
        check_user_id(user_id)
        ids = [i for i in ids if valid_record_id(i)]
        async with self._lock:
            found = [r.id for r in await self._lance.records(user_id, ids, embedding=False)] if ids else []
            if not found:
                return []
            await self._lance.delete(user_id, found)
            self._cache.remove(user_id, found)
            for record_id in found:
                self._touches.drop(user_id, record_id)
            await self._index(lambda: self._keyword.remove(user_id, found))
        return found

    async def forget_user(self, user_id: str, *, purge: bool = True) -> dict[str, int]:
        """Erase every record of the user from both arms, the cache and the files; counts by kind.

        The records are gone from every read at once. Their bytes leave the disk before this returns
        (``purge=True``, which rewrites the data files they shared with other users: time grows with the
        table) or at the next maintenance round (``purge=False``; a restart finishes it too).
        """
        check_user_id(user_id)
        await self._drain_writes()
        async with self._lock:
            counts = await self._lance.kind_counts(user_id)
            if not counts:
                return {str(kind): 0 for kind in Kind}
            fragments = await self._lance.fragments_of(user_id)
            self._dir.mark_purge()
            await self._lance.delete(user_id)
            self._cache.drop(user_id)
            self._touches.drop_user(user_id)
            if purge:
                await self._purge(fragments)
            else:
                await self._index(lambda: self._keyword.remove_user(user_id))
        log.info("memory.user_forgotten", records=sum(counts.values()), purged=purge)
        return {str(kind): counts.get(str(kind), 0) for kind in Kind}

    async def _drain_writes(self) -> None:
        """Wait until every write submitted so far is flushed.

        A job stopped by a forget may have handed records to the batch writer already; they are written even
        though the job was cancelled, so the forget deletes after them, not before.
        """
        if self._writer is not None:
            await self._writer.submit([])

    async def _purge(self, fragments: Sequence[int] | None) -> None:
        """Remove deleted rows' bytes: rebuild Tantivy from LanceDB while LanceDB rewrites its fragments.

        Until the rebuilt index is swapped in, the old one may still match the deleted records, but keyword
        hits are resolved against LanceDB (and the cache), so they are never returned.
        """
        self._purges += 1
        try:
            async with asyncio.TaskGroup() as group:
                group.create_task(self._keyword.rebuild(table_keyword_docs(self._lance)))
                group.create_task(self._lance.purge(fragments))
        except ExceptionGroup as failed:
            raise failed.exceptions[0] from failed
        await self._mark_synced()
        self._dir.purge_done()

    async def _keyword_fragmented(self) -> bool:
        """Whether the keyword index is worth rewriting as one segment now: no commit since the last round (a
        busy write side would split it again at once, and the rewrite holds its writes up), more than
        ``KEYWORD_MAX_SEGMENTS`` segments, at most ``KEYWORD_REWRITE_MAX_DOCS`` documents."""
        if self._keyword.commits != self._keyword_commits or self._keyword.segments() <= KEYWORD_MAX_SEGMENTS:
            return False
        return await self._keyword.count() <= KEYWORD_REWRITE_MAX_DOCS

    async def _rewrite_keyword_index(self) -> None:
        """Rebuild the keyword index from LanceDB as one segment (under the write lock: the two stay equal)."""
        started, segments = time.perf_counter(), self._keyword.segments()
        documents = await self._keyword.rebuild(table_keyword_docs(self._lance))
        ms = round((time.perf_counter() - started) * 1000)
        log.info(
            "memory.keyword_rewritten", segments=segments, now=self._keyword.segments(), documents=documents, ms=ms
        )

    async def optimize(self) -> None:
        """Compact LanceDB, fold new rows into its indexes, drop versions older than ten minutes.

        Also rewrites a fragmented keyword index as one segment in a quiet round (``_keyword_fragmented``),
        finishes a deferred purge, repairs Tantivy if a write reached LanceDB but failed in Tantivy
        since the last round, and builds the ANN index once the table is large enough and a vector search has
        had to go to LanceDB (a user too big for the vector cache, or no cache): outside the write lock, it
        takes minutes.
        """
        async with self._holding("optimize"):
            if self._dir.purge_pending:  # a forget_user(purge=False) left bytes to remove
                await self._purge(None)
            elif await self._keyword_fragmented():
                await self._rewrite_keyword_index()
            await self._lance.optimize(OPTIMIZE_KEEP_VERSIONS)
            if self._needs_repair:
                await self.repair()
                self._needs_repair = False
            await self._mark_synced()
            self._keyword_commits = self._keyword.commits
        purges = self._purges
        if not self.searched_lance:  # every search so far was served by the vector cache
            return
        if await self._lance.ensure_ann_index(self.settings.ann_index_min_rows):  # slow: outside the lock
            async with self._lock:
                if purges != self._purges:  # a user was forgotten meanwhile: the new index may hold them
                    await self._lance.purge([])
                await self._mark_synced()

    async def reindex(self, progress: Callable[[int, int], None] | None = None) -> int:
        """Re-embed every record with this store's embedder into a fresh table and swap it in."""
        await self._flush_touches()
        async with self._lock:
            done = await self._lance.reindex(self._embed, progress, pieces=self._pieces)
            self._cache.clear()
            await self._mark_synced()
        log.info("memory.reindexed", records=done, model=self._embedder.model_id)
        return done


# --- helpers -------------------------------------------------------------------------------------------


def _foreign_ids(submission: Submission[MemoryRecord], owners: dict[str, str]) -> StoreError | None:
    for record in submission.items:
        owner = owners.get(record.id)
        if owner is not None and owner != record.user_id:
            return StoreError(f"record id {record.id} is already used by another user")
    return None
