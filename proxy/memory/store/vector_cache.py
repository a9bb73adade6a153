"""A bounded in-RAM cache of each user's vectors for exact search, evicted LRU by bytes.

Exact numpy search over one user's 10k x 384 vectors takes about 0.3 ms, far below LanceDB's
filtered search, so the store keeps recently searched users here. An entry holds every record of the user
(history included) as a vector matrix, filter columns (kind, created_at, valid, alive) and the records
themselves, materialised lazily from the Arrow rows loaded from LanceDB. A loaded entry keeps its rows ordered
by (kind, created_at), records added later after them, so that a search scores only the runs of rows its pools
can return (facts of all time and the window's turns, not years of older turns): the scan is memory-bound,
and after the pause between two requests it runs from RAM. The store applies every write,
edit and delete to the cache right after LanceDB commits it; the writes that land while a user is being
loaded are replayed onto the loaded entry before it is kept (each replaces or deletes whole records by id, so
replaying one the load already saw changes nothing), so the cache never serves a state older than LanceDB's.
Discarding such a load instead made a busy user's load start over and over (under sustained chat: 1,372
loads of 200 users in two minutes, each seconds long against the others).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Sequence
from datetime import datetime
from typing import Any, cast

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc
import threadpoolctl

from proxy.memory.store.records import PIECES, Kind, MemoryRecord, Pool, RecordColumns

KIND_CODES: dict[str, int] = {str(kind): code for code, kind in enumerate(Kind)}
_RECORD_OVERHEAD_BYTES = 600  # a materialised MemoryRecord plus its index entry, roughly
_ID_OVERHEAD_BYTES = 120
_LIST_INT_BYTES = 40  # an int in a Python list (the object and its slot), with its row's flag
_PY_ROW_BYTES = 1_000  # the loaded columns as Python objects, per row, text aside (measured ~750 B)
_MIN_CAPACITY = 8  # rows a new entry has room for: most users start with a handful of memories (64 rows of 384
# float32 is 96 KB, empty)
_COMPACT_AFTER = 64  # deleted rows an entry tolerates before it may compact
_RUN_GAP = 64  # runs of rows to scan this close are scanned as one (a gemv call costs about as much as 64 rows)
_FULL_SCAN_SHARE = 0.9  # runs covering this share of the rows: one scan of them all


def grown(capacity: int) -> int:
    """The capacity after ``capacity`` filled up: half as much again (doubling left a user's matrix up to half
    empty, a third on average: 86 MB of vectors held for 31.7k records after 3 minutes of
    ``bench/writes.py --mode sustained``, ~49 MB of them used), still amortised O(1) copies per append."""
    return max(_MIN_CAPACITY, capacity + capacity // 2)


READS_IDLE_S = 5.0  # ``release_idle`` drops nothing while a read came this recently
MAX_REPLAYED_WRITES = 10_000  # writes kept for one user's load in flight; past it the load is not kept


def micros(at: datetime) -> int:
    """A timezone-aware datetime as integer microseconds since the epoch."""
    return int(at.timestamp() * 1_000_000)


def estimated_bytes(rows: int, dim: int) -> int:
    """What an entry of ``rows`` records of dimension ``dim`` is expected to cost, before loading it."""
    return rows * (dim * 4 + _PY_ROW_BYTES + 200 + _ID_OVERHEAD_BYTES + 16)


class UserVectors:
    """One user's records, vectors and filter columns; search is exact (dot product of unit vectors)."""

    def __init__(self, user_id: str, dim: int, rows: pa.Table | None = None) -> None:
        self.user_id = user_id
        self.dim = dim
        self.ids: list[str] = []
        self.index: dict[str, int] = {}
        self.n = 0
        self.dead = 0
        self.generation = 0
        # Columns as Python lists: a hit becomes a record in microseconds (Arrow's take + to_pylist of a
        # few rows costs about a millisecond). Costs memory: counted in ``nbytes``.
        vectors_only = ("embedding", PIECES)
        scalars = None if rows is None else rows.drop_columns([c for c in vectors_only if c in rows.column_names])
        self._columns = RecordColumns(scalars) if scalars is not None else None
        self._columns_bytes = scalars.num_rows * _PY_ROW_BYTES + scalars["text"].nbytes if scalars else 0
        # Each loaded row's word pieces (``memory.pieces``) as Arrow holds them: row ``base``'s are
        # ``_piece_values[_piece_offsets[base]:_piece_offsets[base + 1]]``, if ``_piece_held[base]`` (Python
        # lists: a lookup of numpy scalars costs ~10x as much, for the 60 memories term matching scores). Records
        # written since the load keep theirs in ``_fresh_pieces`` (None: none), by id.
        self._piece_values, self._piece_offsets, self._piece_held = _pieces_columns(rows)
        self._fresh_pieces: dict[str, npt.NDArray[np.int64] | None] = {}
        self._fresh_bytes = 0
        self._base: list[int] = []  # row in self._columns, or -1 for records added after the load
        self._records: list[MemoryRecord | None] = []
        self._materialised = 0
        # Rows [0, _sorted) are ordered by (kind code, created_at); ``_blocks[code]`` is that kind's (start, end)
        # among them. Rows after them (added since the load) are in no order: a search always scans them.
        self._sorted = 0
        self._blocks: list[tuple[int, int]] = [(0, 0)] * len(KIND_CODES)
        self._alloc(max(_MIN_CAPACITY, rows.num_rows if rows is not None else 0))
        if rows is not None:
            self._load(rows)

    def _alloc(self, capacity: int) -> None:
        # Transposed (dim x capacity): query @ vectors is OpenBLAS's fastest single-thread gemv here (0.3 ms for
        # 10k x 384, against 1.5 ms for einsum or matmul over rows).
        self.vectors = np.zeros((self.dim, capacity), dtype=np.float32)
        self.created = np.zeros(capacity, dtype=np.int64)
        self.kind = np.zeros(capacity, dtype=np.int8)
        self.valid = np.zeros(capacity, dtype=np.bool_)
        self.alive = np.zeros(capacity, dtype=np.bool_)

    def _load(self, rows: pa.Table) -> None:
        count = rows.num_rows
        if count == 0:
            return
        created = rows["created_at"].cast(pa.int64()).to_numpy()
        codes = np.asarray([KIND_CODES[kind] for kind in rows["kind"].to_pylist()], dtype=np.int8)
        order = np.lexsort((created, codes))  # by kind, then time: see ``_scan_ranges``
        flat = pc.list_flatten(rows["embedding"].combine_chunks()).to_numpy(zero_copy_only=False)
        self.vectors[:, :count] = flat.reshape(count, self.dim)[order].T
        self.created[:count] = created[order]
        self.kind[:count] = codes[order]
        self.valid[:count] = rows["valid"].to_numpy(zero_copy_only=False)[order]
        self.alive[:count] = True
        ids = rows["id"].to_pylist()
        self._base = order.tolist()
        self.ids = [ids[base] for base in self._base]
        self.index = {record_id: row for row, record_id in enumerate(self.ids)}
        self._records = [None] * count
        self.n = count
        self._sorted_prefix(count)

    def _sorted_prefix(self, count: int) -> None:
        """Note that rows [0, count) are ordered by (kind, created_at) and find each kind's block among them."""
        codes = self.kind[:count]
        self._sorted = count
        self._blocks = [
            (int(np.searchsorted(codes, code, "left")), int(np.searchsorted(codes, code, "right")))
            for code in range(len(KIND_CODES))
        ]

    @property
    def live(self) -> int:
        """How many records the entry holds (deleted ones excluded)."""
        return self.n - self.dead

    @property
    def nbytes(self) -> int:
        """Approximate memory held by the entry."""
        arrays = self.vectors.nbytes + self.created.nbytes + self.kind.nbytes * 3
        arrays += self._piece_values.nbytes + len(self._piece_offsets) * _LIST_INT_BYTES
        arrays += self._fresh_bytes
        rows = self._columns_bytes
        extra = self._materialised * _RECORD_OVERHEAD_BYTES + len(self.ids) * _ID_OVERHEAD_BYTES
        return arrays + rows + extra

    def upsert(
        self, record: MemoryRecord, vector: npt.NDArray[np.float32], pieces: npt.NDArray[np.int64] | None = None
    ) -> None:
        """Add a record or replace the one with the same id (new text, vector, validity...), with its word pieces
        (None: none kept)."""
        row = self.index.get(record.id)
        code, created = KIND_CODES[str(record.kind)], micros(record.created_at)
        if row is not None and row < self._sorted and (self.kind[row] != code or self.created[row] != created):
            self._forget(row, record.id)  # it would leave its place in the order: it goes after the sorted rows
            row = None
        if row is None:
            row = self._append_slot(record.id)
        elif self._base[row] >= 0 and self._records[row] is None:
            self._materialised += 1
        self.vectors[:, row] = vector
        self.created[row] = created
        self.kind[row] = code
        self.valid[row] = record.valid
        self._records[row] = record.replace(embedding=None)
        self._drop_fresh_pieces(record.id)
        self._fresh_pieces[record.id] = pieces
        self._fresh_bytes += _pieces_bytes(pieces)

    def _append_slot(self, record_id: str) -> int:
        if self.n == self.vectors.shape[1]:
            self._grow(grown(self.vectors.shape[1]))
        row = self.n
        self.n += 1
        self.alive[row] = True
        self.ids.append(record_id)
        self.index[record_id] = row
        self._base.append(-1)
        self._records.append(None)
        self._materialised += 1
        return row

    def _arrays(self) -> list[npt.NDArray[Any]]:
        return [self.vectors, self.created, self.kind, self.valid, self.alive]

    def _grow(self, capacity: int) -> None:
        old = self._arrays()
        self._alloc(capacity)
        for new, previous in zip(self._arrays(), old, strict=True):
            new[..., : self.n] = previous[..., : self.n]  # the vectors' rows are along the last axis

    def patch(self, ids: Sequence[str], **changes: object) -> None:
        """Change fields that do not touch the vector or the filters (``last_accessed_at``, say)."""
        for record_id, record in zip(ids, self.records(ids), strict=True):
            if record is not None and any(getattr(record, name) != value for name, value in changes.items()):
                self._records[self.index[record_id]] = record.replace(**changes)  # (a flush repeats a touch)

    def touch(self, record_id: str, at: datetime) -> None:
        """Note an access time on one record, unless it already shows a later one."""
        record = self.records([record_id])[0]
        if record is not None and (record.last_accessed_at is None or record.last_accessed_at < at):
            self._records[self.index[record_id]] = record.replace(last_accessed_at=at)

    def remove(self, ids: Sequence[str]) -> int:
        """Forget these records; returns how many were present."""
        removed = 0
        for record_id in ids:
            row = self.index.get(record_id)
            if row is None:
                continue
            self._forget(row, record_id)
            removed += 1
        if self.dead > _COMPACT_AFTER and self.dead * 2 > self.n:
            self._compact()
        return removed

    def _forget(self, row: int, record_id: str) -> None:
        """Mark a row deleted (counted in ``dead`` until a compaction drops it)."""
        self.dead += 1
        del self.index[record_id]
        self._drop_fresh_pieces(record_id)
        self.alive[row] = False
        if self._records[row] is not None:
            self._materialised -= 1
        self._records[row] = None

    def _compact(self) -> None:
        """Drop deleted rows and order the others by (kind, created_at) again; new arrays, so a search running
        on the old ones stays correct."""
        alive = np.flatnonzero(self.alive[: self.n])
        keep = alive[np.lexsort((self.created[alive], self.kind[alive]))]
        old = self._arrays()
        ids, base, records = self.ids, self._base, self._records
        self._alloc(grown(len(keep)))
        for new, previous in zip(self._arrays(), old, strict=True):
            new[..., : len(keep)] = previous[..., keep]  # alive rows stay alive
        self.ids = [ids[row] for row in keep]
        self._base = [base[row] for row in keep]
        self._records = [records[row] for row in keep]
        self.index = {record_id: row for row, record_id in enumerate(self.ids)}
        self.n, self.dead = len(keep), 0
        self._sorted_prefix(self.n)
        self.generation += 1

    def search(
        self,
        query: npt.NDArray[np.float32],
        k: int,
        kinds: Sequence[Kind] | None,
        since: datetime | None,
        until: datetime | None,
        include_invalid: bool,
    ) -> list[tuple[str, float]]:
        """Top ``k`` (id, cosine) among live records matching the filters; safe to run in a worker thread."""
        pool = Pool(k, tuple(kinds or ()), since, until, include_invalid)
        return self.search_pools(query, [pool])[0]

    def search_pools(self, query: npt.NDArray[np.float32], pools: Sequence[Pool]) -> list[list[tuple[str, float]]]:
        """Top (id, cosine) of each pool; the query's scores against every row are computed at most once."""
        ids = self.ids
        return [
            [(ids[row], score) for row, score in zip(rows, scores, strict=True)]
            for rows, scores in self.search_rows(query, pools)
        ]

    def search_rows(self, query: npt.NDArray[np.float32], pools: Sequence[Pool]) -> list[tuple[list[int], list[float]]]:
        """``search_pools`` as (rows, cosines) per pool, best first: rows of live records, for ``records_at``
        (no id per hit to make and look up again). Valid until the entry next changes."""
        n = self.n
        runs = [self._pool_runs(pool) for pool in pools]
        scores: npt.NDArray[np.float32] | None = None
        out: list[tuple[list[int], list[float]]] = []
        for pool, pool_runs in zip(pools, runs, strict=True):
            rows = self._pool_rows(pool, n, pool_runs)
            if pool.k <= 0 or rows.size == 0:
                out.append(([], []))
                continue
            if scores is None:  # the pools' runs of rows at once: gathering columns costs more than scoring runs
                scores = self._scores(query, runs, n)
            out.append(_top_k(scores[rows], rows, pool.k))
        return out

    def _scores(
        self, query: npt.NDArray[np.float32], runs: Sequence[list[tuple[int, int]]], n: int
    ) -> npt.NDArray[np.float32]:
        """The query's cosine with every row the pools (their ``_pool_runs``) can return (NaN for the others)."""
        ranges = self._scan_ranges(runs, n)
        if sum(hi - lo for lo, hi in ranges) >= _FULL_SCAN_SHARE * n:
            return _dot(query, self.vectors[:, :n])
        scores = np.full(n, np.nan, dtype=np.float32)
        for lo, hi in ranges:
            scores[lo:hi] = _dot(query, self.vectors[:, lo:hi])
        return scores

    def _scan_ranges(self, runs: Sequence[list[tuple[int, int]]], n: int) -> list[tuple[int, int]]:
        """Sorted, disjoint runs of rows holding every row any of the pools can return: their ``_pool_runs``
        (per kind asked, the part of its block inside the pool's time bounds) and the rows added since the load."""
        every = [(self._sorted, n)] if self._sorted < n else []
        for pool_runs in runs:
            every += pool_runs
        every.sort()
        merged: list[tuple[int, int]] = []
        for lo, hi in every:
            if merged and lo <= merged[-1][1] + _RUN_GAP:
                merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
            else:
                merged.append((lo, hi))
        return merged

    def _pool_runs(self, pool: Pool) -> list[tuple[int, int]]:
        """Runs of the sorted rows (ascending) holding the pool's kinds within its time bounds: each kind's
        block, cut to the bounds by the block's order by time."""
        codes = sorted({KIND_CODES[str(kind)] for kind in pool.kinds}) if pool.kinds else range(len(KIND_CODES))
        created = self.created
        runs: list[tuple[int, int]] = []
        for code in codes:
            lo, hi = self._blocks[code]
            if lo < hi and pool.since is not None:
                lo += int(np.searchsorted(created[lo:hi], micros(pool.since), "left"))
            if lo < hi and pool.until is not None:
                hi = lo + int(np.searchsorted(created[lo:hi], micros(pool.until), "right"))
            if lo < hi:
                runs.append((lo, hi))
        return runs

    def _pool_rows(self, pool: Pool, n: int, runs: Sequence[tuple[int, int]]) -> npt.NDArray[np.intp]:
        """Rows of live records in the pool, ascending: within its runs of sorted rows (``_pool_runs``) only
        liveness and validity are left to check; the rows added since the load are checked on every filter.
        (One mask over all rows per pool cost 3-4x as much: the read path searches three pools.)"""
        alive, valid = self.alive, self.valid
        parts = [
            lo + np.flatnonzero(alive[lo:hi] if pool.include_invalid else alive[lo:hi] & valid[lo:hi])
            for lo, hi in runs
        ]
        if self._sorted < n:
            parts.append(self._sorted + np.flatnonzero(self._mask_at(slice(self._sorted, n), pool)))
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.intp)

    def _mask_at(self, at: slice | npt.NDArray[np.intp], pool: Pool) -> npt.NDArray[np.bool_]:
        """Whether each row of ``at`` (rows [0, n) or some of them) is live and in the pool."""
        mask = self.alive[at].copy()
        if not pool.include_invalid:
            mask &= self.valid[at]
        if pool.kinds:
            mask &= _kind_table(pool.kinds)[self.kind[at]]
        if pool.since is not None:
            mask &= self.created[at] >= micros(pool.since)
        if pool.until is not None:
            mask &= self.created[at] <= micros(pool.until)
        return mask

    def rows_in_pool(self, ids: Sequence[str], pool: Pool) -> tuple[list[int], list[int]]:
        """The rows of those ``ids`` whose records are live and in ``pool`` (ids found by another index, which
        may be older than the cache), and each one's position in ``ids``; checked on the filter columns at
        once, for ``records_at``."""
        index = self.index
        rows = np.fromiter(map(index.get, ids, itertools.repeat(-1)), dtype=np.intp, count=len(ids))
        held = np.flatnonzero(rows >= 0)
        kept = held[self._mask_at(rows[held], pool)]
        return rows[kept].tolist(), kept.tolist()

    def _drop_fresh_pieces(self, record_id: str) -> None:
        if record_id in self._fresh_pieces:
            self._fresh_bytes -= _pieces_bytes(self._fresh_pieces.pop(record_id))

    def pieces_of(self, ids: Sequence[str]) -> list[npt.NDArray[np.int64] | None]:
        """The word pieces kept for these records (None where none are: unknown ids, rows written without)."""
        fresh, index, base, held = self._fresh_pieces, self.index, self._base, self._piece_held
        values, offsets = self._piece_values, self._piece_offsets
        out: list[npt.NDArray[np.int64] | None] = []
        for record_id in ids:
            if record_id in fresh:
                out.append(fresh[record_id])
                continue
            row = index.get(record_id)
            at = -1 if row is None else base[row]
            out.append(values[offsets[at] : offsets[at + 1]] if at >= 0 and held[at] else None)
        return out

    def records(self, ids: Sequence[str]) -> list[MemoryRecord | None]:
        """The current records for ``ids`` (None where deleted), materialised from the loaded columns."""
        rows = [self.index.get(record_id) for record_id in ids]
        self.records_at([row for row in rows if row is not None])  # materialises the missing ones
        return [self._records[row] if row is not None else None for row in rows]

    def records_at(self, rows: Sequence[int]) -> list[MemoryRecord]:
        """The records of live rows (``search_rows``'), materialised from the loaded columns once."""
        records = self._records
        pending = [row for row in rows if records[row] is None]
        for row in pending:
            records[row] = cast("RecordColumns", self._columns).record(self._base[row])
        self._materialised += len(pending)
        return cast("list[MemoryRecord]", [records[row] for row in rows])

    def vector(self, record_id: str) -> npt.NDArray[np.float32]:
        """The stored vector of a cached record (a read-only copy: the column is reused as the user changes)."""
        vector = self.vectors[:, self.index[record_id]].copy()
        vector.setflags(write=False)
        return vector

    def _live_rows(self, kinds: Sequence[Kind] | None, include_invalid: bool) -> npt.NDArray[np.intp]:
        """Rows of live records of ``kinds`` (all kinds when empty), invalid ones only if ``include_invalid``."""
        pool = Pool(0, tuple(kinds or ()), include_invalid=include_invalid)
        return self._pool_rows(pool, self.n, self._pool_runs(pool))

    def keys(self, kinds: Sequence[Kind] | None, include_invalid: bool) -> pa.Table:
        """(id, created_at in microseconds) of live records matching the filters, as ``MemoryTable.keys``."""
        rows = self._live_rows(kinds, include_invalid)
        return pa.table({"id": [self.ids[row] for row in rows.tolist()], "created_at": self.created[rows]})

    def ordered_ids(self, kinds: Sequence[Kind] | None, include_invalid: bool) -> list[str]:
        """Ids of live records, newest first (created_at, then id, descending)."""
        rows = self._live_rows(kinds, include_invalid)
        rows_sorted = sorted(rows.tolist(), key=lambda row: (int(self.created[row]), self.ids[row]), reverse=True)
        return [self.ids[row] for row in rows_sorted]


def _pieces_bytes(pieces: npt.NDArray[np.int64] | None) -> int:
    return 100 + (0 if pieces is None else pieces.nbytes)  # the array, or None, and its dict entry


def _pieces_columns(rows: pa.Table | None) -> tuple[npt.NDArray[np.int64], list[int], list[bool]]:
    """The loaded rows' ``pieces`` column as (values, offsets, held): one array and two lists, not an array per
    row. A table without the column (older, or a test's) holds none."""
    count = rows.num_rows if rows is not None else 0
    if rows is None or PIECES not in rows.column_names or count == 0:
        return np.zeros(0, np.int64), [0] * (count + 1), [False] * count
    column = rows[PIECES].combine_chunks()
    values = column.values.to_numpy(zero_copy_only=False).astype(np.int64)  # term matching's dtype
    offsets: list[int] = column.offsets.to_pylist()
    held: list[bool] = column.is_valid().to_pylist()
    return values, offsets, held


@functools.lru_cache(maxsize=64)
def _kind_table(kinds: tuple[Kind, ...]) -> npt.NDArray[np.bool_]:
    """Kind code -> whether the kind is among ``kinds`` (indexing with the codes is a vectorised ``isin``)."""
    table = np.zeros(len(KIND_CODES), dtype=np.bool_)
    table[[KIND_CODES[str(kind)] for kind in kinds]] = True
    return table


def _dot(query: npt.NDArray[np.float32], columns: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    """Cosine of the query with every column (unit vectors). BLAS runs on one thread (``single_thread_blas``):
    OpenBLAS's threaded gemv spins against the event loop and the embedder on a small busy box."""
    scores: npt.NDArray[np.float32] = query @ columns
    return scores


def single_thread_blas() -> None:
    """Pin BLAS to one thread for the process: the vector search's gemv is memory-bound, and threads that
    spin-wait cost the event loop more than they save (8-16 ms for 10k x 384 under load, against 0.3 ms)."""
    threadpoolctl.threadpool_limits(limits=1, user_api="blas")


def _top_k(scores: npt.NDArray[np.float32], rows: npt.NDArray[np.intp], k: int) -> tuple[list[int], list[float]]:
    """The ``k`` best (rows, scores), best first, equal scores in row order; ``scores[i]`` belongs to row
    ``rows[i]``. NaN scores (a stored vector of NaNs) rank last.

    Chosen by value: the k-th best score from a partition of the scores, then the rows scoring at least that. An
    argpartition of the negated scores cost 2.5x as much (125-140 against 52 us for 60 of 7,500 rows), and left
    which of several equal scores at the cut came in to its selection algorithm.
    """
    take = min(k, rows.size)
    if take <= 0:
        return [], []
    cut = scores.size - take
    kth = np.partition(scores, cut)[cut]  # NaNs sort last: with any among the best ``take``, none compare
    held = np.flatnonzero(scores >= kth)  # the best ``take``, and any more equal to the k-th
    if held.size < take:  # NaNs took places: a full sort, with them below every number
        top = np.argsort(np.where(np.isnan(scores), np.inf, -scores), kind="stable")[:take]
    else:
        top = held[np.argsort(-scores[held], kind="stable")[:take]]
    return rows[top].tolist(), scores[top].tolist()


class VectorCache:
    """Users' ``UserVectors`` under one byte budget, least recently used evicted first."""

    def __init__(self, max_bytes: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_bytes = max_bytes
        self._clock = clock
        self.hits = 0
        self.misses = 0
        self._entries: OrderedDict[str, UserVectors] = OrderedDict()  # least recently read first
        self._bytes: dict[str, int] = {}
        self._read_at: dict[str, float] = {}  # ``clock()`` at each entry's last read
        self._total = 0
        # user -> the writes to replay onto the entry being loaded (None: dropped meanwhile, discard the load)
        self._loading: dict[str, list[Callable[[UserVectors], object]] | None] = {}
        self._inflight: dict[str, asyncio.Event] = {}
        # A load runs in its own task so that a caller's deadline cannot cancel it: a user whose first load
        # is slower than the read-path deadline would otherwise never get cached and never get memory.
        self._loads: dict[str, asyncio.Task[UserVectors | None]] = {}
        self._too_big: OrderedDict[str, None] = OrderedDict()

    @property
    def nbytes(self) -> int:
        """Bytes currently held, by the entries' own estimate."""
        return self._total

    async def aclose(self) -> None:
        """Stop the loads in flight (the store closes; nothing would use them)."""
        await _cancel_all(self._loads.values())

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, user_id: object) -> bool:
        return user_id in self._entries

    def peek(self, user_id: str) -> UserVectors | None:
        """The user's entry if cached, without marking it used: what the write side and the management API
        read must not keep a user the read side left in the cache (``release_idle``)."""
        return self._entries.get(user_id)

    def get(self, user_id: str) -> UserVectors | None:
        """The user's entry if cached (and mark it most recently used)."""
        entry = self._entries.get(user_id)
        if entry is not None:
            self._entries.move_to_end(user_id)
            self._read_at[user_id] = self._clock()
        return entry

    async def get_or_load(self, user_id: str, load: Callable[[], Awaitable[UserVectors | None]]) -> UserVectors | None:
        """The cached entry, else one loaded by ``load`` (None: the user does not fit, search elsewhere)."""
        while (event := self._inflight.get(user_id)) is not None:
            await event.wait()
        entry = self.get(user_id)
        if entry is not None:
            self.hits += 1
            return entry
        if user_id in self._too_big:
            return None
        self.misses += 1
        return await self._load(user_id, load)

    async def _load(self, user_id: str, load: Callable[[], Awaitable[UserVectors | None]]) -> UserVectors | None:
        task = self._loads.get(user_id)
        if task is None:
            event = self._inflight[user_id] = asyncio.Event()
            self._loading[user_id] = []  # writes from now on are replayed onto what the load returns
            task = self._loads[user_id] = asyncio.create_task(self._load_and_keep(user_id, load, event))
            task.add_done_callback(lambda _: self._loads.pop(user_id, None))
        return await asyncio.shield(task)

    async def _load_and_keep(
        self, user_id: str, load: Callable[[], Awaitable[UserVectors | None]], event: asyncio.Event
    ) -> UserVectors | None:
        try:
            entry = await load()
            replay = self._loading.pop(user_id, None)
            if entry is not None and replay is not None:
                for write in replay:
                    write(entry)
        finally:
            self._loading.pop(user_id, None)
            del self._inflight[user_id]
            event.set()
        if entry is None:
            self._mark_too_big(user_id)
        elif replay is not None:
            self._put(user_id, entry)
        return entry

    def _mark_too_big(self, user_id: str) -> None:
        self._too_big[user_id] = None
        while len(self._too_big) > 1024:
            self._too_big.popitem(last=False)

    def _put(self, user_id: str, entry: UserVectors) -> None:
        if entry.nbytes > self.max_bytes:
            self._mark_too_big(user_id)
            return
        self._entries[user_id] = entry
        self._read_at[user_id] = self._clock()
        self._account(user_id)

    def _account(self, user_id: str) -> None:
        size = self._entries[user_id].nbytes
        self._total += size - self._bytes.get(user_id, 0)
        self._bytes[user_id] = size
        if size > self.max_bytes:
            self.drop(user_id)
            self._mark_too_big(user_id)
            return
        while self._total > self.max_bytes:
            self.drop(next(iter(self._entries)))

    def upsert(
        self,
        records: Sequence[MemoryRecord],
        vectors: npt.NDArray[np.float32],
        pieces: Sequence[npt.NDArray[np.int64] | None] | None = None,
    ) -> None:
        """Apply added or changed records (already durable in LanceDB) to cached users, with their word pieces
        (None: none kept)."""
        touched: set[str] = set()
        for i, (record, vector) in enumerate(zip(records, vectors, strict=True)):
            held = None if pieces is None else pieces[i]
            if self._loading.get(record.user_id) is not None:
                write = functools.partial(UserVectors.upsert, record=record, vector=vector.copy(), pieces=held)
                self._note_write(record.user_id, write)
            entry = self._entries.get(record.user_id)
            if entry is not None:
                entry.upsert(record, vector, held)
                touched.add(record.user_id)
        for user_id in touched:
            if user_id in self._entries:
                self._account(user_id)

    def patch(self, user_id: str, ids: Sequence[str], **changes: object) -> None:
        """Apply a field change that leaves vectors and filters alone (``last_accessed_at``: ahead of LanceDB)."""
        self._note_write(user_id, lambda loaded: loaded.patch(ids, **changes))
        entry = self._entries.get(user_id)
        if entry is not None:
            entry.patch(ids, **changes)

    def remove(self, user_id: str, ids: Sequence[str]) -> None:
        """Apply deletes (already durable in LanceDB)."""
        ids = list(ids)
        self._note_write(user_id, lambda loaded: loaded.remove(ids))
        self._too_big.pop(user_id, None)
        entry = self._entries.get(user_id)
        if entry is not None:
            entry.remove(ids)
            self._account(user_id)

    def release_idle(self, idle_s: float, now: float | None = None) -> list[str]:
        """Once no read has come for ``READS_IDLE_S``, drop the entries no read has used for ``idle_s`` seconds
        (writes do not count: they keep an entry current, not useful); returns their users. Their next read
        loads them again from LanceDB. While reads keep coming, only the byte budget evicts."""
        now = self._clock() if now is None else now
        if not self._entries or now - self._read_at[next(reversed(self._entries))] < READS_IDLE_S:
            return []  # the last entry is the one read last
        cutoff = now - idle_s
        idle = []
        for user_id in self._entries:  # least recently read first
            if self._read_at[user_id] > cutoff:
                break
            idle.append(user_id)
        for user_id in idle:
            self.drop(user_id)
        return idle

    def drop(self, user_id: str) -> None:
        """Forget everything cached about the user."""
        self._entries.pop(user_id, None)
        self._read_at.pop(user_id, None)
        self._total -= self._bytes.pop(user_id, 0)
        self._too_big.pop(user_id, None)
        self._discard_load(user_id)

    def clear(self) -> None:
        """Empty the cache (after a reindex, say)."""
        for user_id in list(self._entries):
            self.drop(user_id)
        for user_id in self._loading:
            self._loading[user_id] = None
        self._too_big.clear()

    def _note_write(self, user_id: str, write: Callable[[UserVectors], object]) -> None:
        """Keep a write for the load of this user in flight, if any (too many: the load is discarded)."""
        replay = self._loading.get(user_id)
        if replay is None:
            return
        if len(replay) >= MAX_REPLAYED_WRITES:
            self._loading[user_id] = None
        else:
            replay.append(write)

    def _discard_load(self, user_id: str) -> None:
        if user_id in self._loading:
            self._loading[user_id] = None


async def _cancel_all(tasks: Iterable[asyncio.Task[Any]]) -> None:
    """Cancel these tasks and wait until they have finished."""
    pending = list(tasks)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
