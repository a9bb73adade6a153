"""Property: nothing done for user A ever reads or changes user B, whatever the ids look like."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.memory.store.filters import record_filter, sql_string
from proxy.memory.store.ids import MAX_ID_BYTES, check_user_id
from proxy.memory.store.memory_store import MemoryStore, StoreSettings
from proxy.memory.store.records import Kind, MemoryRecord
from tests.support.embedder import HashingEmbedder

NASTY = [
    "' OR '1'='1",
    "' OR 1=1 --",
    "a'b",
    "a''b",
    "'",
    "''",
    "\\",
    "\\'",
    "a\\' OR user_id != '",
    "x' OR user_id LIKE '%",
    '"',
    'a" OR "1"="1',
    "%",
    "_",
    "*",
    "user_id",
    "alice); DROP TABLE memories_1; --",
    "ALICE",
    "alice",
    "alice ",
    " alice",
    "a\u200bb",
    "e\u0301",
    "\u00e9",
    "中文用户",
    "사용자:관리자",
    "🙂 OR 🙃",
    "(user_id:*)",
    "x" * MAX_ID_BYTES,
    "é" * (MAX_ID_BYTES // 2),
]
VALID_TEXT = st.text(st.characters(exclude_categories=("Cc", "Cs")), min_size=1, max_size=40)
USER_IDS = st.one_of(st.sampled_from(NASTY), VALID_TEXT)
_serial = itertools.count()


class Model:
    """What each user should have: record id -> text."""

    def __init__(self) -> None:
        self.users: dict[str, dict[str, str]] = {}

    def add(self, records: list[MemoryRecord]) -> None:
        for record in records:
            self.users.setdefault(record.user_id, {})[record.id] = record.text


@pytest.fixture
async def world(tmp_path: Path) -> AsyncIterator[tuple[MemoryStore, Model]]:
    """One store shared by every example of a test, and the model of what it should hold."""
    async with MemoryStore(StoreSettings(path=tmp_path / "data"), HashingEmbedder()) as store:
        yield store, Model()


async def seed(store: MemoryStore, model: Model, user: str) -> list[MemoryRecord]:
    n = next(_serial)
    records = [
        MemoryRecord(user_id=user, kind=Kind.FACT, text=f"shared words token{n}x{i}", id=f"rec-{n}-{i}")
        for i in range(2)
    ]
    await store.add(records)
    model.add(records)
    return records


async def assert_user_intact(store: MemoryStore, model: Model, user: str) -> None:
    """The user's records are exactly the model's, through list, count, export and both arms."""
    expected = model.users.get(user, {})
    listed = await store.list(user, limit=10_000)
    assert {r.id: r.text for r in listed.data} == expected
    assert await store.count(user) == len(expected)
    exported = [line async for line in store.export(user)]
    assert len(exported) == len(expected)
    if expected:
        keyword = await store.keyword_search(user, "shared words", 10_000)
        assert {h.record.id for h in keyword} == set(expected)
        vector = await store.vector_search(user, await store.embedder.embed_query("shared words"), 10_000)
        assert {h.record.id for h in vector} == set(expected)


SHARED_STORE = [HealthCheck.function_scoped_fixture]  # on purpose: the examples share one store


@settings(max_examples=20, deadline=None, suppress_health_check=SHARED_STORE)
@given(a=USER_IDS, b=USER_IDS)
async def test_reads_for_one_user_never_return_another_s(world: tuple[MemoryStore, Model], a: str, b: str) -> None:
    """Search, list, get and export for A return only A's records, for any pair of distinct ids."""
    if a == b:
        return
    store, model = world
    await seed(store, model, a)
    theirs = await seed(store, model, b)
    for hits in (
        await store.keyword_search(a, f"shared words {theirs[0].text} {b}", 100),
        await store.vector_search(a, await store.embedder.embed_query(theirs[0].text), 100),
    ):
        assert {h.record.user_id for h in hits} == {a}
    assert await store.get(a, theirs[0].id) is None
    assert await store.get_many(a, [r.id for r in theirs]) == []
    await assert_user_intact(store, model, a)
    await assert_user_intact(store, model, b)


@settings(max_examples=12, deadline=None, suppress_health_check=SHARED_STORE)
@given(a=USER_IDS, b=USER_IDS, forget=st.booleans())
async def test_writes_for_one_user_never_touch_another_s(
    world: tuple[MemoryStore, Model], a: str, b: str, forget: bool
) -> None:
    """Delete, update, touch and forget for A leave B's records exactly as they were."""
    if a == b:
        return
    store, model = world
    ours = await seed(store, model, a)
    theirs = await seed(store, model, b)
    assert await store.delete(a, theirs[0].id) is False
    assert await store.update(a, theirs[1].id, text="overwritten", valid=False) is None
    await store.touch(a, [r.id for r in theirs])
    assert await store.delete(a, ours[0].id) is True
    del model.users[a][ours[0].id]
    if forget:
        counts = await store.forget_user(a)
        assert counts["fact"] == len(model.users[a])
        model.users[a] = {}
    await assert_user_intact(store, model, a)
    await assert_user_intact(store, model, b)
    assert all(r.last_accessed_at is None for r in await store.get_many(b, [r.id for r in theirs]))


@given(value=st.text(max_size=200))
def test_sql_string_round_trips_any_text(value: str) -> None:
    """The quoted literal is the text with quotes doubled, wrapped in quotes: nothing can escape it."""
    literal = sql_string(value)
    assert literal.startswith("'")
    assert literal.endswith("'")
    inner = literal[1:-1]
    assert inner.replace("''", "").count("'") == 0
    assert inner.replace("''", "'") == value


@given(user=VALID_TEXT)
def test_every_filter_is_anchored_on_the_user(user: str) -> None:
    """Each filter starts with the user's own equality clause, ANDed with the rest."""
    where = record_filter(check_user_id(user), ids=["x' OR '1'='1"], kinds=[Kind.FACT], include_invalid=False)
    assert where.startswith(f"(user_id = {sql_string(user)}) AND ")
