"""`memproxy export` / `memproxy import`: exact round trips, mem0 and ChatGPT imports, idempotence, clear errors."""

from __future__ import annotations

import asyncio
import json
import subprocess
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import orjson
import pytest
import pytest_asyncio
from hypothesis import given
from hypothesis import strategies as st

from proxy.memory.embedders.base import BaseEmbedder
from proxy.memory.store.memory_store import MemoryStore, StoreSettings
from proxy.memory.store.records import Kind, MemoryRecord
from proxy.transfer import (
    ImportFormatError,
    check_vectors,
    export_line,
    export_lines,
    import_records,
    parse_chatgpt,
    parse_mem0,
    parse_memproxy,
)
from tests.support.processes import MEMPROXY, child_env

in_module_loop = pytest.mark.asyncio(loop_scope="module")  # the shipped model lives in the module loop

T0 = datetime(2025, 3, 1, 9, 30, tzinfo=UTC)

MEM0_EXPORT = {
    "results": [
        {
            "id": "0b8a3f52-4c1e-4f3a-9d0e-6a2f1c9b7e11",
            "memory": "Is vegetarian",
            "hash": "8f14e45f",
            "metadata": None,
            "categories": ["food"],
            "created_at": "2024-07-20T01:30:00.123456-07:00",
            "updated_at": None,
            "user_id": "alice",
        },
        {
            "id": "7c2d9e10-1f6b-4a8e-b3c4-2e5d8f9a0b12",
            "memory": "Works as a nurse in Porto",
            "hash": "c9f0f895",
            "metadata": {"source": "chat"},
            "created_at": "2024-07-21T10:00:00Z",
            "user_id": "alice",
        },
    ]
}


@pytest_asyncio.fixture(loop_scope="module")
async def store_a(tmp_path: Path, local: BaseEmbedder) -> AsyncIterator[MemoryStore]:
    """A store with facts, a turn and a superseded fact of two users, on the shipped model."""
    async with MemoryStore(StoreSettings(path=tmp_path / "a"), local) as store:
        new = MemoryRecord(
            user_id="ann",
            kind=Kind.FACT,
            text="Ann lives in Lisbon now",
            created_at=T0,
            entities=("Lisbon",),
            importance=8,
            category="home",
        )
        old = MemoryRecord(
            user_id="ann",
            kind=Kind.FACT,
            text="Ann lives in Porto",
            valid=False,
            superseded_by=new.id,
            created_at=T0 - timedelta(days=30),
        )
        turn = MemoryRecord(
            user_id="ann",
            kind=Kind.TURN,
            text="I moved last week",
            role="user",
            conversation_id="c1",
            created_at=T0 + timedelta(minutes=1),
        )
        other = MemoryRecord(
            user_id="bob", kind=Kind.FACT, text="Bob plays the cello", created_at=T0, meta='{"source": "manual"}'
        )
        await store.add([new, old, turn, other])
        yield store


async def _lines(store: MemoryStore, user: str | None = None) -> list[bytes]:
    return sorted([line async for line in export_lines(store, user)])


@in_module_loop
async def test_export_then_import_into_an_empty_store_gives_the_same_records(
    store_a: MemoryStore, tmp_path: Path, local: BaseEmbedder
) -> None:
    """Every field, ids, texts and float32 vectors included, comes back identical, and nothing is re-embedded."""
    exported = await _lines(store_a)
    assert len(exported) == 4
    async with MemoryStore(StoreSettings(path=tmp_path / "b"), local) as store_b:
        counts = await import_records(store_b, parse_memproxy(exported), local.model_id, local.dim)
        assert (counts.added, counts.reembedded) == (4, 0)
        assert await _lines(store_b) == exported
        hits = await store_b.keyword_search("ann", "Lisbon", 5)
        assert [hit.record.text for hit in hits] == ["Ann lives in Lisbon now"]
        again = await import_records(store_b, parse_memproxy(exported), local.model_id, local.dim)
        assert (again.added, again.existing) == (0, 4)
        assert await store_b.count() == 4


@in_module_loop
async def test_one_user_exports_alone(store_a: MemoryStore) -> None:
    """`--user` exports that user's records only."""
    lines = await _lines(store_a, "bob")
    assert [orjson.loads(line)["text"] for line in lines] == ["Bob plays the cello"]


@in_module_loop
async def test_vectors_of_another_model_are_embedded_again(tmp_path: Path, local: BaseEmbedder) -> None:
    """A record embedded by another model gets this model's vector for its text on import."""
    line = orjson.dumps(
        {
            "user_id": "cy",
            "kind": "fact",
            "text": "Cy collects stamps",
            "id": "r1",
            "created_at": T0.isoformat(),
            "model_id": "other/model",
            "embedding": [0.5] * 8,
        }
    )
    async with MemoryStore(StoreSettings(path=tmp_path / "c"), local) as store:
        counts = await import_records(store, parse_memproxy([line]), local.model_id, local.dim)
        assert counts.reembedded == 1
        [record] = await store.get_many("cy", ["r1"])
        expected = await local.embed_documents(["Cy collects stamps"])
        assert record.model_id == local.model_id
        assert np.allclose(np.asarray(record.embedding), expected[0], atol=1e-5)


@in_module_loop
async def test_mem0_export_imports_with_its_ids(tmp_path: Path, local: BaseEmbedder) -> None:
    """mem0's get_all output becomes facts of its user, keeping mem0's ids, categories and dates."""
    records = parse_mem0(json.dumps(MEM0_EXPORT).encode())
    async with MemoryStore(StoreSettings(path=tmp_path / "m"), local) as store:
        await import_records(store, records, local.model_id, local.dim)
        [veg] = await store.get_many("alice", ["0b8a3f52-4c1e-4f3a-9d0e-6a2f1c9b7e11"])
        assert (veg.kind, veg.text, veg.category) == (Kind.FACT, "Is vegetarian", "food")
        assert veg.created_at == datetime(2024, 7, 20, 8, 30, 0, 123456, tzinfo=UTC)
        hits = await store.keyword_search("alice", "nurse", 5)
        assert [hit.record.text for hit in hits] == ["Works as a nurse in Porto"]
    assert parse_mem0(json.dumps(MEM0_EXPORT["results"]).encode(), "zoe")[0].user_id == "zoe"


@in_module_loop
async def test_chatgpt_memories_import_as_facts_once(tmp_path: Path, local: BaseEmbedder) -> None:
    """Saved ChatGPT memories (bullets and numbers dropped, blank lines skipped) import once, however often run."""
    lines = ["- Prefers metric units", "", "2. Has a daughter named Ines", "  * Is learning Japanese  "]
    async with MemoryStore(StoreSettings(path=tmp_path / "g"), local) as store:
        first = await import_records(store, parse_chatgpt(lines, "dan"), local.model_id, local.dim)
        second = await import_records(store, parse_chatgpt(lines, "dan"), local.model_id, local.dim)
        assert (first.added, second.added, second.existing) == (3, 0, 3)
        texts = sorted(r.text for r in (await store.list("dan")).data)
        assert texts == ["Has a daughter named Ines", "Is learning Japanese", "Prefers metric units"]


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        (b"{not json", "not JSON"),
        (b'{"user_id": "u", "kind": "fact"}', "text"),
        (b'{"user_id": "u", "kind": "rumour", "text": "x"}', "kind"),
        (b'{"user_id": "u", "kind": "fact", "text": "x", "colour": 1}', "unknown field 'colour'"),
        (b'{"user_id": "", "kind": "fact", "text": "x"}', "user_id"),
        (b'{"user_id": "x\'; DROP TABLE--", "kind": "fact", "text": "x"}', "user_id: must be 1-128 characters"),
        (b'{"user_id": "u", "kind": "fact", "text": "x", "embedding": [0.5, 1e308]}', "embedding: .*not a finite"),
        (b'{"user_id": "u", "kind": "fact", "text": "x", "embedding": [NaN]}', "not JSON"),
    ],
)
def test_bad_line_is_named(line: bytes, problem: str) -> None:
    """A bad line is reported with its number and what is wrong with it."""
    good = b'{"user_id": "u", "kind": "fact", "text": "fine"}'
    with pytest.raises(ImportFormatError, match=rf"line 3: .*{problem}"):
        list(parse_memproxy([good, b"", line]))


def test_an_id_shared_by_two_users_names_both_lines() -> None:
    """One id given to two users in one file is an error naming both lines (not a record silently dropped)."""
    lines = [b'{"user_id": "ann", "kind": "fact", "text": "a", "id": "same"}', b"",
             b'{"user_id": "bob", "kind": "fact", "text": "b", "id": "same"}']  # fmt: skip
    with pytest.raises(ImportFormatError, match=r"line 3: id 'same' is also the id of user 'ann'.* line 1"):
        list(parse_memproxy(lines))


def test_imported_text_is_capped_like_a_chat_turn() -> None:
    """A 20 MB memory is stored as head and tail around a marker, at most ``memory.max_turn_chars``."""
    line = orjson.dumps({"user_id": "u", "kind": "fact", "text": "start " + "x" * 20_000_000 + " end"})
    (record,) = parse_memproxy([line], max_chars=2000)
    assert len(record.text) == 2000
    assert record.text.startswith("start x")
    assert record.text.endswith("x end")
    assert "characters not stored" in record.text


def test_a_vector_of_the_wrong_dimension_is_refused() -> None:
    """A vector said to be the store's model's but of another size is an error naming the record."""
    line = orjson.dumps({"user_id": "u", "kind": "fact", "text": "t", "id": "r1", "model_id": "m", "embedding": [0.1]})
    with pytest.raises(ImportFormatError, match=r"record 1 \(id 'r1'\): embedding: 1 values, but m makes 384"):
        check_vectors(parse_memproxy([line]), "m", 384)
    other = orjson.dumps({"user_id": "u", "kind": "fact", "text": "t", "model_id": "old", "embedding": [0.1]})
    assert check_vectors(parse_memproxy([other]), "m", 384) == 1  # another model's vector: embedded again


APP_IDS = st.from_regex(r"[A-Za-z0-9._@:+\-=/|~]{1,20}", fullmatch=True)
RECORDS = st.builds(
    MemoryRecord,
    user_id=APP_IDS,
    kind=st.sampled_from(list(Kind)),
    text=st.text(min_size=1, max_size=200).filter(str.strip),
    id=APP_IDS,
    created_at=st.datetimes(timezones=st.just(UTC)),
    embedding=st.none() | st.lists(st.floats(width=32, allow_nan=False, allow_infinity=False), min_size=1, max_size=8),
    model_id=st.sampled_from(["", "local/minilm"]),
    importance=st.integers(1, 10),
    entities=st.lists(st.text(max_size=20), max_size=3).map(tuple),
    flagged=st.none() | st.just("instruction_like:ignore_instructions"),
)


@given(st.lists(RECORDS, max_size=5, unique_by=lambda r: r.id))
def test_the_stores_own_export_always_imports(records: list[MemoryRecord]) -> None:
    """Whatever the store holds (within the API's rules), its export parses back to the same records."""
    lines = [export_line(record) for record in records]
    parsed = list(parse_memproxy(lines))
    assert [r.replace(embedding=None) for r in parsed] == [r.replace(embedding=None) for r in records]
    for back, record in zip(parsed, records, strict=True):
        if record.embedding is None:
            assert back.embedding is None
        else:
            assert np.array_equal(np.asarray(back.embedding), np.asarray(record.embedding, dtype=np.float32))


def test_mem0_item_without_user_needs_one() -> None:
    """A mem0 item with no user_id and no --user is an error naming the item."""
    with pytest.raises(ImportFormatError, match=r"item 0: user_id"):
        parse_mem0(b'[{"id": "x", "memory": "Likes jazz"}]')


def _memproxy(*args: str, data: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(MEMPROXY), *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env=child_env(MEMPROXY_STORAGE__PATH=str(data)),
    )


def test_cli_refuses_a_bad_file_whole_then_imports_and_exports(tmp_path: Path) -> None:
    """A file with a bad line 3 exits 2 naming it and imports nothing; fixed, it imports and exports back."""
    good = [{"user_id": "eve", "kind": "fact", "text": f"Eve fact {i}", "id": f"e{i}"} for i in range(3)]
    source = tmp_path / "in.jsonl"
    early = [{**row, "id": f"x{i}"} for i, row in enumerate(good[:2])]  # valid lines before the bad one
    source.write_text("\n".join([json.dumps(early[0]), json.dumps(early[1]), '{"user_id": "eve"', ""]))
    refused = _memproxy("import", str(source), data=tmp_path / "data")
    assert refused.returncode == 2
    assert "line 3" in refused.stderr
    assert "nothing was imported" in refused.stderr
    source.write_text("\n".join(json.dumps(row) for row in good) + "\n")
    imported = _memproxy("import", str(source), data=tmp_path / "data")
    assert imported.returncode == 0, imported.stderr
    assert "added 3" in imported.stdout
    out = tmp_path / "out.jsonl"
    exported = _memproxy("export", "--user", "eve", "-o", str(out), data=tmp_path / "data")
    assert exported.returncode == 0, exported.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(row["id"] for row in rows) == ["e0", "e1", "e2"]  # nothing of the refused file
    assert all(len(row["embedding"]) == 384 for row in rows)


@in_module_loop
async def test_cli_import_refuses_a_store_in_use(tmp_path: Path, local: BaseEmbedder) -> None:
    """While a server owns the data directory, import exits 1 saying to stop it, and writes nothing."""
    source = tmp_path / "in.txt"
    source.write_text("- Finn rows on Sundays\n")
    async with MemoryStore(StoreSettings(path=tmp_path / "busy"), local) as store:
        proc = await asyncio.create_subprocess_exec(
            str(MEMPROXY),
            "import",
            str(source),
            "--format",
            "chatgpt",
            "--user",
            "finn",
            env=child_env(MEMPROXY_STORAGE__PATH=str(tmp_path / "busy")),
            stderr=asyncio.subprocess.PIPE,
        )
        _, err = await proc.communicate()
        assert proc.returncode == 1
        assert "in use" in err.decode()
        assert "stop the server first" in err.decode()
        assert await store.count() == 0
