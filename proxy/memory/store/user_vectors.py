"""One user's records in RAM for exact vector search: the vector matrix, the filter columns and the records.

An entry holds every record of the user (history included) as a vector matrix, filter columns (kind,
created_at, valid, alive) and the records themselves, materialised lazily from the Arrow rows loaded from
LanceDB. A loaded entry keeps its rows ordered by (kind, created_at), records added later after them, so that a
search scores only the runs of rows its pools can return (facts of all time and the window's turns, not years of
older turns): the scan is memory-bound, and after the pause between two requests it runs from RAM.
``vector_cache.VectorCache`` holds the entries under one byte budget.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from datetime import datetime
from typing import Any, cast

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from proxy.memory.store.exact_search import KIND_CODES, dot, kind_table, top_k
from proxy.memory.store.records import (
    PIECES,
    Kind,
    MemoryRecord,
    Pool,
    RecordColumns,
    arrow_rows,
    from_micros,
    to_micros,
)

# A materialised MemoryRecord with its own strings (~750 B under tracemalloc for a ~90-character turn) and an
# id with its index entry and list slots (~190 B), each with the allocator's share: 100,000 records mirrored into
# 100 entries as the chat processes get them (deployed allocator settings) cost 3.67 kB of RSS each against the
# 2.93 kB ``nbytes`` counted with 600 and 120 here (3.34 kB now).
_RECORD_OVERHEAD_BYTES = 900
_ID_OVERHEAD_BYTES = 230
_OVERRIDE_BYTES = 400  # a record's patched fields before it is made (a dict of one or two)
_LIST_INT_BYTES = 40  # an int in a Python list (the object and its slot), with its row's flag
_ARROW_ROW_BYTES = 400  # the loaded columns but the vector, in Arrow, per row (~330 B measured with ~70-byte texts)
_MIN_CAPACITY = 8  # rows a new entry has room for: most users start with a handful of memories (64 rows of 384
# float32 is 96 KB, empty)
_COMPACT_AFTER = 64  # deleted rows an entry tolerates before it may compact
_TRANSPOSE_BLOCK = 256  # rows copied into the transposed matrix at a time
_RUN_GAP = 64  # runs of rows to scan this close are scanned as one (a gemv call costs about as much as 64 rows)
_FULL_SCAN_SHARE = 0.9  # runs covering this share of the rows: one scan of them all


def grown(capacity: int) -> int:
    """The capacity after ``capacity`` filled up: half as much again (doubling left a user's matrix up to half
    empty, a third on average, under ``bench/writes.py --mode sustained``), still amortised O(1) copies per
    append."""
    return max(_MIN_CAPACITY, capacity + capacity // 2)


def estimated_bytes(rows: int, dim: int) -> int:
    """What an entry of ``rows`` records of dimension ``dim`` is expected to cost, before loading it."""
    return rows * (dim * 4 + _ARROW_ROW_BYTES + 200 + _ID_OVERHEAD_BYTES + 16)


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
        # The other columns stay in Arrow until a read returns their row (``records_at``): counted in ``nbytes``.
        vectors_only = ("embedding", PIECES)
        scalars = None if rows is None else rows.drop_columns([c for c in vectors_only if c in rows.column_names])
        self._columns = RecordColumns(scalars) if scalars is not None else None
        self._columns_bytes = self._columns.nbytes if self._columns is not None else 0
        # Each loaded row's word pieces (``memory.pieces``) as Arrow holds them: row ``base``'s are
        # ``_piece_values[_piece_offsets[base]:_piece_offsets[base + 1]]``, if ``_piece_held[base]`` (Python
        # lists: a lookup of numpy scalars costs several times as much, for the memories term matching scores). Records
        # written since the load keep theirs in ``_fresh_pieces`` (None: none), by id.
        self._piece_values, self._piece_offsets, self._piece_held = _pieces_columns(rows)
        self._fresh_pieces: dict[str, npt.NDArray[np.int64] | None] = {}
        self._fresh_bytes = 0
        self._base: list[int] = []  # row in self._columns, or -1 for records added after the load
        self._records: list[MemoryRecord | None] = []
        self._materialised = 0
        # Ids whose record differs from its loaded row, or has none (written or patched since the load; an access
        # time alone is in ``accessed``):
        # what a spill (``spill_parts``) writes from the records rather than the loaded columns.
        self._changed: set[str] = set()
        self._overrides: dict[str, dict[str, object]] = {}  # patched fields of records not made yet, by id
        # Rows [0, _sorted) are ordered by (kind code, created_at); ``_blocks[code]`` is that kind's (start, end)
        # among them. Rows after them (added since the load) are in no order: a search always scans them.
        self._sorted = 0
        self._blocks: list[tuple[int, int]] = [(0, 0)] * len(KIND_CODES)
        self._alloc(max(_MIN_CAPACITY, rows.num_rows if rows is not None else 0))
        if rows is not None:
            self._load(rows)

    def _alloc(self, capacity: int) -> None:
        # Transposed (dim x capacity): query @ vectors is OpenBLAS's fastest single-thread gemv here, faster than
        # einsum or matmul over rows.
        self.vectors = np.zeros((self.dim, capacity), dtype=np.float32)
        self.created = np.zeros(capacity, dtype=np.int64)
        self.kind = np.zeros(capacity, dtype=np.int8)
        self.valid = np.zeros(capacity, dtype=np.bool_)
        self.alive = np.zeros(capacity, dtype=np.bool_)
        # Each row's access time (``to_micros``) noted since its record was loaded or written, 0 for none: the
        # record shows it (``records_at``). A column rather than a changed record: a user read back from the
        # spill, touched and evicted again writes the column, not the records reads touched (``spill_parts``).
        self.accessed = np.zeros(capacity, dtype=np.int64)

    def _load(self, rows: pa.Table) -> None:
        count = rows.num_rows
        if count == 0:
            return
        created = rows["created_at"].cast(pa.int64()).to_numpy()
        codes = np.asarray([KIND_CODES[kind] for kind in rows["kind"].to_pylist()], dtype=np.int8)
        order = np.lexsort((created, codes))  # by kind, then time: see ``_scan_ranges``
        ordered = _vector_rows(rows["embedding"], self.dim)[order]
        for start in range(0, count, _TRANSPOSE_BLOCK):  # in blocks: a third faster than one strided copy
            end = min(start + _TRANSPOSE_BLOCK, count)
            self.vectors[:, start:end] = ordered[start:end].T
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
        codes, kinds = self.kind[:count], np.arange(len(KIND_CODES))
        self._sorted = count
        starts, ends = np.searchsorted(codes, kinds, "left").tolist(), np.searchsorted(codes, kinds, "right").tolist()
        self._blocks = list(zip(starts, ends, strict=True))

    @property
    def live(self) -> int:
        """How many records the entry holds (deleted ones excluded)."""
        return self.n - self.dead

    @property
    def nbytes(self) -> int:
        """Approximate memory held by the entry."""
        arrays = self.vectors.nbytes + self.created.nbytes + self.accessed.nbytes + self.kind.nbytes * 3
        arrays += self._piece_values.nbytes + len(self._piece_offsets) * _LIST_INT_BYTES
        arrays += self._fresh_bytes
        rows = self._columns_bytes
        extra = self._materialised * _RECORD_OVERHEAD_BYTES + len(self.ids) * _ID_OVERHEAD_BYTES
        extra += len(self._overrides) * _OVERRIDE_BYTES
        return arrays + rows + extra

    def upsert(
        self, record: MemoryRecord, vector: npt.NDArray[np.float32], pieces: npt.NDArray[np.int64] | None = None
    ) -> None:
        """Add a record or replace the one with the same id (new text, vector, validity...), with its word pieces
        (None: none kept)."""
        row = self.index.get(record.id)
        code, created = KIND_CODES[str(record.kind)], to_micros(record.created_at)
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
        self.accessed[row] = 0  # the record's own
        self._records[row] = record.replace(embedding=None)
        self._changed.add(record.id)
        self._overrides.pop(record.id, None)
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
        return [self.vectors, self.created, self.kind, self.valid, self.alive, self.accessed]

    def _grow(self, capacity: int) -> None:
        old = self._arrays()
        self._alloc(capacity)
        for new, previous in zip(self._arrays(), old, strict=True):
            new[..., : self.n] = previous[..., : self.n]  # the vectors' rows are along the last axis

    def patch(self, ids: Sequence[str], **changes: object) -> None:
        """Change fields that do not touch the vector or the filters (``last_accessed_at``, say); a record not
        made yet gets them when it is (making each touched record at once cost more than the reads that follow).
        An access time alone goes in the ``accessed`` column."""
        at = changes.get("last_accessed_at")
        if len(changes) == 1 and isinstance(at, datetime):
            self._note_accessed(ids, at, only_later=False)
            return
        records, index = self._records, self.index
        for record_id in ids:
            row = index.get(record_id)
            if row is None:
                continue
            record = records[row]
            if record is None:
                self._overrides.setdefault(record_id, {}).update(changes)
            elif any(getattr(record, name) != value for name, value in changes.items()):
                records[row] = record.replace(**changes)  # (a flush repeats a touch)
            else:
                continue
            self._changed.add(record_id)
            if "last_accessed_at" in changes:
                self.accessed[row] = 0  # the changed record carries it (a spill writes the record)

    def touch(self, record_id: str, at: datetime) -> None:
        """Note an access time on one record, unless it already shows a later one."""
        self._note_accessed([record_id], at, only_later=True)

    def _note_accessed(self, ids: Sequence[str], at: datetime, *, only_later: bool) -> None:
        """Set the access time of these records (``only_later``: where it is later than the one they show):
        in ``accessed``, and on the records already made."""
        records, index, accessed, value = self._records, self.index, self.accessed, to_micros(at)
        for record_id in ids:
            row = index.get(record_id)
            if row is None:
                continue
            if only_later:
                shown = self.records_at([row])[0].last_accessed_at
                if shown is not None and shown >= at:
                    continue
            accessed[row] = value
            record = records[row]
            if record is not None and record.last_accessed_at != at:
                records[row] = record.replace(last_accessed_at=at)  # (a flush repeats a touch)
            elif record is None and "last_accessed_at" in self._overrides.get(record_id, ()):
                self._overrides[record_id]["last_accessed_at"] = at  # (applied after the column when made)

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
        self._changed.discard(record_id)
        self._overrides.pop(record_id, None)
        self._drop_fresh_pieces(record_id)
        self.alive[row] = False
        self.accessed[row] = 0
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
            out.append(top_k(scores[rows], rows, pool.k))
        return out

    def _scores(
        self, query: npt.NDArray[np.float32], runs: Sequence[list[tuple[int, int]]], n: int
    ) -> npt.NDArray[np.float32]:
        """The query's cosine with every row the pools (their ``_pool_runs``) can return (NaN for the others)."""
        ranges = self._scan_ranges(runs, n)
        if sum(hi - lo for lo, hi in ranges) >= _FULL_SCAN_SHARE * n:
            return dot(query, self.vectors[:, :n])
        scores = np.full(n, np.nan, dtype=np.float32)
        for lo, hi in ranges:
            scores[lo:hi] = dot(query, self.vectors[:, lo:hi])
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
                lo += int(np.searchsorted(created[lo:hi], to_micros(pool.since), "left"))
            if lo < hi and pool.until is not None:
                hi = lo + int(np.searchsorted(created[lo:hi], to_micros(pool.until), "right"))
            if lo < hi:
                runs.append((lo, hi))
        return runs

    def _pool_rows(self, pool: Pool, n: int, runs: Sequence[tuple[int, int]]) -> npt.NDArray[np.intp]:
        """Rows of live records in the pool, ascending: within its runs of sorted rows (``_pool_runs``) only
        liveness and validity are left to check; the rows added since the load are checked on every filter.
        (One mask over every row for each pool repeated the whole scan per pool: the read path searches three.)"""
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
            mask &= kind_table(pool.kinds)[self.kind[at]]
        if pool.since is not None:
            mask &= self.created[at] >= to_micros(pool.since)
        if pool.until is not None:
            mask &= self.created[at] <= to_micros(pool.until)
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

    def created_after(self, ids: Sequence[str], horizon: datetime) -> frozenset[str]:
        """Those of ``ids`` held here that were created after ``horizon``."""
        index, created, after = self.index, self.created, to_micros(horizon)
        return frozenset(i for i in ids if (row := index.get(i)) is not None and created[row] > after)

    def records(self, ids: Sequence[str]) -> list[MemoryRecord | None]:
        """The current records for ``ids`` (None where deleted), materialised from the loaded columns."""
        rows = [self.index.get(record_id) for record_id in ids]
        self.records_at([row for row in rows if row is not None])  # materialises the missing ones
        return [self._records[row] if row is not None else None for row in rows]

    def records_at(self, rows: Sequence[int]) -> list[MemoryRecord]:
        """The records of live rows (``search_rows``'), materialised from the loaded columns once."""
        records = self._records
        pending = list(dict.fromkeys(row for row in rows if records[row] is None))
        if pending:
            made = cast("RecordColumns", self._columns).records([self._base[row] for row in pending])
            overrides, ids, accessed = self._overrides, self.ids, self.accessed
            for row, record in zip(pending, made, strict=True):
                changes = overrides.pop(ids[row], None) if overrides else None
                if accessed[row]:  # (made here: no one else holds it yet)
                    object.__setattr__(record, "last_accessed_at", from_micros(int(accessed[row])))
                records[row] = record if changes is None else record.replace(**changes)
            self._materialised += len(pending)
        return cast("list[MemoryRecord]", [records[row] for row in rows])

    def records_by_pool(self, pools_rows: Sequence[Sequence[int]]) -> list[list[MemoryRecord]]:
        """``records_at`` of each pool's rows, the new ones made in one call: a call costs about the same
        whatever its rows (a take and a conversion per column), and an arm searches two or three pools."""
        made = iter(self.records_at([row for rows in pools_rows for row in rows]))
        return [list(itertools.islice(made, len(rows))) for rows in pools_rows]

    def spill_parts(self) -> SpillParts:
        """The entry as arrays and Arrow data for ``vector_spill`` to write, ``from_spill`` to make again: the
        rows as they are (deleted ones included), and the loaded columns with the records that differ from theirs
        (written, patched or touched since the load) appended, those rows pointing at them. Records made from
        the loaded columns are left out (made again when a read returns them)."""
        n = self.n
        base = np.asarray(self._base, dtype=np.int64)
        alive = self.alive[:n]
        # (a row written since the load, ``base`` -1, is in ``_changed`` too)
        changed = sorted(self.index[record_id] for record_id in self._changed if record_id in self.index)
        table = self._columns.table if self._columns is not None else None
        values, offsets, held = self._piece_values, self._piece_offsets, self._piece_held
        if changed:
            made = arrow_rows(
                self.records_at(changed), self.vectors[:, changed].T, self.pieces_of([self.ids[r] for r in changed])
            )
            added = made.drop_columns(["embedding", PIECES])
            start = 0 if table is None else table.num_rows
            table = added if table is None else pa.concat_tables([table, added.cast(table.schema)])
            base[changed] = start + np.arange(len(changed))
            values, offsets, held = _appended_pieces((values, offsets, held), _pieces_columns(made))
        if table is not None and (changed or table.num_rows > self.live):
            # Only the rows live records point at, in one chunk: the rows changed records replaced (and those of
            # deleted ones) would otherwise stay in the file and grow it at every write (a user read back, touched
            # and evicted again many times gained ~200 rows a write), and a read of a file of two chunks joined them.
            live = np.flatnonzero(alive)
            table = table.take(pa.array(base[live], pa.int64())).combine_chunks()
            values, offsets, held = _taken_pieces((values, offsets, held), base[live])
            base = np.full(n, -1, dtype=np.int64)
            base[live] = np.arange(len(live))
        arrays: dict[str, npt.NDArray[Any]] = {
            "vectors": np.ascontiguousarray(self.vectors[:, :n]),
            "created": self.created[:n],
            "kind": self.kind[:n],
            "valid": self.valid[:n],
            "alive": alive,
            "accessed": self.accessed[:n],
            "base": base,
            "piece_values": values,
            "piece_offsets": np.asarray(offsets, dtype=np.int64),
            "piece_held": np.asarray(held, dtype=np.bool_),
        }
        ids = pa.array(self.ids, pa.string())
        return SpillParts(n, self.dead, self._sorted, self.generation, arrays, ids, table)

    @classmethod
    def from_spill(cls, user_id: str, parts: SpillParts) -> UserVectors:
        """The entry ``spill_parts`` wrote: the same rows, records and word pieces, none made yet."""
        entry = cls(user_id, parts.arrays["vectors"].shape[0])
        arrays, n = parts.arrays, parts.n
        entry.vectors, entry.created, entry.kind = arrays["vectors"], arrays["created"], arrays["kind"]
        entry.valid, entry.alive, entry.accessed = arrays["valid"], arrays["alive"], arrays["accessed"]
        entry.n, entry.dead, entry.generation = n, parts.dead, parts.generation
        entry.ids = parts.ids.to_pylist()
        if parts.dead:
            entry.index = {entry.ids[row]: row for row in np.flatnonzero(entry.alive[:n]).tolist()}
        else:
            entry.index = dict(zip(entry.ids, range(n), strict=True))
        entry._columns = RecordColumns(parts.columns, compact=True) if parts.columns is not None else None
        entry._columns_bytes = entry._columns.nbytes if entry._columns is not None else 0
        entry._piece_values = arrays["piece_values"]
        entry._piece_offsets = arrays["piece_offsets"].tolist()
        entry._piece_held = arrays["piece_held"].tolist()
        entry._base = arrays["base"].tolist()
        entry._records = [None] * n
        entry._sorted_prefix(parts.sorted)
        return entry

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


@dataclasses.dataclass(frozen=True)
class SpillParts:
    """One entry as ``UserVectors.spill_parts`` gives it: its counts, its arrays (``vectors`` (dim, n) float32;
    ``created``, ``accessed``, ``base``, ``piece_values``, ``piece_offsets`` int64; ``kind`` int8; ``valid``,
    ``alive``, ``piece_held`` bool), its ids and its record columns."""

    n: int
    dead: int
    sorted: int
    generation: int
    arrays: dict[str, npt.NDArray[Any]]
    ids: pa.Array
    columns: pa.Table | None


_Pieces = tuple[npt.NDArray[np.int64], list[int], list[bool]]


def _appended_pieces(first: _Pieces, then: _Pieces) -> _Pieces:
    """``_pieces_columns`` of rows then more rows, as one: the second's values after the first's (each one's
    offsets may start past 0 or end before its values do: Arrow slices)."""
    values, offsets, held = first
    more_values, more_offsets, more_held = then
    end = offsets[-1]
    joined = np.concatenate([values[:end], more_values[more_offsets[0] : more_offsets[-1]]])
    shifted = [end + offset - more_offsets[0] for offset in more_offsets[1:]]
    return joined, offsets + shifted, held + more_held


def _taken_pieces(pieces: _Pieces, rows: npt.NDArray[np.int64]) -> _Pieces:
    """``_pieces_columns`` of these rows of ``pieces``' rows, in this order."""
    values, offsets, held = pieces
    bounds = np.asarray(offsets, dtype=np.int64)
    starts, lengths = bounds[rows], bounds[rows + 1] - bounds[rows]
    kept = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(lengths, out=kept[1:])
    at = np.repeat(starts - kept[:-1], lengths) + np.arange(int(kept[-1]), dtype=np.int64)
    return values[at], kept.tolist(), [held[row] for row in rows.tolist()]


def _vector_rows(column: pa.ChunkedArray, dim: int) -> npt.NDArray[np.float32]:
    """A ``fixed_size_list<float>[dim]`` column as a (rows, dim) array: a view of Arrow's buffer when it is one
    chunk (combining and flattening copied the 1.5 MB of a 1,000-row user twice)."""
    chunks = [chunk.flatten().to_numpy(zero_copy_only=False) for chunk in column.chunks]
    flat = chunks[0] if len(chunks) == 1 else np.concatenate(chunks) if chunks else np.zeros(0, np.float32)
    return flat.reshape(-1, dim)


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
