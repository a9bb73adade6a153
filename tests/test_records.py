"""Records: ``replace`` and ``RecordColumns`` give what ``dataclasses.replace`` and ``from_row`` give."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.memory.store.records import Kind, MemoryRecord, RecordColumns, from_row, to_arrow

T0 = datetime(2025, 1, 1, tzinfo=UTC)

records = st.builds(
    MemoryRecord,
    user_id=st.sampled_from(["u", "v"]),
    kind=st.sampled_from(list(Kind)),
    text=st.text(max_size=30),
    created_at=st.integers(0, 10_000).map(lambda h: T0 + timedelta(hours=h)),
    last_accessed_at=st.none() | st.integers(0, 10_000).map(lambda h: T0 + timedelta(hours=h)),
    conversation_id=st.none() | st.sampled_from(["c1", "c2"]),
    entities=st.lists(st.sampled_from(["Ann", "Bo", "Cy"]), max_size=3).map(tuple),
    source_ids=st.lists(st.sampled_from(["a", "b"]), max_size=2).map(tuple),
    importance=st.integers(1, 10),
    valid=st.booleans(),
    confidence=st.none() | st.floats(0, 1),
    flagged=st.none() | st.just("instruction"),
)


@settings(max_examples=60, deadline=None)
@given(record=records, seen=st.integers(0, 10_000), valid=st.booleans())
def test_replace_is_dataclasses_replace(record: MemoryRecord, seen: int, valid: bool) -> None:
    at = T0 + timedelta(hours=seen)
    assert record.replace(last_accessed_at=at) == dataclasses.replace(record, last_accessed_at=at)
    assert record.replace(valid=valid, importance=3) == dataclasses.replace(record, valid=valid, importance=3)
    assert record.replace() == record
    changed = record.replace(text="x")
    assert changed.text == "x"
    assert dataclasses.replace(changed, text=record.text) == record


def test_replace_refuses_an_unknown_field() -> None:
    record = MemoryRecord("u", Kind.FACT, "likes tea")
    with pytest.raises(TypeError, match="no field 'colour'"):
        record.replace(colour="red")


@settings(max_examples=40, deadline=None)
@given(batch=st.lists(records, min_size=1, max_size=12))
def test_record_columns_give_what_from_row_gives(batch: list[MemoryRecord]) -> None:
    table = to_arrow(batch, 4).drop_columns(["embedding"])  # as the store's cache keeps its rows
    columns = RecordColumns(table)
    rows = table.to_pylist()
    for i, row in enumerate(rows):
        made = columns.record(i)
        assert made == from_row(row)
        assert isinstance(made.kind, Kind)
        assert isinstance(made.entities, tuple)


def test_record_columns_of_a_table_missing_columns_use_the_defaults() -> None:
    batch = [MemoryRecord("u", Kind.TURN, "hi", conversation_id="c", entities=("Ann",))]
    table = to_arrow(batch, 4)
    rows = table.to_pylist()
    for dropped in (["embedding", "flagged", "meta"], ["embedding", "id"]):  # ``id`` has a factory: the constructor
        thin = table.drop_columns(dropped)
        made = RecordColumns(thin).record(0)
        expected = from_row({k: v for k, v in rows[0].items() if k not in dropped})
        assert made.flagged is None
        assert made.embedding is None
        assert made.text == "hi"
        if "id" in dropped:
            assert made.id != batch[0].id  # a new one, as from_row would make
        else:
            assert made == expected
