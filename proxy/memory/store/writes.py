"""The store's writes: add, edit, delete, forget, touch, and the maintenance rounds, in an order that keeps
both arms consistent through crashes.

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
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from datetime import datetime, timedelta
from typing import Any

import numpy as np
import numpy.typing as npt
import structlog

from proxy.memory.errors import StoreError
from proxy.memory.store.background import BatchWriter, Submission, Ticker
from proxy.memory.store.consistency import repair_keyword_index, table_keyword_docs
from proxy.memory.store.datadir import DataDir
from proxy.memory.store.ids import check_user_id, valid_record_id
from proxy.memory.store.keyword_schema import KeywordDoc
from proxy.memory.store.reads import StoreParts, StoreReads
from proxy.memory.store.records import Kind, MemoryRecord, arrow_rows, foreign_ids, utcnow
from proxy.memory.store.settings import DocumentEmbedder, StoreSettings
from proxy.memory.store.touches import touch_chunks
from proxy.memory.store.write_vectors import WriteVectors

log = structlog.get_logger(__name__)

OPTIMIZE_KEEP_VERSIONS = timedelta(minutes=10)
TOUCH_CHUNK = 1_000  # access times per LanceDB update (ten times as many held the write lock for a second)
# A keyword index in more segments than this, after a maintenance interval without commits, is rewritten as one
# (each search walks every segment: the read path's searches cost measurably more CPU in six segments than in
# one); only up to KEYWORD_REWRITE_MAX_DOCS documents (the rewrite indexes each again, holding writes up), above
# which Tantivy's own merging is left to keep the count down.
KEYWORD_MAX_SEGMENTS = 3
KEYWORD_REWRITE_MAX_DOCS = 100_000
SLOW_HOLD_MS = 1000.0  # a maintenance step or flush holding writes up longer than this is logged
_FROZEN_FIELDS = frozenset({"id", "user_id", "embedding", "model_id"})
_KEYWORD_FIELDS = frozenset({"text", "kind", "valid", "created_at"})


class StoreWrites:
    """Every write to the parts ``MemoryStore`` owns (``reads.StoreParts``), under one write lock, beside the
    store's ``reads.StoreReads``; the store starts its writer and tickers."""

    def __init__(
        self,
        settings: StoreSettings,
        embedder: DocumentEmbedder,
        parts: StoreParts,
        reads: StoreReads,
        announce: Callable[[Iterable[str]], Awaitable[object]],
    ) -> None:
        self.settings = settings
        self._embedder = embedder
        self._vectors = WriteVectors(embedder)
        self._lance, self._keyword, self._cache, self._touches = parts.table, parts.keyword, parts.cache, parts.touches
        self._unpublished = parts.unpublished
        self._reads = reads
        self._announce = announce  # awaited with the users of a batch of new records, before and after its commit
        self.data_dir = DataDir(settings.path)
        self.lock = asyncio.Lock()
        self.rewrites = asyncio.Lock()  # a compaction's: what rewrites or deletes rows takes it before ``lock``
        self.needs_repair = False
        self._purges = 0
        self.writer: BatchWriter[MemoryRecord] | None = None  # set while the store is open
        self.optimizer: Ticker | None = None
        self._appends = 0  # since the last optimize

    async def close(self) -> None:
        """Write the pending access times and the sync note (the store closes)."""
        await self.flush_touches()
        async with self.lock:
            await self._mark_synced()

    @contextlib.asynccontextmanager
    async def _holding(self, step: str) -> AsyncIterator[None]:
        """The write lock for ``step``; one ``memory.write_lock_held`` line when it held writes up for long."""
        async with self.lock:
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
        self.data_dir.write_sync_note(table, await self._lance.version())

    async def recover(self) -> None:
        """Finish an interrupted purge, and repair Tantivy if it may lag behind LanceDB."""
        if self.data_dir.purge_pending:
            await self._purge(None)
        note = self.data_dir.sync_note()
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
        self._reads.check_model()
        records = list(records)
        for record in records:
            check_user_id(record.user_id)
            if not valid_record_id(record.id):
                raise StoreError(f"invalid record id {record.id[:40]!r}")
        prepared = await self._vectors.embedded(records)
        if prepared:
            if self.writer is None:
                raise StoreError("the memory store is not open")
            await self.writer.submit(prepared)
        return prepared

    async def flush(self, batch: list[Submission[MemoryRecord]]) -> list[BaseException | None]:
        """Write one batch of submissions: LanceDB, then Tantivy, then the cache; one commit each."""
        unique: dict[str, MemoryRecord] = {}
        for submission in batch:
            for record in submission.items:
                unique.setdefault(record.id, record)
        async with self._holding("flush"):
            owners = await self._lance.existing(self.maybe_stored(list(unique)))
            errors: list[BaseException | None] = [foreign_ids(s, owners) for s in batch]
            refused = {r.id for s, e in zip(batch, errors, strict=True) if e is not None for r in s.items}
            new = [r for r in unique.values() if r.id not in owners and r.id not in refused]
            if new:
                await self._write_new(new)
        return errors

    def maybe_stored(self, ids: list[str]) -> list[str]:
        """The ids that LanceDB may hold already: on a local store, those Tantivy holds (it has every committed
        record: writes reach it within the write lock, a failed one marks it for repair, and the open repairs
        it), so that a write of new records does not scan every fragment not yet compacted (slow under
        load). On a shared table another replica's commits reach Tantivy later: all of them."""
        if self._lance.shared is not None or self.needs_repair:
            return ids
        return sorted(self._keyword.holding(ids))

    async def _write_new(self, records: list[MemoryRecord]) -> None:
        users = {record.user_id for record in records}
        await self._announce(users)
        await self._write_announced(records)
        await self._announce(users)

    async def _write_announced(self, records: list[MemoryRecord]) -> None:
        vectors = np.stack([np.asarray(record.embedding, dtype=np.float32) for record in records])
        pieces = self._vectors.pieces([record.text for record in records])
        for record in records:  # until published: no cache load nor LanceDB vector search shows them
            self._unpublished.setdefault(record.user_id, set()).add(record.id)
        try:
            await self._lance.add(arrow_rows(records, vectors, pieces))
            self._appends += 1
            if self._appends >= self.settings.optimize_after_commits and self.optimizer is not None:
                self._appends = 0
                self.optimizer.wake()
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
            self.needs_repair = True
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
            self._reads.check_model()
            vector = (await self._vectors.embed([str(changes["text"])]))[0]
        async with self.rewrites, self.lock:
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
        pieces = self._vectors.pieces([new.text])
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
        async with self.rewrites, self.lock:
            found = await self._lance.records(user_id, ids)
            if not found:
                return []
            vectors = np.stack([np.asarray(record.embedding, dtype=np.float32) for record in found])
            now = utcnow()
            new = [r.replace(**changes, updated_at=now, embedding=v) for r, v in zip(found, vectors, strict=True)]
            pieces = self._vectors.pieces([record.text for record in new])
            await self._lance.replace(user_id, arrow_rows(new, vectors, pieces))
            reindexed = _KEYWORD_FIELDS & set(changes)
            keyword = (lambda: self._keyword.upsert([KeywordDoc.of(record) for record in new])) if reindexed else None
            await self._publish(new, vectors, pieces, keyword)
        return [self._touches.touched(record) for record in new]

    async def touch(self, user_id: str, ids: Sequence[str], when: datetime, young: Iterable[str]) -> None:
        """Note that these records were used at ``when`` (reads see it at once; LanceDB within ``touch_flush_s``,
        but not for the ``young``: ``MemoryStore.young_of``)."""
        check_user_id(user_id)
        valid = [record_id for record_id in ids if valid_record_id(record_id)]
        noted = self._touches.note(user_id, valid, when, frozenset(young))
        # The cached records show it at once (reads from the cache apply no touches); LanceDB gets it at the next
        # flush (not for a record created within the granularity: ``TouchBuffer``). Records whose time was
        # written within the granularity keep that one, in the cache as on disk.
        if noted:
            self._cache.patch(user_id, noted, last_accessed_at=when)

    async def flush_touches(self) -> None:
        """Write the pending access times to LanceDB, ``TOUCH_CHUNK`` records per update with the write lock
        released in between: one update of every pending time held the store's writes up for seconds."""
        if not self._touches:
            return
        chunks = touch_chunks(self._touches.take(), TOUCH_CHUNK)
        for done, chunk in enumerate(chunks):
            async with self.rewrites, self._holding("touches"):
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

    async def delete_many(self, user_id: str, ids: Sequence[str]) -> builtins.list[str]:
        """Delete the user's records with these ids from both arms and the cache (one commit of each); the ids
        that were there."""
        check_user_id(user_id)
        ids = [i for i in ids if valid_record_id(i)]
        async with self.rewrites, self.lock:
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
        await self.drain()
        async with self.rewrites, self.lock:
            counts = await self._lance.kind_counts(user_id)
            if not counts:
                return {str(kind): 0 for kind in Kind}
            fragments = await self._lance.fragments_of(user_id)
            self.data_dir.mark_purge()
            await self._lance.delete(user_id)
            self._cache.drop(user_id)
            self._touches.drop_user(user_id)
            if purge:
                await self._purge(fragments)
            else:
                await self._index(lambda: self._keyword.remove_user(user_id))
        log.info("memory.user_forgotten", records=sum(counts.values()), purged=purge)
        return {str(kind): counts.get(str(kind), 0) for kind in Kind}

    async def drain(self) -> None:
        """Wait until every write submitted so far is flushed.

        A job stopped by a forget may have handed records to the batch writer already; they are written even
        though the job was cancelled, so the forget deletes after them, not before.
        """
        if self.writer is not None:
            await self.writer.submit([])

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
        self.data_dir.purge_done()

    async def keyword_fragmented(self) -> bool:
        """Whether the keyword index is worth rewriting as one segment now: no commit for a maintenance interval
        (``store.optimize_interval_s``; a busy write side would split it again at once, and the rewrite holds its
        writes up), more than ``KEYWORD_MAX_SEGMENTS`` segments, at most ``KEYWORD_REWRITE_MAX_DOCS`` documents.

        Quiet by the clock, not by "no commit since the last round": rounds also follow each other at once (one
        woken by appends while the previous one removed old versions), and under full-mode load such a pair
        rewrote 62k-92k documents under the write lock, holding every new memory back 11-21 s (bench-writes)."""
        committed_at = self._keyword.committed_at
        if committed_at is not None and time.monotonic() - committed_at < self.settings.optimize_interval_s:
            return False
        if self._keyword.segments() <= KEYWORD_MAX_SEGMENTS:
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

    async def remove_old_versions(self) -> None:
        """Remove LanceDB's versions older than ``OPTIMIZE_KEEP_VERSIONS`` and the files only they use.

        Its own ticker (``compaction.CLEANUP_EVERY_S``), beside the maintenance rounds and every write (it commits
        nothing): it reads every manifest kept, 15-20 s under sustained chat, and a round that waited for it left
        the appends of those seconds uncompacted and unindexed, so that every read walked them (``make
        bench-writes``: the minute of the first large removal was the one with reply -> searchable p99 over 2 s).
        """
        await self._lance.remove_old_versions(OPTIMIZE_KEEP_VERSIONS)

    async def optimize(self) -> None:
        """Compact LanceDB and fold new rows into its indexes (old versions: ``remove_old_versions``).

        Also rewrites a fragmented keyword index as one segment in a quiet round (``keyword_fragmented``),
        finishes a deferred purge, repairs Tantivy if a write reached LanceDB but failed in Tantivy
        since the last round, and builds the ANN index once the table is large enough and a vector search has
        had to go to LanceDB (a user too big for the vector cache, or no cache): outside the write lock, it
        takes long.
        """
        async with self._holding("optimize"):
            if self.data_dir.purge_pending:  # a forget_user(purge=False) left bytes to remove
                await self._purge(None)
            elif await self.keyword_fragmented():
                await self._rewrite_keyword_index()
        # Compaction beside the appends (Lance resolves an append against it): under the write lock it held every
        # new memory back for seconds (``make bench-writes``: reply -> searchable p99 up to 8 s).
        async with self.rewrites:
            await self._lance.optimize()
        async with self._holding("optimize"):
            if self.needs_repair:
                await self.repair()
                self.needs_repair = False
            await self._mark_synced()
        purges = self._purges
        if not self._reads.searched_lance:  # every search so far was served by the vector cache
            return
        if await self._lance.ensure_ann_index(self.settings.ann_index_min_rows):  # slow: outside the lock
            async with self.lock:
                if purges != self._purges:  # a user was forgotten meanwhile: the new index may hold them
                    await self._lance.purge([])
                await self._mark_synced()

    async def reindex(self, progress: Callable[[int, int], None] | None = None) -> int:
        """Re-embed every record with this store's embedder into a fresh table and swap it in."""
        await self.flush_touches()
        async with self.rewrites, self.lock:
            done = await self._lance.reindex(self._vectors.embed, progress, pieces=self._vectors.pieces)
            self._cache.clear()
            await self._mark_synced()
        log.info("memory.reindexed", records=done, model=self._embedder.model_id)
        return done
