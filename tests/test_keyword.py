"""The Tantivy keyword arm: BM25 per user, CJK bigrams, filters, and hostile query text."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tantivy import Document, Index, SchemaBuilder

from proxy.memory.store.keyword import KeywordIndex
from proxy.memory.store.keyword_schema import (
    KeywordDoc,
    KeywordFilter,
    cjk_analyzer,
    cjk_bigrams,
    cjk_runs,
    id_from_halves,
    id_halves,
    ids_from_halves,
)
from proxy.memory.store.records import new_id

ALL = KeywordFilter(include_invalid=True)


def doc(record_id: str, text: str, user: str = "alice", kind: str = "fact", at: int = 0, valid: bool = True):
    return KeywordDoc(record_id, user, kind, text, at, valid)


@pytest.fixture
async def index(tmp_path: Path) -> AsyncIterator[KeywordIndex]:
    """A keyword index holding a few memories of alice and bob."""
    async with KeywordIndex(tmp_path / "kw") as kw:
        await kw.upsert(
            [
                doc("a1", "Alice adopted a golden retriever named Max", at=100),
                doc("a2", "Alice moved to Seoul last spring", kind="turn", at=200),
                doc("a3", "저는 서울에서 일하고 있어요", at=300),
                doc("a4", "東京タワーに行きました", at=400),
                doc("a5", "我喜欢北京烤鸭", at=500, valid=False),
                doc("b1", "Bob adopted a golden retriever too", user="bob", at=100),
            ]
        )
        await kw.commit()
        yield kw


async def ids(kw: KeywordIndex, user: str, text: str, where: KeywordFilter = ALL) -> list[str]:
    return [record_id for record_id, _ in await kw.search(user, text, 10, where)]


async def test_bm25_finds_the_user_s_matching_memories_only(index: KeywordIndex) -> None:
    """A query matches alice's memory and never bob's, whatever the overlap in words."""
    assert await ids(index, "alice", "golden retriever") == ["a1"]
    assert await ids(index, "bob", "golden retriever") == ["b1"]
    assert await ids(index, "carol", "golden retriever") == []


@pytest.mark.parametrize(
    ("query", "expected"),
    [("서울", "a3"), ("서울에서 일", "a3"), ("東京", "a4"), ("タワー", "a4"), ("北京", "a5"), ("烤鸭", "a5")],
)
async def test_cjk_queries_match_inside_words(index: KeywordIndex, query: str, expected: str) -> None:
    """Korean, Japanese and Chinese fragments find the memory containing them, inside longer words."""
    assert (await ids(index, "alice", query))[:1] == [expected]


async def test_filters_kind_time_and_validity(index: KeywordIndex) -> None:
    """Kind, created_at window (inclusive) and validity filters narrow the matches."""
    assert await ids(index, "alice", "alice", KeywordFilter(kinds=("turn",), include_invalid=True)) == ["a2"]
    assert await ids(index, "alice", "alice", KeywordFilter(since_us=150, until_us=200, include_invalid=True)) == ["a2"]
    assert await ids(index, "alice", "北京", KeywordFilter()) == []


async def test_upsert_replaces_and_remove_deletes(index: KeywordIndex) -> None:
    """Re-indexing an id replaces its text; removing it makes it unfindable."""
    await index.upsert([doc("a1", "Alice now owns a cat")])
    await index.commit()
    assert await ids(index, "alice", "retriever") == []
    assert await ids(index, "alice", "cat") == ["a1"]
    await index.remove("alice", ["a1"])
    await index.commit()
    assert await ids(index, "alice", "cat") == []


async def test_remove_is_scoped_to_the_user(index: KeywordIndex) -> None:
    """Removing an id under the wrong user deletes nothing."""
    await index.remove("bob", ["a1"])
    await index.commit()
    assert await ids(index, "alice", "retriever") == ["a1"]


HOSTILE = [
    'user_id:bob OR text:"golden"',
    "golden AND NOT alice",
    "(golden) OR (retriever",
    "*",
    "golden*",
    'text:"',
    "\\",
    "' OR '1'='1",
    "user_id:*",
    "🐶 golden 🦮",
    "x" * 100_000,
    "alice " * 5000,
    "",
    "   ",
    "~~~^^^:::",
]


@pytest.mark.parametrize("query", HOSTILE, ids=range(len(HOSTILE)))
async def test_query_syntax_is_never_interpreted(index: KeywordIndex, query: str) -> None:
    """Operators, field prefixes, wildcards, unbalanced quotes and huge inputs are plain words."""
    found = await ids(index, "alice", query)
    assert "b1" not in found
    assert set(found) <= {"a1", "a2", "a3", "a4", "a5"}


async def test_field_prefix_words_still_match_as_words(index: KeywordIndex) -> None:
    """``user_id:bob golden`` searches the words user, id, bob, golden within alice's memories only."""
    assert await ids(index, "alice", "user_id:bob golden") == ["a1"]


async def test_hostile_user_ids_are_exact_terms(tmp_path: Path) -> None:
    """Ids with quotes, colons, spaces or wildcards only ever match themselves."""
    users = ["*", "a:b", "' OR '1'='1", 'say "hi"', "x y", "ALICE", "alice", "用户"]
    async with KeywordIndex(tmp_path / "kw") as kw:
        await kw.upsert([doc(f"r{i}", "shared words", user=user) for i, user in enumerate(users)])
        await kw.commit()
        for i, user in enumerate(users):
            assert await ids(kw, user, "shared") == [f"r{i}"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=60))
def test_bigrams_match_tantivy_s_ngram_tokenizer(text: str) -> None:
    """The query-side bigrams are exactly what the index-side ngram(2,2) tokenizer yields per CJK run."""
    analyzer = cjk_analyzer()
    expected = [token for run in cjk_runs(text) for token in analyzer.analyze(run)]
    assert cjk_bigrams(text) == expected


async def test_reopen_keeps_documents_and_tokenizers(tmp_path: Path) -> None:
    """After a reopen the custom tokenizers are registered again and old documents still match."""
    async with KeywordIndex(tmp_path / "kw") as kw:
        await kw.upsert([doc("k1", "부산에서 회의가 있었다")])
        await kw.commit()
    async with KeywordIndex(tmp_path / "kw") as kw:
        assert await ids(kw, "alice", "회의") == ["k1"]
        await kw.upsert([doc("k2", "부산 바다")])
        await kw.commit()
        assert set(await ids(kw, "alice", "부산")) == {"k1", "k2"}


async def test_rebuild_swaps_in_a_fresh_index(tmp_path: Path) -> None:
    """A rebuild replaces the whole index with the given documents and removes the old directory."""

    async def batches() -> AsyncIterator[list[KeywordDoc]]:
        yield [doc("n1", "only this one")]

    async with KeywordIndex(tmp_path / "kw") as kw:
        await kw.upsert([doc("o1", "old words"), doc("o2", "old words again")])
        await kw.commit()
        old_dirs = {p.name for p in (tmp_path / "kw").iterdir() if p.is_dir()}
        assert await kw.rebuild(batches()) == 1
        assert await ids(kw, "alice", "old") == []
        assert await ids(kw, "alice", "only") == ["n1"]
        new_dirs = {p.name for p in (tmp_path / "kw").iterdir() if p.is_dir()}
        assert not old_dirs & new_dirs
    async with KeywordIndex(tmp_path / "kw") as kw:
        assert await kw.signatures() == {"n1": doc("n1", "only this one").sig}


async def test_stop_words_do_not_drive_matches_but_a_stop_word_query_still_works(tmp_path: Path) -> None:
    """'the cat' ranks by 'cat' alone; a query made only of stop words still finds what contains them."""
    async with KeywordIndex(tmp_path / "kw") as kw:
        await kw.upsert([doc("s1", "the dog and the bird"), doc("s2", "a cat"), doc("s3", "to be or not to be")])
        await kw.commit()
        assert await ids(kw, "alice", "the cat") == ["s2"]
        assert await ids(kw, "alice", "to be") == ["s3"]


async def test_generated_ids_come_back_from_the_fast_id_halves_and_others_from_the_document(tmp_path: Path) -> None:
    """A generated id (32 lowercase hex digits) is read back from its two fast halves, every other id (an
    imported one, upper-case hex) from the stored document: the same ids either way."""
    generated = [new_id() for _ in range(3)]
    others = ["imported-7", generated[0].upper()]
    async with KeywordIndex(tmp_path / "kw") as kw:
        await kw.upsert([doc(i, f"alice walks the dog {n}") for n, i in enumerate(generated + others)])
        await kw.commit()
        assert set(await ids(kw, "alice", "walks dog")) == set(generated + others)
    assert id_halves("imported-7") == (False, 0, 0)
    for record_id in [*generated, "0" * 32, "f" * 32]:
        hexed, high, low = id_halves(record_id)
        assert hexed
        assert -(2**63) <= high < 2**63
        assert -(2**63) <= low < 2**63
        assert id_from_halves(high, low) == record_id
    edges = [*generated, "0" * 32, "f" * 32, "8" + "0" * 31, "7" + "f" * 31]
    halves = [id_halves(record_id) for record_id in edges]
    assert ids_from_halves([high for _, high, _ in halves], [low for _, _, low in halves]) == edges  # all at once


async def test_an_index_of_an_older_schema_is_rebuilt(tmp_path: Path) -> None:
    """An index written before a field existed (here: before the fast id halves) does not open as it is: the
    keyword index starts a fresh generation and says so (``fresh``), and the store re-indexes from LanceDB."""
    path = tmp_path / "kw"
    (path / "g000001").mkdir(parents=True)
    (path / "CURRENT").write_text("g000001")
    builder = SchemaBuilder()
    builder.add_text_field("id", stored=True, tokenizer_name="raw", index_option="basic")
    old = Index(builder.build(), path=str(path / "g000001"))
    writer = old.writer(heap_size=15_000_000, num_threads=1)
    writer.add_document(Document(id="a1"))
    writer.commit()
    writer.wait_merging_threads()
    del writer, old
    async with KeywordIndex(path) as kw:
        assert kw.fresh
        await kw.upsert([doc("a1", "Alice adopted a dog")])
        await kw.commit()
        assert await ids(kw, "alice", "dog") == ["a1"]


FACTS = KeywordFilter(kinds=("fact",))
PAST = KeywordFilter(kinds=("summary", "turn"))


async def test_the_read_path_s_pools_rank_and_score_as_a_filtered_search_does(tmp_path: Path) -> None:
    """The pools the read path searches (a user's valid facts; their valid turns and summaries) go through the
    user- and pool-scoped terms; the same pools asked with a time filter (which they cannot serve) go the other
    way: the same documents with the same scores (the boosts give each scoped term its word's IDF over the whole
    index; k is above every pool's size, so ties at the cut cannot differ), and never another user's, another
    pool's or an invalid document."""
    words = ["garden", "wedding", "marathon", "spanish", "piano", "lisbon", "pottery", "interview", "dog", "flat"]
    docs = []
    for n in range(600):
        user = ("alice", "bob", "a|b")[n % 3]
        kind = ("turn", "turn", "summary", "fact", "subject")[n % 5]
        picked = [words[(n * 7 + i * 3) % len(words)] for i in range(1 + n % 4)]
        text = f"I have been thinking about my {' and my '.join(picked)} plans ({n % 17}) 서울 {n % 2}"
        docs.append(doc(f"d{n}", text, user=user, kind=kind, at=n, valid=n % 11 != 0))
    async with KeywordIndex(tmp_path / "kw") as kw:
        await kw.add(docs[:300])
        await kw.commit()
        await kw.add(docs[300:])  # two segments
        await kw.commit()
        await kw.remove("alice", [f"d{n}" for n in range(0, 600, 21)])  # deleted, not yet merged away
        await kw.commit()
        docs = [d for n, d in enumerate(docs) if not (n % 21 == 0 and d.user_id == "alice")]
        for user in ("alice", "bob", "a|b", "carol"):
            for text in ("thinking about the garden", "marathon and piano plans 3", "서울 dog", "my wedding"):
                scoped = await kw.search_pools(user, text, [(400, FACTS), (400, PAST)])
                filtered = await kw.search_pools(
                    user, text, [(400, KeywordFilter(kinds=w.kinds, until_us=10**15)) for w in (FACTS, PAST)]
                )
                for got, want, kinds in zip(scoped, filtered, (("fact",), ("summary", "turn")), strict=True):
                    assert dict(got) == pytest.approx(dict(want), rel=1e-4)
                    assert [s for _, s in got] == sorted((s for _, s in got), reverse=True)
                    for record_id, _ in got:
                        held = next(d for d in docs if d.id == record_id)
                        assert (held.user_id, held.valid) == (user, True)
                        assert held.kind in kinds
                if user != "carol":
                    assert any(scoped), (user, text)
