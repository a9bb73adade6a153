"""The memory store on real LanceDB and Tantivy: writes, reads, both arms, history, model guard, repair."""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from proxy.memory.errors import EmbedderMismatch, InvalidCursor, InvalidUserId, StoreError
from proxy.memory.store import compaction
from proxy.memory.store import memory_store as memory_store_module
from proxy.memory.store import writes as writes_module
from proxy.memory.store.keyword import KeywordIndex
from proxy.memory.store.keyword_schema import KeywordDoc
from proxy.memory.store.memory_store import MemoryStore, StoreSettings
from proxy.memory.store.records import Kind, MemoryRecord
from tests.support.embedder import HashingEmbedder
from tests.support.polling import eventually

T0 = datetime(2025, 3, 1, tzinfo=UTC)


def fact(user: str, text: str, hours: int = 0, kind: Kind = Kind.FACT, **extra: object) -> MemoryRecord:
    return MemoryRecord(user_id=user, kind=kind, text=text, created_at=T0 + timedelta(hours=hours), **extra)


def settings_for(path: Path, **overrides: object) -> StoreSettings:
    return StoreSettings(path=path, **overrides)


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[MemoryStore]:
    """An open store with the deterministic test embedder."""
    async with MemoryStore(settings_for(tmp_path / "data"), HashingEmbedder()) as opened:
        yield opened


async def query_vector(store: MemoryStore, text: str) -> np.ndarray:
    return await store.embedder.embed_query(text)


async def vector_ids(store: MemoryStore, user: str, text: str, k: int = 10, **filters: object) -> list[str]:
    hits = await store.vector_search(user, await query_vector(store, text), k, **filters)
    return [hit.record.id for hit in hits]


async def keyword_ids(store: MemoryStore, user: str, text: str, k: int = 10, **filters: object) -> list[str]:
    return [hit.record.id for hit in await store.keyword_search(user, text, k, **filters)]


async def keyword_scores(store: MemoryStore, user: str, text: str) -> dict[str, float]:
    return {hit.record.id: round(hit.score, 4) for hit in await store.keyword_search(user, text, 50)}


async def test_added_memories_are_searchable_in_both_arms_on_return(store: MemoryStore) -> None:
    """Once add returns, the vector arm and the keyword arm both find the memory."""
    [added] = await store.add([fact("alice", "Alice adopted a golden retriever named Max")])
    assert added.model_id == store.embedder.model_id
    assert (await vector_ids(store, "alice", "golden retriever Max"))[0] == added.id
    assert await keyword_ids(store, "alice", "retriever") == [added.id]
    hit = (await store.vector_search("alice", await query_vector(store, "golden retriever"), 1))[0]
    assert hit.record.embedding is None
    assert 0.0 < hit.score <= 1.0 + 1e-6


async def test_add_is_idempotent_by_id(store: MemoryStore) -> None:
    """Adding the same record twice stores it once."""
    record = fact("alice", "Alice likes tea")
    await store.add([record])
    again = await store.add([record, record])
    assert [r.id for r in again] == [record.id, record.id]
    assert await store.count("alice") == 1
    assert await keyword_ids(store, "alice", "tea") == [record.id]


async def test_concurrent_adds_coalesce_into_few_lance_writes(store: MemoryStore) -> None:
    """Fifty concurrent single-record adds become one or two LanceDB commits, not fifty."""
    before = await store._lance.version()
    await asyncio.gather(*(store.add([fact("alice", f"note number {i}")]) for i in range(50)))
    assert await store.count("alice") == 50
    assert await store._lance.version() - before <= 3


async def test_busy_writes_compact_before_the_interval(tmp_path: Path) -> None:
    """After ``optimize_after_commits`` appends the store compacts without waiting for ``optimize_interval_s``:
    fragments do not pile up between two rounds (each one slows every write's id check)."""
    settings = settings_for(tmp_path / "data", optimize_after_commits=5, optimize_interval_s=3600)
    async with MemoryStore(settings, HashingEmbedder()) as store:
        for i in range(5):
            await store.add([fact("alice", f"note number {i}")])

        async def compacted() -> bool:
            return bool((await store._lance.table.stats())["fragment_stats"]["num_fragments"] == 1)

        await eventually(compacted, 5.0)
        assert await store.count("alice") == 5


async def test_a_round_leaves_full_fragments_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Compaction rewrites the small fragments only: a fragment that has reached the target keeps its data file
    in later rounds (LanceDB's own optimize() merged it with every new append, rewriting the whole table each
    round), deletions still get materialized, and every row stays readable and searchable."""
    monkeypatch.setattr(compaction, "TARGET_ROWS", 40)
    settings = settings_for(tmp_path / "data", optimize_interval_s=3600, optimize_after_commits=10_000)
    async with MemoryStore(settings, HashingEmbedder()) as store:
        table = store._lance.table

        async def files() -> set[str]:
            return {f.data_files()[0].path for f in (await table.to_lance()).get_fragments()}

        bulk = await store.add([fact("alice", f"bulk note {i}") for i in range(40)])
        for i in range(8):
            await store.add([fact("alice", f"small note {i}")])
        await store.optimize()
        full = await files()
        for i in range(8):
            await store.add([fact("bob", f"later note {i}")])
        stats = await compaction.maintain(table, None)
        assert (stats.fragments_removed, stats.fragments_added) == (8, 1)  # the new appends, as one fragment
        await store.optimize()
        after = await files()
        big = {path for path in full if path in after}
        assert big, "the fragment that reached the target was rewritten"
        assert len(after) == 3  # the full one and each round's partial one (merged once their index segments are)
        assert await store.count("alice") == 48
        assert await store.count("bob") == 8
        assert await vector_ids(store, "bob", "later note 3", k=1)
        assert len(await keyword_ids(store, "alice", "bulk", k=50)) == 40

        doomed = [record.id for record in bulk[:30]]
        assert len(await store.delete_many("alice", doomed)) == 30
        await store.optimize()
        assert not (await files()) & big  # most of its rows deleted: rewritten without them
        assert await store.count("alice") == 18


async def test_rounds_merge_appends_in_tiers_and_index_them_as_deltas(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A round merges the new appends and leaves the middle tier's fragments alone (their data files survive)
    until those hold a full fragment's rows, then merges them; the new rows go into the scalar indexes as delta
    segments, merged into one at ``MERGE_SEGMENTS_AT``, so neither fragments nor segments pile up. Every row
    stays readable, searchable and deletable by id throughout."""
    monkeypatch.setattr(compaction, "TARGET_ROWS", 40)
    monkeypatch.setattr(compaction, "SMALL_ROWS", 10)
    monkeypatch.setattr(compaction, "MERGE_SEGMENTS_AT", 3)
    settings = settings_for(tmp_path / "data", optimize_interval_s=3600, optimize_after_commits=10_000)
    async with MemoryStore(settings, HashingEmbedder()) as store:
        table = store._lance.table
        added = await store.add([fact("alice", "first note")])
        await store.optimize()  # the scalar indexes, one segment each

        async def fragments() -> dict[str, int]:
            return {f.data_files()[0].path: f.count_rows() for f in (await table.to_lance()).get_fragments()}

        async def segments() -> int:
            return max(len(index.segments) for index in (await table.to_lance()).describe_indices())

        merges = 0
        for batch in range(8):
            before = await fragments()
            middle = {path for path, rows in before.items() if 10 <= rows < 40}
            for i in range(12):
                added += await store.add([fact("alice", f"note {batch} {i}")])
            stats = await compaction.maintain(table, None)
            after = await fragments()
            assert stats.fragments_removed >= 12  # the appends, merged
            assert len(after) <= len(before) + 1
            if sum(before[path] for path in middle) < 40:
                assert not stats.merged
                assert middle <= set(after)  # the middle tier's files untouched
            else:
                assert stats.merged
                merges += 1
            assert await segments() <= 3
        assert merges >= 1
        assert max((await fragments()).values()) >= 40  # a full fragment came out of the middle tier
        assert len(await fragments()) <= 6  # 97 rows: not the 97 appends, nor a fragment a round
        await store.optimize()  # the store's own round, and its scalar indexes
        assert await store.count("alice") == 97
        assert await vector_ids(store, "alice", "note 2 5", k=1)
        assert len(await keyword_ids(store, "alice", "note", k=100)) == 97
        assert len(await store.delete_many("alice", [record.id for record in added[:5]])) == 5
        assert await store.count("alice") == 92
        assert [r.id for r in await store.get_many("alice", [added[7].id])] == [added[7].id]


async def test_old_versions_are_removed_by_their_own_ticker_not_by_the_rounds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Removing old versions reads every manifest kept (15-20 s under load), so a ticker of its own runs it,
    not the maintenance round, which it held up; it leaves only the versions younger than asked, and the data
    reads the same."""
    monkeypatch.setattr(writes_module, "OPTIMIZE_KEEP_VERSIONS", timedelta(milliseconds=1))
    settings = settings_for(tmp_path / "data", optimize_interval_s=3600, optimize_after_commits=10_000)

    def versions() -> int:
        return len(list((tmp_path / "data" / "lance").glob("*.lance/_versions/*.manifest")))

    async with MemoryStore(settings, HashingEmbedder()) as store:  # the ticker's first removal five minutes away
        for i in range(5):
            await store.add([fact("alice", f"note number {i}")])
        await store.optimize()
        assert versions() >= 5  # a round compacts; it removes no version
    monkeypatch.setattr(memory_store_module, "CLEANUP_EVERY_S", 0.1)
    async with MemoryStore(settings, HashingEmbedder()) as store:

        async def one_version() -> bool:
            return versions() == 1

        await eventually(one_version, within_s=10)  # no round asked for: the ticker's own removal
        assert await store.count("alice") == 5
        assert len(await keyword_ids(store, "alice", "note", k=20)) == 5


async def test_a_store_opened_without_its_scalar_indexes_builds_them_at_once(tmp_path: Path) -> None:
    """A table written before any maintenance round (in one go, or imported) gets its Bitmap and BTree indexes
    as soon as the store opens, not an interval later: until then every update and delete by id scans it."""
    settings = settings_for(tmp_path / "data", optimize_interval_s=3600)
    async with MemoryStore(settings, HashingEmbedder()) as store:
        await store.add([fact("alice", f"note number {i}") for i in range(20)])
        assert await store._lance.lacks_scalar_indexes()
    async with MemoryStore(settings, HashingEmbedder()) as store:

        async def indexed() -> bool:
            return not await store._lance.lacks_scalar_indexes()

        await eventually(indexed, 5.0)
        assert {("id",), ("user_id",)} <= (await store._lance._indexed_columns()).keys()
        assert await store.count("alice") == 20


async def test_a_fragmented_keyword_index_is_rewritten_as_one_segment_in_a_quiet_round(tmp_path: Path) -> None:
    """A keyword index that opens in many segments (one per commit) is rewritten as one at once, with the same
    documents and the same answers; while writes keep coming (a commit within ``optimize_interval_s``), a round
    leaves it to Tantivy's own merging, however soon after the previous round it comes."""
    settings = settings_for(tmp_path / "data", optimize_interval_s=3600)
    async with MemoryStore(settings, HashingEmbedder()) as store:
        for i in range(6):
            await store.add([fact("alice", f"note number {i} about hiking"), fact("bob", f"bob note {i} hiking")])
        assert store._keyword.segments() == 6
        await store.add([fact("alice", "one more note")])
        await store.optimize()  # a commit a moment ago: not quiet
        await store.optimize()  # nor in the round right after it (no commit in between, but no quiet either)
        assert store._keyword.segments() == 7
        before = await keyword_scores(store, "alice", "hiking note")
    async with MemoryStore(settings, HashingEmbedder()) as store:

        async def one_segment() -> bool:
            return store._keyword.segments() == 1

        await eventually(one_segment, 5.0)
        assert await store._keyword.count() == 13
        assert await keyword_scores(store, "alice", "hiking note") == before  # BM25's statistics are the index's
        assert await keyword_ids(store, "bob", "hiking", k=20) != []
        assert await keyword_ids(store, "alice", "bob") == []


async def test_a_fragmented_keyword_index_repaired_at_opening_is_still_rewritten_at_once(tmp_path: Path) -> None:
    """The repair an opening makes (Tantivy lost a commit: a kill -9 between the two) commits to the keyword index;
    that commit is the opening's own, not a busy write side, so the fragmented index is still rewritten at once."""
    settings = settings_for(tmp_path / "data", optimize_interval_s=3600)
    async with MemoryStore(settings, HashingEmbedder()) as store:
        for i in range(6):
            await store.add([fact("alice", f"note number {i} about hiking"), fact("bob", f"bob note {i} hiking")])
        lost = (await store.add([fact("alice", "the note Tantivy lost")]))[0]
        await store._keyword.remove_ids([lost.id])
        await store._keyword.commit()
    (tmp_path / "data" / store.writes.data_dir._sync_path.name).unlink()
    async with MemoryStore(settings, HashingEmbedder()) as store:

        async def one_segment() -> bool:
            return store._keyword.segments() == 1

        await eventually(one_segment, 5.0)
        assert await store._keyword.count() == 13
        assert lost.id in await keyword_ids(store, "alice", "Tantivy lost")


async def test_get_and_get_many_are_scoped_to_the_user(store: MemoryStore) -> None:
    """A record is returned to its owner only, and get_many keeps the order asked."""
    a1, a2 = await store.add([fact("alice", "one"), fact("alice", "two")])
    assert (await store.get("alice", a1.id)).text == "one"
    assert await store.get("bob", a1.id) is None
    assert [r.id for r in await store.get_many("alice", [a2.id, "missing", a1.id])] == [a2.id, a1.id]
    assert len((await store.get("alice", a1.id)).embedding) == store.embedder.dim


async def test_list_pages_newest_first_with_an_opaque_cursor(store: MemoryStore) -> None:
    """Paging walks every valid record once, newest first, and ends with no cursor."""
    await store.add([fact("alice", f"memory {i}", hours=i) for i in range(25)])
    await store.add([fact("alice", "same time b", hours=30), fact("alice", "same time a", hours=30)])
    seen: list[MemoryRecord] = []
    cursor = None
    while True:
        page = await store.list("alice", limit=10, cursor=cursor)
        seen.extend(page.data)
        cursor = page.next_cursor
        if cursor is None:
            break
    assert len(seen) == 27
    assert len({r.id for r in seen}) == 27
    keys = [(r.created_at, r.id) for r in seen]
    assert keys == sorted(keys, reverse=True)
    with pytest.raises(InvalidCursor):
        await store.list("alice", cursor="not-a-cursor")


async def test_list_filters_kinds_and_hides_history_by_default(store: MemoryStore) -> None:
    """Kinds narrow a listing, and invalid (superseded) records appear only when asked for."""
    old = fact("alice", "Alice lives in Paris")
    await store.add([old, fact("alice", "hello there", kind=Kind.TURN)])
    await store.supersede("alice", old.id, fact("alice", "Alice lives in Berlin"))
    facts = await store.list("alice", [Kind.FACT])
    assert [r.text for r in facts.data] == ["Alice lives in Berlin"]
    history = await store.list("alice", [Kind.FACT], include_invalid=True)
    assert {r.text for r in history.data} == {"Alice lives in Paris", "Alice lives in Berlin"}


async def test_supersede_retires_the_old_fact_from_search(store: MemoryStore) -> None:
    """A superseded fact is kept as history but neither arm returns it unless asked."""
    old = fact("alice", "Alice works at Acme Corporation")
    await store.add([old])
    await vector_ids(store, "alice", "works")  # loads the user's vectors into the cache
    new = await store.supersede("alice", old.id, fact("alice", "Alice works at Globex now"))
    retired = await store.get("alice", old.id)
    assert retired.valid is False
    assert retired.superseded_by == new.id
    assert await keyword_ids(store, "alice", "Acme") == []
    assert old.id not in await vector_ids(store, "alice", "Alice works at Acme Corporation")
    assert await keyword_ids(store, "alice", "Acme", include_invalid=True) == [old.id]


async def test_editing_text_re_embeds_and_re_indexes(store: MemoryStore) -> None:
    """After an edit, the new words and meaning find the record; the old words do not."""
    record = fact("alice", "Alice plays the violin")
    await store.add([record, fact("alice", "Alice enjoys hiking in the alps")])
    await vector_ids(store, "alice", "violin")
    edited = await store.update("alice", record.id, text="Alice plays the cello in an orchestra")
    assert edited.updated_at is not None
    assert await keyword_ids(store, "alice", "violin") == []
    assert await keyword_ids(store, "alice", "cello") == [record.id]
    assert (await vector_ids(store, "alice", "cello orchestra"))[0] == record.id
    assert await store.update("bob", record.id, text="hijacked") is None
    assert (await store.get("alice", record.id)).text == "Alice plays the cello in an orchestra"
    with pytest.raises(ValueError, match="model_id"):
        await store.update("alice", record.id, model_id="another/model")


async def test_update_fields_without_text_keeps_the_vector(store: MemoryStore) -> None:
    """Changing importance leaves the embedding as it was."""
    record = fact("alice", "Alice is allergic to peanuts")
    await store.add([record])
    before = (await store.get("alice", record.id)).embedding
    after = await store.update("alice", record.id, importance=9, sensitive=True)
    assert after.importance == 9
    assert np.allclose((await store.get("alice", record.id)).embedding, before)


async def test_touch_sets_last_accessed_and_survives_a_restart(tmp_path: Path) -> None:
    """A touched record shows its access time at once and after the store is reopened."""
    at = datetime(2025, 6, 1, 12, tzinfo=UTC)
    async with MemoryStore(settings_for(tmp_path), HashingEmbedder()) as store:
        [record] = await store.add([fact("alice", "Alice drinks oat milk")])
        await store.touch("alice", [record.id], at=at)
        assert (await store.get("alice", record.id)).last_accessed_at == at
        hits = await store.keyword_search("alice", "oat milk", 1)
        assert hits[0].record.last_accessed_at == at
    async with MemoryStore(settings_for(tmp_path), HashingEmbedder()) as store:
        assert (await store.get("alice", record.id)).last_accessed_at == at


async def test_an_access_soon_after_creation_is_shown_but_not_written(tmp_path: Path) -> None:
    """A record used within the touch granularity of its creation shows the access time while the store runs,
    but its row is not rewritten for it (recency counts hours; the creation time says as much): after a reopen
    it has none. A record created two days before its use gets its access time written."""
    at = T0 + timedelta(days=2)
    async with MemoryStore(settings_for(tmp_path), HashingEmbedder()) as store:
        new, old = await store.add([fact("alice", "Alice drinks oat milk", hours=48), fact("alice", "Alice rows")])
        await store.read_many("alice", [new.id])  # the user's vectors cached: their creation times known
        await store.touch("alice", [new.id, old.id], at=at + timedelta(minutes=5))
        assert [r.last_accessed_at for r in await store.read_many("alice", [new.id, old.id])] == [
            at + timedelta(minutes=5)
        ] * 2
    async with MemoryStore(settings_for(tmp_path), HashingEmbedder()) as store:
        assert (await store.get("alice", new.id)).last_accessed_at is None
        assert (await store.get("alice", old.id)).last_accessed_at == at + timedelta(minutes=5)


async def test_a_user_loaded_into_the_cache_after_a_touch_shows_the_pending_access_time(store: MemoryStore) -> None:
    """Reads from the vector cache apply no touches, so a user's entry loaded while an access time is still
    pending (not yet written to LanceDB) carries it: every arm and lookup then shows it."""
    at = datetime(2025, 6, 1, 12, tzinfo=UTC)
    [record] = await store.add([fact("alice", "Alice drinks oat milk")])
    await store.touch("alice", [record.id], at=at)
    store.cache.drop("alice")  # evicted before the flush: the next read loads it from LanceDB
    hits = await store.vector_search("alice", await query_vector(store, "oat milk"), 1)
    assert hits[0].record.last_accessed_at == at
    assert "alice" in store.cache
    assert (await store.keyword_search("alice", "oat milk", 1))[0].record.last_accessed_at == at
    assert (await store.read_many("alice", [record.id]))[0].last_accessed_at == at


async def test_delete_removes_from_both_arms_and_is_scoped(store: MemoryStore) -> None:
    """A deleted record is gone everywhere; deleting it as another user does nothing."""
    keep, gone = await store.add([fact("alice", "Alice likes jazz"), fact("alice", "Alice likes jazz piano")])
    await vector_ids(store, "alice", "jazz")
    assert await store.delete("bob", gone.id) is False
    assert await store.delete("alice", gone.id) is True
    assert await store.delete("alice", gone.id) is False
    assert await store.get("alice", gone.id) is None
    assert await keyword_ids(store, "alice", "jazz") == [keep.id]
    assert await vector_ids(store, "alice", "jazz piano") == [keep.id]


@pytest.mark.parametrize("cache_bytes", [256 * 2**20, 0], ids=["cache", "lancedb"])
async def test_filters_apply_in_both_vector_paths_and_the_keyword_arm(tmp_path: Path, cache_bytes: int) -> None:
    """Kinds and the time window filter the cached path, the LanceDB path and the keyword arm alike."""
    async with MemoryStore(settings_for(tmp_path, vector_cache_bytes=cache_bytes), HashingEmbedder()) as store:
        records = [
            fact("alice", f"coffee note {i}", hours=i, kind=Kind.TURN if i % 2 else Kind.FACT) for i in range(10)
        ]
        await store.add(records)
        window = {"since": T0 + timedelta(hours=2), "until": T0 + timedelta(hours=5)}
        expected = {r.id for r in records[2:6]}
        assert set(await vector_ids(store, "alice", "coffee", **window)) == expected
        assert set(await keyword_ids(store, "alice", "coffee", **window)) == expected
        turns = {r.id for r in records if r.kind == Kind.TURN}
        assert set(await vector_ids(store, "alice", "coffee", kinds=[Kind.TURN])) == turns
        assert set(await keyword_ids(store, "alice", "coffee", kinds=[Kind.TURN])) == turns
        assert ("alice" in store.cache) == (cache_bytes > 0)


async def test_cached_and_lancedb_vector_paths_agree(tmp_path: Path) -> None:
    """The in-RAM exact search ranks like LanceDB's filtered search."""
    texts = [f"topic {i % 7} detail {i} words {i % 3}" for i in range(60)]
    results = []
    for cache_bytes in (256 * 2**20, 0):
        path = tmp_path / str(cache_bytes)
        async with MemoryStore(settings_for(path, vector_cache_bytes=cache_bytes), HashingEmbedder()) as store:
            await store.add([fact("alice", text, id=f"r{i}") for i, text in enumerate(texts)])
            await store.add([fact("bob", text) for text in texts])
            hits = await store.vector_search("alice", await query_vector(store, "topic 3 words 1"), 8)
            results.append([(h.record.id, round(h.score, 4)) for h in hits])
    cached, lance = results
    assert [score for _, score in cached] == [score for _, score in lance]
    cut = cached[-1][1]  # ties at the cut may be broken differently; above it the sets must agree
    assert {i for i, score in cached if score > cut} == {i for i, score in lance if score > cut}


async def test_cache_stays_coherent_with_writes(store: MemoryStore) -> None:
    """After the cache is loaded, new, edited and deleted records show up correctly in vector search."""
    first = fact("alice", "Alice swims every morning")
    await store.add([first])
    assert await vector_ids(store, "alice", "swims") == [first.id]
    assert "alice" in store.cache
    second = fact("alice", "Alice paints watercolours")
    await store.add([second])
    assert (await vector_ids(store, "alice", "paints watercolours"))[0] == second.id
    await store.update("alice", second.id, text="Alice sculpts marble")
    assert (await vector_ids(store, "alice", "sculpts marble"))[0] == second.id
    await store.delete("alice", first.id)
    assert await vector_ids(store, "alice", "swims every morning") == [second.id]


@contextlib.asynccontextmanager
async def keyword_commit_held(
    store: MemoryStore, monkeypatch: pytest.MonkeyPatch, record: MemoryRecord
) -> AsyncIterator[None]:
    """Add ``record`` with its keyword commit held: inside, LanceDB has it and Tantivy has not committed it;
    on leaving, the commit goes through and the add returns."""
    committing, release = asyncio.Event(), asyncio.Event()
    commit = store._keyword.commit

    async def slow_commit() -> None:
        committing.set()
        await release.wait()
        await commit()

    monkeypatch.setattr(store._keyword, "commit", slow_commit)
    writing = asyncio.create_task(store.add([record]))
    try:
        await asyncio.wait_for(committing.wait(), 10)
        yield
    finally:
        release.set()
        await writing


async def test_a_cached_user_sees_a_new_record_only_once_both_arms_have_it(
    store: MemoryStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While Tantivy commits a new record, reads of a cached user neither list it nor rank it on the dense arm
    alone (it would lose to older records the keyword arm finds); once the write is done, both arms have it."""
    [old] = await store.add([fact("alice", "Alice lives in London")])
    assert await vector_ids(store, "alice", "lives") == [old.id]  # alice is cached
    new = fact("alice", "Alice moved to Lisbon", hours=1)
    async with keyword_commit_held(store, monkeypatch, new):
        assert await vector_ids(store, "alice", "moved to Lisbon") == [old.id]
        assert [r.id for r in (await store.list("alice")).data] == [old.id]
    assert (await vector_ids(store, "alice", "moved to Lisbon"))[0] == new.id
    assert await keyword_ids(store, "alice", "Lisbon") == [new.id]
    assert [r.id for r in (await store.list("alice")).data] == [new.id, old.id]


@pytest.mark.parametrize("cache_bytes", [None, 0], ids=["loaded-into-the-cache", "searched-in-lancedb"])
async def test_a_user_read_first_while_a_new_record_awaits_its_keyword_commit_sees_it_only_after(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cache_bytes: int | None
) -> None:
    """A user not cached whose first read comes while Tantivy commits a new record: neither the load into the
    vector cache nor LanceDB's own vector search (a user too big for the cache) shows it on the dense arm
    alone; once the write is done, both arms have it (the load got it from the write's publish)."""
    overrides = {} if cache_bytes is None else {"vector_cache_bytes": cache_bytes}
    async with MemoryStore(settings_for(tmp_path / "data", **overrides), HashingEmbedder()) as store:
        [old] = await store.add([fact("alice", "Alice lives in London")])
        store.cache.drop("alice")
        new = fact("alice", "Alice moved to Lisbon", hours=1)
        async with keyword_commit_held(store, monkeypatch, new):
            assert await vector_ids(store, "alice", "moved to Lisbon") == [old.id]
            assert ("alice" in store.cache) is (cache_bytes is None)
        assert (await vector_ids(store, "alice", "moved to Lisbon"))[0] == new.id
        assert await keyword_ids(store, "alice", "Lisbon") == [new.id]


async def test_get_many_and_list_answer_alike_from_the_cache_and_from_lancedb(
    store: MemoryStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While the read side holds a user, get_many and list answer from the vector cache (no filtered scan of the
    table), exactly as LanceDB would: fields, vectors, history, pending access times, order and cursors,
    through new, edited, superseded and deleted records."""
    records = [fact("alice", f"memory {i}", hours=i % 9, kind=Kind.TURN if i % 3 else Kind.FACT) for i in range(23)]
    added = await store.add(records)
    await store.supersede("alice", added[0].id, fact("alice", "memory 0, corrected", hours=40))
    await store.update("alice", added[3].id, text="memory 3, edited")
    await store.delete("alice", added[6].id)
    await store.touch("alice", [added[9].id], at=T0 + timedelta(days=3))
    ids = [r.id for r in added[::-1]] + ["missing"]

    async def answers() -> list[object]:
        many = await store.get_many("alice", ids)
        out: list[object] = [[(r.public_dict(), np.asarray(r.embedding).tolist()) for r in many]]
        for kinds, history in ((None, False), ([Kind.FACT], True), ([Kind.TURN], False)):
            cursor = None
            while True:
                page = await store.list("alice", kinds, limit=4, cursor=cursor, include_invalid=history)
                out.append(([r.public_dict() for r in page.data], page.next_cursor))
                if (cursor := page.next_cursor) is None:
                    break
        return out

    assert "alice" not in store.cache
    from_lance = await answers()
    assert await vector_ids(store, "alice", "memory")  # the read side loads alice
    assert "alice" in store.cache

    async def no_scan(*args: object, **kwargs: object) -> None:
        raise AssertionError("a filtered LanceDB read for a cached user")

    monkeypatch.setattr(store._lance, "records", no_scan)
    monkeypatch.setattr(store._lance, "keys", no_scan)
    assert await answers() == from_lance


async def test_export_is_jsonl_of_the_user_with_history_and_no_vectors(store: MemoryStore) -> None:
    """Export yields one JSON object per line for every record of the user, invalid ones included."""
    old = fact("alice", "Alice is 30", hours=1)
    await store.add([old, fact("bob", "Bob is 40")])
    await store.supersede("alice", old.id, fact("alice", "Alice is 31", hours=2))
    lines = [line async for line in store.export("alice")]
    assert all(line.endswith("\n") for line in lines)
    rows = [json.loads(line) for line in lines]
    assert [row["text"] for row in rows] == ["Alice is 30", "Alice is 31"]
    assert {row["user_id"] for row in rows} == {"alice"}
    assert all("embedding" not in row for row in rows)
    assert [line async for line in store.export("nobody")] == []


async def test_counts_and_user_ids(store: MemoryStore) -> None:
    """count and user_ids reflect what is stored."""
    await store.add([fact("alice", "a"), fact("alice", "b"), fact("bob", "c")])
    assert await store.count() == 3
    assert await store.count("alice") == 2
    assert await store.user_ids() == ["alice", "bob"]


@pytest.mark.parametrize("bad", ["", "a\x00b", "line\nbreak", "x" * 513, "é" * 257])
async def test_invalid_user_ids_are_refused(store: MemoryStore, bad: str) -> None:
    """Empty, control-character and over-long user ids are rejected before any query runs."""
    with pytest.raises(InvalidUserId):
        await store.add([fact(bad, "text")])
    with pytest.raises(ValueError, match="user id"):
        await store.list(bad)


async def test_a_512_byte_user_id_is_accepted(store: MemoryStore) -> None:
    """The longest allowed id works end to end."""
    user = "u" * 512
    [record] = await store.add([fact(user, "long id memory")])
    assert await keyword_ids(store, user, "memory") == [record.id]


async def test_forget_user_erases_everything_including_files(tmp_path: Path) -> None:
    """After forget, no API returns the user's data and no file on disk contains their id or text."""
    user, secret = "zq-forgotten-user-7731", "xylophonequartz"
    path = tmp_path / "data"
    async with MemoryStore(settings_for(path), HashingEmbedder()) as store:
        ours = [fact(user, f"{secret} memory {i}", kind=kind) for i, kind in enumerate([Kind.FACT, Kind.TURN] * 20)]
        theirs = [fact("bob", f"bob keeps his marmalade recipe {i}") for i in range(40)]
        await store.add(ours[:20] + theirs[:20])
        await store.optimize()
        await store.add(ours[20:] + theirs[20:])
        await store.touch(user, [ours[0].id])
        await vector_ids(store, user, secret)
        counts = await store.forget_user(user)
        assert user not in store.cache
        assert counts == {"turn": 20, "fact": 20, "summary": 0, "insight": 0, "subject": 0}
        assert await store.count(user) == 0
        assert await keyword_ids(store, user, secret) == []
        assert await vector_ids(store, user, secret) == []
        assert [line async for line in store.export(user)] == []
        assert len(await keyword_ids(store, "bob", "marmalade", k=100)) == 40
        assert len(await vector_ids(store, "bob", "marmalade recipe", k=100)) == 40
    for file in (p for p in path.rglob("*") if p.is_file()):
        data = file.read_bytes()
        assert user.encode() not in data, file
        assert secret.encode() not in data, file
    async with MemoryStore(settings_for(path), HashingEmbedder()) as store:
        assert await store.count("bob") == 40
        assert await store.forget_user(user) == {"turn": 0, "fact": 0, "summary": 0, "insight": 0, "subject": 0}


async def test_forget_user_also_erases_writes_submitted_before_it(tmp_path: Path) -> None:
    """A write handed to the batch writer before the forget (its caller since cancelled: a job the forget
    stopped) is flushed and then erased, never written after the forget."""
    user = "zq-late-writer-1193"
    async with MemoryStore(settings_for(tmp_path / "data", flush_interval_ms=300), HashingEmbedder()) as store:
        writing = asyncio.create_task(store.add([fact(user, f"late memory {i}") for i in range(3)]))
        await asyncio.sleep(0.05)  # embedded and waiting in the writer's batch
        writing.cancel()
        await store.forget_user(user)
        await asyncio.sleep(0.5)  # past the batch's interval
        assert await store.count(user) == 0
        assert await keyword_ids(store, user, "late memory") == []


async def test_opening_with_another_model_is_refused(tmp_path: Path) -> None:
    """A store built with one embedding model will not start with another, and says what to do."""
    async with MemoryStore(settings_for(tmp_path), HashingEmbedder()) as store:
        await store.add([fact("alice", "something")])
    other = HashingEmbedder(dim=32, model_id="test/other-32")
    with pytest.raises(EmbedderMismatch) as error:
        async with MemoryStore(settings_for(tmp_path), other):
            pass
    message = str(error.value)
    assert "test/hashing-64" in message
    assert "test/other-32" in message
    assert "memproxy reindex" in message


async def test_reindex_re_embeds_everything_with_the_new_model(tmp_path: Path) -> None:
    """reindex moves every record into the new vector space, reporting progress, and the store opens again."""
    async with MemoryStore(settings_for(tmp_path), HashingEmbedder()) as store:
        await store.add([fact("alice", f"alice fact {i}") for i in range(300)] + [fact("bob", "bob fact")])
    other = HashingEmbedder(dim=32, model_id="test/other-32")
    progress: list[tuple[int, int]] = []
    async with MemoryStore(settings_for(tmp_path), other, allow_mismatch=True) as store:
        with pytest.raises(EmbedderMismatch):
            await store.add([fact("alice", "refused until reindexed")])
        assert await store.reindex(lambda done, total: progress.append((done, total))) == 301
    assert progress[-1] == (301, 301)
    assert len(progress) >= 2
    async with MemoryStore(settings_for(tmp_path), other) as store:
        record = (await store.list("alice", limit=1)).data[0]
        assert record.model_id == "test/other-32"
        assert len(record.embedding) == 32
        assert (await vector_ids(store, "bob", "bob fact"))[0] == (await store.list("bob")).data[0].id
        assert len(await keyword_ids(store, "alice", "fact", k=500)) == 300


async def test_repair_reindexes_a_lost_keyword_index(tmp_path: Path) -> None:
    """If the Tantivy directory is lost, opening the store rebuilds it from LanceDB."""
    async with MemoryStore(settings_for(tmp_path), HashingEmbedder()) as store:
        records = await store.add([fact("alice", f"recoverable note {i}") for i in range(30)])
    shutil.rmtree(tmp_path / "tantivy")
    async with MemoryStore(settings_for(tmp_path), HashingEmbedder()) as store:
        assert set(await keyword_ids(store, "alice", "recoverable", k=50)) == {r.id for r in records}


async def test_repair_drops_orphans_and_fixes_stale_documents(tmp_path: Path) -> None:
    """Tantivy documents LanceDB lacks are dropped, stale ones re-indexed, when the sync note lags."""
    async with MemoryStore(settings_for(tmp_path), HashingEmbedder()) as store:
        [record] = await store.add([fact("alice", "the real text")])
    async with KeywordIndex(tmp_path / "tantivy") as kw:
        await kw.upsert([KeywordDoc("ghost", "alice", "fact", "ghostly words", 0, True)])
        await kw.upsert([KeywordDoc(record.id, "alice", "fact", "stale words", 0, True)])
        await kw.commit()
    (tmp_path / "sync.json").unlink()  # as after a crash between the two arms
    async with MemoryStore(settings_for(tmp_path), HashingEmbedder()) as store:
        assert await keyword_ids(store, "alice", "ghostly") == []
        assert await keyword_ids(store, "alice", "stale") == []
        assert await keyword_ids(store, "alice", "real") == [record.id]
        assert await store.repair() == {"reindexed": 0, "dropped": 0}


async def test_ann_index_keeps_searches_scoped(tmp_path: Path) -> None:
    """Past the ANN threshold an HNSW index is built, and LanceDB-path searches stay within the user."""
    settings = settings_for(tmp_path, ann_index_min_rows=300, vector_cache_bytes=0)
    async with MemoryStore(settings, HashingEmbedder()) as store:
        await store.add([fact("alice", f"walk in the park {i}") for i in range(200)])
        await store.add([fact("bob", f"walk in the park {i}") for i in range(200)])
        await store.optimize()
        indexed = {tuple(index.columns) for index in await store._lance.table.list_indices()}
        assert ("embedding",) in indexed
        assert ("user_id",) in indexed
        hits = await store.vector_search("alice", await query_vector(store, "walk in the park"), 50)
        assert len(hits) == 50
        assert {hit.record.user_id for hit in hits} == {"alice"}


async def test_no_ann_index_while_the_vector_cache_serves_every_search(tmp_path: Path) -> None:
    """Past the ANN threshold no index is built while every user fits the vector cache; one that does not fit
    (searched in LanceDB) makes the next optimize build it."""
    settings = settings_for(tmp_path, ann_index_min_rows=300)
    async with MemoryStore(settings, HashingEmbedder()) as store:
        await store.add([fact("alice", f"walk in the park {i}") for i in range(400)])
        assert len(await store.vector_search("alice", await query_vector(store, "walk in the park"), 5)) == 5
        await store.optimize()
        assert ("embedding",) not in {tuple(index.columns) for index in await store._lance.table.list_indices()}
        store._cache.max_bytes = 0  # alice no longer fits: her next search goes to LanceDB
        store._cache.clear()
        assert len(await store.vector_search("alice", await query_vector(store, "walk in the park"), 5)) == 5
        await store.optimize()
        assert ("embedding",) in {tuple(index.columns) for index in await store._lance.table.list_indices()}


async def test_a_second_store_on_the_same_directory_is_refused(tmp_path: Path) -> None:
    """One process owns a data directory: a second open fails clearly and harms nothing."""
    async with MemoryStore(settings_for(tmp_path), HashingEmbedder()) as store:
        [record] = await store.add([fact("alice", "owned by the first store")])
        with pytest.raises(StoreError, match="in use"):
            async with MemoryStore(settings_for(tmp_path), HashingEmbedder()):
                pass
        assert await keyword_ids(store, "alice", "owned") == [record.id]


async def test_deferred_purge_hides_at_once_and_clears_files_at_the_next_round(tmp_path: Path) -> None:
    """forget_user(purge=False) removes the user from every read now and from the disk at optimize."""
    user, secret = "zq-deferred-user-5512", "quagmirezephyr"
    path = tmp_path / "data"
    async with MemoryStore(settings_for(path), HashingEmbedder()) as store:
        await store.add([fact(user, f"{secret} {i}") for i in range(10)] + [fact("bob", "bob stays")])
        counts = await store.forget_user(user, purge=False)
        assert counts["fact"] == 10
        assert await keyword_ids(store, user, secret) == []
        assert await vector_ids(store, user, secret) == []
        assert await store.count(user) == 0
        await store.optimize()
        assert len(await keyword_ids(store, "bob", "stays")) == 1
    for file in (p for p in path.rglob("*") if p.is_file()):
        assert secret.encode() not in file.read_bytes(), file
        assert user.encode() not in file.read_bytes(), file


async def test_user_turns_reads_one_users_valid_turns_of_a_window_newest_first(store: MemoryStore) -> None:
    """The insight read: this user's valid turns in the window, newest first, each with its stored vector."""
    inside = [fact("alice", f"turn {h}", h, Kind.TURN, role="user", conversation_id="c") for h in (2, 3, 4)]
    await store.add(
        [
            *inside,
            fact("alice", "too old", 0, Kind.TURN, role="user", conversation_id="c"),
            fact("alice", "a fact", 3),
            fact("bob", "bob's turn", 3, Kind.TURN, role="user"),
        ]
    )
    await store.update("alice", inside[1].id, valid=False)
    turns = await store.user_turns("alice", T0 + timedelta(hours=1), T0 + timedelta(hours=5))
    assert [t.text for t in turns] == ["turn 4", "turn 2"]
    listed = {r.id: r for r in (await store.list("alice", [Kind.TURN], limit=10)).data}
    for turn in turns:
        assert turn.embedding is not None
        assert len(turn.embedding) == store.embedder.dim
        np.testing.assert_allclose(np.asarray(turn.embedding), np.asarray(listed[turn.id].embedding), atol=1e-6)


async def test_update_many_retires_several_records_of_one_user_at_once(store: MemoryStore) -> None:
    """Several of a user's records retired in one call leave both arms; another user's id in the list is untouched."""
    alice = [fact("alice", f"Alice collects blue stamps {i}", i) for i in range(3)]
    bob = fact("bob", "Bob collects blue stamps too")
    await store.add([*alice, bob])
    updated = await store.update_many("alice", [alice[0].id, alice[1].id, bob.id], valid=False)
    assert sorted(r.id for r in updated) == sorted([alice[0].id, alice[1].id])
    assert all(not r.valid for r in updated)
    assert await keyword_ids(store, "alice", "blue stamps") == [alice[2].id]
    assert await vector_ids(store, "alice", "blue stamps") == [alice[2].id]
    assert await keyword_ids(store, "bob", "blue stamps") == [bob.id]
    with pytest.raises(ValueError, match="text"):
        await store.update_many("alice", [alice[2].id], text="changed")


async def test_a_user_released_while_idle_is_reloaded_with_everything_written_meanwhile(store: MemoryStore) -> None:
    """``release_idle`` keeps users while reads are recent and drops them once unread for
    ``vector_cache_idle_s``; a memory written while a user was out of the cache is found by the next read, which
    loads the user again from LanceDB."""
    [first] = await store.add([fact("alice", "Alice adopted a golden retriever named Max")])
    await store.add([fact("bob", "Bob collects vinyl records")])
    assert (await vector_ids(store, "alice", "golden retriever"))[0] == first.id
    assert await vector_ids(store, "bob", "vinyl records")
    assert store.cached_users == 2
    assert store.release_idle() == []  # just read
    later = time.monotonic() + store.settings.vector_cache_idle_s + 1
    assert sorted(store.release_idle(now=later)) == ["alice", "bob"]
    assert store.cached_users == 0
    [second] = await store.add([fact("alice", "Alice moved to Lisbon in May")])
    assert (await vector_ids(store, "alice", "moved to Lisbon"))[0] == second.id
    assert first.id in await vector_ids(store, "alice", "golden retriever")
    assert store.cached_users == 1


@pytest.mark.parametrize("indexed", [False, True])
async def test_flushed_access_times_change_only_the_owners_records_and_that_column(
    tmp_path: Path, indexed: bool
) -> None:
    """Access times reach LanceDB, with or without the scalar indexes: every other field and the vector stay as
    they were, and an id passed under a user who does not own it is left alone."""
    at = datetime(2025, 6, 1, 12, tzinfo=UTC)
    async with MemoryStore(settings_for(tmp_path), HashingEmbedder()) as store:
        mine = await store.add([fact("alice", f"Alice fact {i}", hours=i) for i in range(5)])
        [theirs] = await store.add([fact("bob", "Bob drinks tea")])
        if indexed:
            await store._lance.ensure_scalar_indexes()
        assert (("id",) in await store._lance._indexed_columns()) is indexed
        before = {r.id: await store.get(r.user_id, r.id) for r in [*mine, theirs]}
        await store._lance.touch({"alice": [mine[0].id, mine[2].id, theirs.id], "bob": []}, at)
        store.cache.drop("alice")
        store.cache.drop("bob")
        for record in [*mine, theirs]:
            now = await store.get(record.user_id, record.id)
            touched = record.id in (mine[0].id, mine[2].id)
            assert now.last_accessed_at == (at if touched else before[record.id].last_accessed_at)
            assert now.replace(last_accessed_at=None, embedding=None) == before[record.id].replace(
                last_accessed_at=None, embedding=None
            )
            assert np.allclose(now.embedding, before[record.id].embedding)
        assert await store.count("alice") == 5
        assert await store.count("bob") == 1


async def test_flushed_access_times_skip_a_row_of_another_user_that_shares_the_id(tmp_path: Path) -> None:
    """Two replicas writing at once could leave one id on rows of two users, or twice on one user's: the
    owner's rows get the time, the other user's row keeps its own."""
    at = datetime(2025, 6, 1, 12, tzinfo=UTC)
    async with MemoryStore(settings_for(tmp_path), HashingEmbedder()) as store:
        shared, alone = await store.add([fact("alice", "Alice sails"), fact("alice", "Alice rows")])
        table = store._lance.table
        row = await table.query().where(f"id = '{shared.id}'").to_arrow()
        owner = row.schema.get_field_index("user_id")
        await table.add(row.set_column(owner, "user_id", pa.array(["bob"], row.schema.field("user_id").type)))
        await table.add(row)  # and the same id twice for alice
        await store._lance.ensure_scalar_indexes()
        await store._lance.touch({"alice": [shared.id, alone.id, shared.id]}, at)
        rows = (await table.query().select(["id", "user_id", "last_accessed_at"]).to_arrow()).to_pylist()
    assert sorted((r["user_id"], r["id"] == shared.id, r["last_accessed_at"]) for r in rows) == [
        ("alice", False, at),
        ("alice", True, at),
        ("alice", True, at),
        ("bob", True, None),
    ]


async def test_a_forgotten_users_spilled_vectors_go_with_them(tmp_path: Path) -> None:
    """A user the vector cache evicted to its spill file (``store.vector_spill_bytes``) is read back from it,
    and forgetting them deletes the file with the rest: nothing under the data directory holds their text, and
    their next read finds nothing."""
    user, secret = "zq-spilled-user-5521", "quokkamarmot"
    path = tmp_path / "data"
    async with MemoryStore(settings_for(path), HashingEmbedder()) as store:
        await store.add([fact(user, f"{secret} memory {i}") for i in range(30)])
        await store.add([fact("bob", f"bob keeps his marmalade recipe {i}") for i in range(30)])
        assert len(await vector_ids(store, user, secret, k=100)) == 30
        store.cache.max_bytes = int(store.cache.nbytes * 1.5)  # room for one of the two users at a time
        assert len(await vector_ids(store, "bob", "marmalade", k=100)) == 30
        spill = store.cache.spill
        assert spill is not None
        assert user not in store.cache
        assert user in spill
        assert any(secret.encode() in f.read_bytes() for f in spill.directory.iterdir())
        assert len(await vector_ids(store, user, secret, k=100)) == 30  # from the file
        await vector_ids(store, "bob", "marmalade")
        await store.forget_user(user)
        assert user not in spill
        for file in (p for p in path.rglob("*") if p.is_file()):
            assert secret.encode() not in file.read_bytes(), file
        assert await vector_ids(store, user, secret) == []
    assert not spill.directory.exists()
