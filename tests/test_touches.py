"""Touch buffering: access times noted at once, written to LanceDB at most once per granularity, in chunks."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from proxy.memory.store.records import Kind, MemoryRecord
from proxy.memory.store.touches import SHOWN_STEP, TouchBuffer, touch_chunks

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def test_a_record_written_within_the_granularity_is_not_noted_again() -> None:
    """After its access time reached LanceDB, a record waits out the granularity before it is written again."""
    touches = TouchBuffer(timedelta(hours=1))
    touches.note("u", ["a", "b"], T0)
    touches.wrote(touches.take(), T0)
    touches.note("u", ["a"], T0 + timedelta(minutes=59))
    assert not touches
    touches.note("u", ["a", "c"], T0 + timedelta(minutes=61))
    assert touches.take() == {"u": {"a": T0 + timedelta(minutes=61), "c": T0 + timedelta(minutes=61)}}


def test_a_pending_access_time_moves_only_by_whole_steps() -> None:
    """A record used again within ``SHOWN_STEP`` keeps its pending time (nothing for the cache to copy); a
    step later, it moves; an earlier time never wins over a later one."""
    touches = TouchBuffer(timedelta(hours=1))
    assert touches.note("u", ["a", "b"], T0) == ["a", "b"]
    assert touches.note("u", ["a"], T0 + SHOWN_STEP / 2) == []
    assert touches.note("u", ["a", "c"], T0 + SHOWN_STEP) == ["a", "c"]
    assert touches.note("u", ["a"], T0 - SHOWN_STEP) == []
    assert touches.take() == {"u": {"a": T0 + SHOWN_STEP, "b": T0, "c": T0 + SHOWN_STEP}}


def test_without_granularity_every_access_is_written() -> None:
    """Granularity 0 keeps the old behaviour: every noted access is pending for the next write."""
    touches = TouchBuffer()
    touches.note("u", ["a"], T0)
    touches.wrote(touches.take(), T0)
    touches.note("u", ["a"], T0 + timedelta(seconds=1))
    assert touches.take() == {"u": {"a": T0 + timedelta(seconds=1)}}


def test_forgetting_a_user_forgets_what_was_written() -> None:
    """A forgotten user's records, if they come back under the same ids, are written at their first access."""
    touches = TouchBuffer(timedelta(hours=1))
    touches.note("u", ["a"], T0)
    touches.wrote(touches.take(), T0)
    touches.drop_user("u")
    touches.note("u", ["a"], T0 + timedelta(minutes=1))
    assert touches.take() == {"u": {"a": T0 + timedelta(minutes=1)}}


def test_chunks_hold_every_note_once_and_at_most_size_each() -> None:
    """The pending notes split into parts of at most ``size`` records, none lost or repeated."""
    pending = {f"u{u}": {f"r{u}-{i}": T0 + timedelta(seconds=i) for i in range(u * 7)} for u in range(1, 6)}
    chunks = touch_chunks(pending, 10)
    assert all(sum(len(ids) for ids in chunk.values()) <= 10 for chunk in chunks)
    merged: dict[str, dict[str, datetime]] = {}
    for chunk in chunks:
        for user_id, ids in chunk.items():
            assert not set(ids) & set(merged.get(user_id, {}))
            merged.setdefault(user_id, {}).update(ids)
    assert merged == pending


def test_an_access_within_the_granularity_of_creation_is_shown_not_written() -> None:
    """A young record's access time (created within the granularity before it) is shown to reads but never
    taken for writing: it says what the creation time says. It is kept for the granularity, then dropped."""
    touches = TouchBuffer(timedelta(hours=1))
    assert touches.note("u", ["young", "old"], T0, young={"young"}) == ["young", "old"]
    assert touches.note("u", ["young"], T0 + SHOWN_STEP / 2, young={"young"}) == []  # the same step as pending
    assert touches.take() == {"u": {"old": T0}}
    record = MemoryRecord(user_id="u", kind=Kind.TURN, text="t", created_at=T0, id="young")
    assert touches.touched(record).last_accessed_at == T0
    touches.note("u", ["other"], T0 + timedelta(minutes=61))
    touches.take()
    assert touches.touched(record).last_accessed_at is None
