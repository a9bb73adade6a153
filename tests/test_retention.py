"""Expiry and retention on a real store: the sweep deletes what is due, keeps the rest, and announces expiries."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import lancedb
import pyarrow as pa
import pytest

from proxy.memory.events import Event
from proxy.memory.read.retrieval_settings import RetrievalSettings
from proxy.memory.read.selection import plan_items
from proxy.memory.retention import RetentionSweeper
from proxy.memory.store.memory_store import MemoryStore, StoreSettings
from proxy.memory.store.records import Kind, MemoryRecord, arrow_schema, to_arrow
from proxy.memory.store.table import MemoryTable
from tests.support.embedder import HashingEmbedder

NOW = datetime(2025, 6, 1, 12, tzinfo=UTC)


class Heard:
    """A fake event sink that keeps what it was told."""

    def __init__(self) -> None:
        self.events: list[tuple[Event, str, list[MemoryRecord], dict[str, Any]]] = []

    async def emit(self, event: Event, user_id: str, records: Sequence[MemoryRecord] = (), **extra: Any) -> None:
        self.events.append((event, user_id, list(records), extra))


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[MemoryStore]:
    """An open store with the deterministic test embedder."""
    async with MemoryStore(StoreSettings(path=tmp_path / "data"), HashingEmbedder()) as opened:
        yield opened


def _record(user: str, text: str, kind: Kind = Kind.FACT, days_ago: float = 0, **extra: Any) -> MemoryRecord:
    return MemoryRecord(user_id=user, kind=kind, text=text, created_at=NOW - timedelta(days=days_ago), **extra)


async def test_sweep_deletes_expired_memories_and_old_turns_only(store: MemoryStore) -> None:
    """Expired memories and turns past the retention go; summaries, facts and recent turns stay."""
    expired = _record("ann", "Parking in bay 7 this week", expires_at=NOW - timedelta(minutes=1))
    later = _record("ann", "Conference badge pickup at gate B", expires_at=NOW + timedelta(days=1))
    old_turn = _record("ann", "what did I cook last winter", Kind.TURN, days_ago=40)
    new_turn = _record("ann", "what should I cook today", Kind.TURN, days_ago=2)
    old_summary = _record("ann", "Talked about cooking", Kind.SUMMARY, days_ago=40)
    old_fact = _record("bob", "Bob likes ramen", days_ago=400)
    await store.add([expired, later, old_turn, new_turn, old_summary, old_fact])
    heard = Heard()
    counts = await RetentionSweeper(store, heard, turn_retention_days=30, clock=lambda: NOW).sweep()
    assert counts == {"expired": 1, "turns": 1}
    kept = {r.id for r in (await store.list("ann", None, limit=50)).data} | {
        r.id for r in (await store.list("bob", None, limit=50)).data
    }
    assert kept == {later.id, new_turn.id, old_summary.id, old_fact.id}
    [(event, user, records, extra)] = heard.events
    assert (event, user, [r.id for r in records], extra) == (
        "memory.deleted",
        "ann",
        [expired.id],
        {"reason": "expired"},
    )
    assert records[0].text == expired.text
    assert await RetentionSweeper(store, heard, 30, clock=lambda: NOW).sweep() == {"expired": 0, "turns": 0}


async def test_turns_are_kept_for_good_by_default(store: MemoryStore) -> None:
    """With ``turn_retention_days`` 0 no turn is ever deleted, however old."""
    ancient = _record("ann", "hello from long ago", Kind.TURN, days_ago=3000)
    await store.add([ancient])
    assert await RetentionSweeper(store, Heard(), clock=lambda: NOW).sweep() == {"expired": 0, "turns": 0}
    assert await store.get("ann", ancient.id) is not None


def test_expired_records_are_never_planned_for_injection() -> None:
    """The read path's choice leaves out a memory past its ``expires_at`` (and keeps one before it)."""
    past = _record("ann", "old plan", expires_at=NOW - timedelta(seconds=1))
    future = _record("ann", "current plan", expires_at=NOW + timedelta(seconds=1))
    items = plan_items([], [], [past, future], NOW, RetrievalSettings())
    assert [item.text for item in items] == ["current plan"]


async def test_a_store_written_before_expiry_opens_and_reads_no_expiry(tmp_path: Path) -> None:
    """A schema-1 table (no ``expires_at`` column) gets the column on open; its rows never expire."""
    old_schema = pa.schema([f for f in arrow_schema(4) if f.name != "expires_at"])
    record = MemoryRecord(user_id="u", kind=Kind.FACT, text="old fact", embedding=[1.0, 0.0, 0.0, 0.0])
    db = await lancedb.connect_async(tmp_path / "lance")
    await db.create_table("memories_1", data=to_arrow([record], 4).drop_columns(["expires_at"]).cast(old_schema))
    db.close()
    (tmp_path / "lance" / "manifest.json").write_text(
        '{"table": "memories_1", "model_id": "m", "dim": 4, "schema_version": 1}'
    )
    table = MemoryTable(tmp_path / "lance", "m", 4)
    await table.open()
    try:
        [old] = await table.records("u", [record.id])
        assert old.expires_at is None
        assert table.manifest is not None
        assert table.manifest.schema_version == 2
    finally:
        table.close()
