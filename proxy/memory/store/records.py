"""Memory records: one value type for every kind, and its pyarrow schema.

Every kind of memory (turns, facts, summaries, insights, subjects) lives in one LanceDB table so that
one user's memories can be searched, listed, exported and forgotten with one scoped operation. Fields
that a kind does not use are null. History is kept in the same table: a superseded fact or an old
insight set has ``valid = False``. A record the screens flagged (``flagged``, see ``screens.py``) is kept
and listed but never injected.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import operator
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc

from proxy.memory.errors import StoreError
from proxy.memory.store.background import Submission

SCHEMA_VERSION = 2  # 2: ``expires_at`` (a nullable column, added on open: see ``migrations``)


class Kind(StrEnum):
    """What a memory record is."""

    TURN = "turn"
    FACT = "fact"
    SUMMARY = "summary"
    INSIGHT = "insight"
    SUBJECT = "subject"


@dataclasses.dataclass(frozen=True, slots=True)
class Pool:
    """One filtered top-``k`` search among a user's records (several run over one query at once)."""

    k: int
    kinds: tuple[Kind, ...] = ()  # empty: every kind
    since: datetime | None = None
    until: datetime | None = None
    include_invalid: bool = False


def newest_generation(records: Sequence[MemoryRecord]) -> list[MemoryRecord]:
    """The insights of the most recently created generation, by confidence then size, highest first.

    A regeneration adds the new set before it retires the old one, so a reader in between sees both.
    """
    if not records:
        return []
    newest = max(records, key=lambda r: (r.created_at, r.generation_id or ""))
    same = [r for r in records if r.generation_id == newest.generation_id]
    return sorted(same, key=lambda r: (-(r.confidence or 0.0), -(r.cluster_size or 0), r.id))


def new_id() -> str:
    """A fresh, stable, URL-safe record id."""
    return uuid.uuid4().hex


def utcnow() -> datetime:
    """The current time, timezone-aware UTC, at microsecond precision."""
    return datetime.now(UTC)


@dataclasses.dataclass(frozen=True, slots=True)
class MemoryRecord:
    """One remembered thing of one user. ``embedding`` is None until the store embeds ``text``."""

    user_id: str
    kind: Kind
    text: str
    id: str = dataclasses.field(default_factory=new_id)
    created_at: datetime = dataclasses.field(default_factory=utcnow)
    updated_at: datetime | None = None
    last_accessed_at: datetime | None = None
    embedding: Sequence[float] | None = None
    model_id: str = ""
    valid: bool = True
    # turns
    conversation_id: str | None = None
    role: str | None = None
    partial: bool = False
    # facts
    category: str | None = None
    importance: int = 5
    entities: tuple[str, ...] = ()
    sensitive: bool = False
    source_ids: tuple[str, ...] = ()
    superseded_by: str | None = None
    # summaries (time span) and insights (date range)
    start_at: datetime | None = None
    end_at: datetime | None = None
    # insights
    confidence: float | None = None
    cluster_size: int | None = None
    generation_id: str | None = None
    # subjects
    subject_kind: str | None = None
    # free-form extension, JSON text
    meta: str | None = None
    # why the screens flagged this text (instruction-like, planted link): kept and shown, never injected.
    # Stores written before the column existed read as None (not flagged).
    flagged: str | None = None
    # when the memory stops being injected (and the retention sweep deletes it); None: never. Stores written
    # before the column existed read as None.
    expires_at: datetime | None = None

    def replace(self, **changes: Any) -> MemoryRecord:
        """A copy with ``changes`` applied: ``dataclasses.replace``, field by field, which costs less (the read
        path copies a record for each access time it shows)."""
        if not changes.keys() <= _FIELD_SET:
            raise TypeError(f"MemoryRecord has no field {sorted(changes.keys() - _FIELD_SET)[0]!r}")
        new = _NEW(MemoryRecord)
        for name, value in zip(_FIELD_NAMES, _FIELD_VALUES(self), strict=True):
            _SET(new, name, value)
        for name, value in changes.items():
            _SET(new, name, value)
        return new

    def public_dict(self) -> dict[str, Any]:
        """JSON-ready fields for APIs and exports (no embedding vector)."""
        out: dict[str, Any] = {}
        for field in dataclasses.fields(self):
            if field.name == "embedding":
                continue
            value = getattr(self, field.name)
            if isinstance(value, datetime):
                value = value.isoformat()
            elif isinstance(value, tuple):
                value = list(value)
            out[field.name] = value
        return out


PIECES = "pieces"
PIECES_TYPE = pa.list_(pa.int32())


def pieces_array(pieces: Sequence[npt.NDArray[np.int64] | None] | None, count: int) -> pa.Array:
    """The ``pieces`` column of ``count`` rows (all null without pieces; a None entry is a null row)."""
    if pieces is None:
        return pa.nulls(count, PIECES_TYPE)
    lengths = np.array([0 if p is None else len(p) for p in pieces], dtype=np.int32)
    offsets = pa.array(np.concatenate(([0], np.cumsum(lengths, dtype=np.int32))), pa.int32())
    held = [p for p in pieces if p is not None]
    values = pa.array(np.concatenate(held).astype(np.int32) if held else np.zeros(0, np.int32), pa.int32())
    mask = pa.array([p is None for p in pieces], pa.bool_())
    return pa.ListArray.from_arrays(offsets, values, mask=mask)


def _ts() -> pa.DataType:
    return pa.timestamp("us", tz="UTC")


def arrow_schema(dim: int) -> pa.Schema:
    """The LanceDB table schema for embeddings of dimension ``dim``."""
    fields = [
        pa.field("id", pa.string(), nullable=False),
        pa.field("user_id", pa.string(), nullable=False),
        pa.field("kind", pa.string(), nullable=False),
        pa.field("text", pa.string(), nullable=False),
        pa.field("created_at", _ts(), nullable=False),
        pa.field("updated_at", _ts()),
        pa.field("last_accessed_at", _ts()),
        pa.field("embedding", pa.list_(pa.float32(), dim)),
        pa.field("model_id", pa.string(), nullable=False),
        pa.field("valid", pa.bool_(), nullable=False),
        pa.field("conversation_id", pa.string()),
        pa.field("role", pa.string()),
        pa.field("partial", pa.bool_(), nullable=False),
        pa.field("category", pa.string()),
        pa.field("importance", pa.int8(), nullable=False),
        pa.field("entities", pa.list_(pa.string())),
        pa.field("sensitive", pa.bool_(), nullable=False),
        pa.field("source_ids", pa.list_(pa.string())),
        pa.field("superseded_by", pa.string()),
        pa.field("start_at", _ts()),
        pa.field("end_at", _ts()),
        pa.field("confidence", pa.float32()),
        pa.field("cluster_size", pa.int32()),
        pa.field("generation_id", pa.string()),
        pa.field("subject_kind", pa.string()),
        pa.field("meta", pa.string()),
        pa.field("flagged", pa.string()),  # added to older tables by ``MemoryTable.open``
        pa.field("expires_at", _ts()),  # schema version 2, added to older tables by ``MemoryTable.open``
        # The text's word pieces by the model's term vectors (``memory.pieces``): no record field, the
        # store's own; null in rows written before it (added to older tables by ``MemoryTable.open``).
        pa.field(PIECES, PIECES_TYPE),
    ]
    return pa.schema(fields, metadata={"memproxy.schema_version": str(SCHEMA_VERSION)})


def to_arrow(records: Sequence[MemoryRecord], dim: int) -> pa.Table:
    """Records (already embedded) as a table in ``arrow_schema(dim)`` (no pieces)."""
    schema = arrow_schema(dim)
    columns: dict[str, list[Any]] = {name: [] for name in schema.names}
    columns[PIECES] = [None] * len(records)
    for record in records:
        for name in schema.names:
            if name == PIECES:
                continue
            value = getattr(record, name)
            if name == "kind":
                value = str(value)
            elif isinstance(value, tuple):
                value = list(value)
            columns[name].append(value)
    return pa.Table.from_pydict(columns, schema=schema)


def arrow_rows(
    records: Sequence[MemoryRecord],
    vectors: npt.NDArray[np.float32],
    pieces: Sequence[npt.NDArray[np.int64] | None] | None = None,
) -> pa.Table:
    """Records as LanceDB rows, column by column, the vectors from one matrix (no per-float conversion), with
    each one's ``pieces`` (None: null)."""
    dim = vectors.shape[1]
    schema = arrow_schema(dim)
    columns = []
    for field in schema:
        if field.name == PIECES:
            columns.append(pieces_array(pieces, len(records)))
            continue
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


_FIELD_NAMES = tuple(field.name for field in dataclasses.fields(MemoryRecord))
_FIELD_SET = frozenset(_FIELD_NAMES)
_FIELD_VALUES = operator.attrgetter(*_FIELD_NAMES)
_NEW = object.__new__
_SLOTS: dict[str, Any] = {name: getattr(MemoryRecord, name) for name in _FIELD_NAMES}  # each field's slot
# runs an iterator to its end, keeping nothing
_drain: Callable[[Iterable[Any]], None] = collections.deque(maxlen=0).extend
_SET = object.__setattr__  # how a frozen dataclass's own __init__ sets its fields


def _tuple(value: Sequence[str] | None) -> tuple[str, ...]:
    return () if value is None else tuple(value)


def _list(value: Sequence[float] | None) -> list[float] | None:
    return None if value is None else list(value)


_US_UTC = pa.timestamp("us", tz="UTC")
_SLACK = 1.25  # buffers this much larger than the rows they hold are copied (``RecordColumns``)
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MICROSECOND = timedelta(microseconds=1)


def to_micros(at: datetime) -> int:
    """An aware datetime as whole microseconds since the epoch, in integers as Arrow casts a timestamp column
    (``timestamp() * 1e6`` goes through a float, exact only as far as its rounding allows); ``from_micros`` gives
    it back. The store's one conversion: the vector cache's columns and the LanceDB filters use it."""
    return (at - _EPOCH) // _MICROSECOND


def from_micros(value: int) -> datetime:
    """``to_micros``' datetime (UTC)."""
    return _EPOCH + _MICROSECOND * value


def _datetimes(column: pa.ChunkedArray) -> list[datetime | None]:
    """A ``timestamp[us, tz=UTC]`` column as aware datetimes: ~3x faster than Arrow's own conversion, which
    resolves the zone per value (a newly loaded user's read makes a record of each of its arms' hits, five such
    columns each)."""
    return [None if value is None else _EPOCH + _MICROSECOND * value for value in column.cast(pa.int64()).to_pylist()]


_KIND_OF = {str(kind): kind for kind in Kind}


def _kind(value: str) -> Kind:
    """``Kind(value)`` at a dict lookup's cost (an Enum call costs several times it, for every record made)."""
    kind = _KIND_OF.get(value)
    return kind if kind is not None else Kind(value)


# What a value read from Arrow (``to_pylist`` / ``to_pydict`` form) becomes in a record, by field.
_CONVERSIONS: dict[str, Callable[[Any], Any]] = {
    "kind": _kind,
    "entities": _tuple,
    "source_ids": _tuple,
    "embedding": _list,
}


@functools.lru_cache(maxsize=64)
def _defaults(names: tuple[str, ...]) -> list[tuple[str, Any]] | None:
    """The record fields a table of these columns lacks, with their defaults (None: one of them has no plain
    default, so its records go through the constructor); the same few schemas every time."""
    missing = [field for field in dataclasses.fields(MemoryRecord) if field.name not in names]
    plain = all(field.default is not dataclasses.MISSING for field in missing)  # ``embedding``, say: None
    return [(f.name, f.default) for f in missing] if plain else None


_Array = tuple[str, npt.NDArray[Any], Callable[[list[Any]], list[Any]]]


def _same_list(values: list[Any]) -> list[Any]:
    return values


def _datetimes_of(values: list[int]) -> list[datetime]:
    return [_EPOCH + _MICROSECOND * value for value in values]


def _split(table: pa.Table) -> tuple[list[_Array], list[tuple[str, Any]], pa.Table | None, int]:
    """``RecordColumns``' columns by how a row's value is made: from an array (numbers, flags and times without
    nulls as numpy arrays, kinds as codes into their ``Kind``s), one value for every row (a column null in each),
    or the rest (strings, lists, columns with some nulls) as Arrow columns to ``take`` from; and the bytes of the
    arrays that are not views of the table's buffers."""
    arrays: list[_Array] = []
    same: list[tuple[str, Any]] = []
    rest: list[str] = []
    extra = 0
    n = table.num_rows
    for name, column in zip(table.column_names, table.columns, strict=True):
        nulls = column.null_count
        if nulls == n and n:
            convert = _CONVERSIONS.get(name)
            same.append((name, None if convert is None else convert(None)))
            continue
        kind = column.type
        if nulls or not n or not (name == "kind" or kind in _ARRAY_TYPES):
            rest.append(name)
            continue
        chunk = column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()
        if name == "kind":
            codes = pc.index_in(chunk, value_set=_KIND_VALUES)
            if codes.null_count:  # (a kind this version does not know: ``Kind`` says so)
                rest.append(name)
                continue
            array = codes.to_numpy()
            arrays.append((name, array, _kinds_of))
            extra += array.nbytes
        elif kind == _US_UTC:
            arrays.append((name, chunk.view(pa.int64()).to_numpy(), _datetimes_of))
        else:
            array = chunk.to_numpy(zero_copy_only=False)
            arrays.append((name, array, _same_list))
            extra += array.nbytes if kind == pa.bool_() else 0  # (bits in Arrow: a copy in bytes)
    return arrays, same, table.select(rest) if rest else None, extra


# the types ``_split`` makes arrays of (numbers, flags, times)
_ARRAY_TYPES = frozenset(
    [pa.int8(), pa.int16(), pa.int32(), pa.int64(), pa.float32(), pa.float64(), pa.bool_(), _US_UTC]
)
_KINDS = tuple(Kind)
_KIND_VALUES = pa.array([str(kind) for kind in _KINDS], pa.string())


def _kinds_of(codes: list[int]) -> list[Kind]:
    return [_KINDS[code] for code in codes]


class RecordColumns:
    """Rows of a pyarrow table made records on demand: ``records(rows)`` is ``from_row`` of those rows (kinds as
    ``Kind``, list values as tuples, ``()`` for null ones), not a dict per row: numbers, flags, times and kinds
    from arrays made when the columns come in (``_split``), a column null in every row as one value, strings and
    lists from one ``take`` of their columns (a ``take`` and a conversion of all 27 columns a call made the
    records of a user just read back cost a third more: ``records`` of 111 rows 0.33 -> 0.25 ms, of 33 rows
    0.18 -> 0.11 ms, for ~0.06 ms more at the read). The store's
    cache makes a record of each loaded row the first time a read returns it, so a user's load keeps the rows in
    Arrow's compact form: converting every column to Python at the load cost ~6 ms of a 1,500-row user's 18 and
    ~1 KB a row of Python objects, most of which no read ever returned.

    Records hold tuples rather than lists, which also keeps the cyclic collector's walks short: tuples of strings
    drop out of them after its first pass, lists never do.
    """

    __slots__ = ("_array_bytes", "_arrays", "_defaults", "_rest", "_same", "_table")

    def __init__(self, table: pa.Table, *, compact: bool = False) -> None:
        # A copy in buffers of its own when the rows LanceDB returned are slices of its reads' larger buffers,
        # which a kept slice keeps whole (measured: twice the bytes the slices count); one chunk a column, for
        # ``take`` (over the ten chunks of a 10,000-row user's rows it took twice as long). From a compacted table
        # a small user's rows come in one chunk of their own, and the copy (~1.5 ms of 1,000 rows) is skipped.
        # (``compact``: the caller knows the table is in one chunk, in buffers of its own, as a spill file's is:
        # the check costs ~0.1 ms, ``nbytes`` measuring every string and list column's slices)
        kept = table.select([n for n in table.column_names if n in _FIELD_SET])
        if compact:
            self._table = kept
        elif kept.num_rows and kept.get_total_buffer_size() > _SLACK * kept.nbytes:
            self._table = kept.take(pa.array(range(kept.num_rows), pa.int64()))
        else:
            self._table = kept.combine_chunks() if any(c.num_chunks > 1 for c in kept.columns) else kept
        self._defaults = _defaults(tuple(kept.column_names))
        self._arrays, self._same, self._rest, self._array_bytes = _split(self._table)

    @property
    def nbytes(self) -> int:
        """The bytes of the Arrow buffers the rows are kept in (and of the arrays made from them)."""
        return int(self._table.get_total_buffer_size()) + self._array_bytes

    def record(self, i: int) -> MemoryRecord:
        """Row ``i`` as a record."""
        return self.records([i])[0]

    def records(self, rows: Sequence[int]) -> list[MemoryRecord]:
        """These rows as records, in order."""
        if not rows:
            return []
        count = len(rows)
        at = np.fromiter(rows, dtype=np.int64, count=count)
        # numbers, flags, times and kinds from arrays made once (no Arrow call a column); strings and lists
        # from one ``take`` of the columns left; a column null in every row is its value once
        columns: dict[str, list[Any]] = {name: convert(array[at].tolist()) for name, array, convert in self._arrays}
        if self._rest is not None:
            taken = self._rest.take(pa.array(at))
            for name, column in zip(taken.column_names, taken.columns, strict=True):
                if column.null_count == count:  # (a kind's unused fields: a third of the columns of a turn)
                    values: list[Any] = [None] * count
                else:
                    values = _datetimes(column) if column.type == _US_UTC else column.to_pylist()
                convert = _CONVERSIONS.get(name)
                columns[name] = values if convert is None else [convert(value) for value in values]
        if self._defaults is None:
            columns.update({name: [value] * count for name, value in self._same})
            return [MemoryRecord(**{name: values[i] for name, values in columns.items()}) for i in range(count)]
        # Field by field, each over every record in C (``map`` of the slot's setter): a Python loop over rows
        # and fields (28 ``object.__setattr__`` calls a record) took half the time of a newly loaded user's read.
        made = [_NEW(MemoryRecord) for _ in rows]
        for name, values in columns.items():
            _drain(map(_SLOTS[name].__set__, made, values))
        for name, value in itertools.chain(self._same, self._defaults):
            _drain(map(_SLOTS[name].__set__, made, itertools.repeat(value, count)))
        return made

    @property
    def table(self) -> pa.Table:
        """The rows, as kept (the record fields' columns)."""
        return self._table


def from_row(row: Mapping[str, Any]) -> MemoryRecord:
    """A record from one row of a LanceDB/pyarrow result (``to_pylist`` form)."""
    values = {name: row[name] for name in _FIELD_NAMES if name in row}
    for name, convert in _CONVERSIONS.items():
        if name in values:
            values[name] = convert(values[name])
    return MemoryRecord(**values)


def foreign_ids(submission: Submission[MemoryRecord], owners: dict[str, str]) -> StoreError | None:
    """The error for a submitted record whose id another user's record has already (``owners``: id -> user)."""
    for record in submission.items:
        owner = owners.get(record.id)
        if owner is not None and owner != record.user_id:
            return StoreError(f"record id {record.id} is already used by another user")
    return None
