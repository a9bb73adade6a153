"""Tests of the read path end to end over the real store (LanceDB + Tantivy in tmp_path)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from proxy.memory.errors import EmbedderError, StoreError
from proxy.memory.read.arms import at_hand, entity_hits
from proxy.memory.read.block import Section
from proxy.memory.read.candidates import BM25, DENSE, ENTITY, ArmHit, Candidate
from proxy.memory.read.injection import inject
from proxy.memory.read.names import NameIndex
from proxy.memory.read.read_cache import ReadCache
from proxy.memory.read.rerank import Reranker, RerankSettings
from proxy.memory.read.retrieval import retrieve
from proxy.memory.read.retrieval_settings import InjectionSettings, RetrievalSettings
from proxy.memory.read.selection import plan_items
from proxy.memory.store.memory_store import MemoryStore, StoreSettings
from proxy.memory.store.records import Kind, MemoryRecord, Pool
from tests.support.embedder import HashingEmbedder
from tests.support.fake_rerank import FakeRerank, relevance

NOW = datetime(2026, 3, 1, 12, tzinfo=UTC)


def _fact(user: str, text: str, days_ago: float = 10, **fields: Any) -> MemoryRecord:
    """A fact of ``user`` created ``days_ago`` before NOW."""
    return MemoryRecord(user_id=user, kind=Kind.FACT, text=text, created_at=NOW - timedelta(days=days_ago), **fields)


def _turn(user: str, text: str, conversation: str, days_ago: float = 1, role: str = "user") -> MemoryRecord:
    """A chat turn of ``user`` in ``conversation``."""
    return MemoryRecord(
        user_id=user,
        kind=Kind.TURN,
        text=text,
        role=role,
        conversation_id=conversation,
        created_at=NOW - timedelta(days=days_ago),
    )


def _settings(**changes: Any) -> RetrievalSettings:
    """Read-path settings with a generous arm timeout, so a loaded test machine never degrades an arm."""
    return RetrievalSettings(**{"arm_timeout_ms": 10_000, **changes})


def _ask(text: str) -> list[dict[str, Any]]:
    """A request with a system prompt and one user question."""
    return [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": text}]


@pytest.fixture
def embedder() -> HashingEmbedder:
    """The deterministic test embedder, shared by the store and the read path."""
    return HashingEmbedder(dim=64)


@pytest.fixture
async def store(tmp_path: Path, embedder: HashingEmbedder) -> AsyncIterator[MemoryStore]:
    """A real store in a temporary directory."""
    async with MemoryStore(StoreSettings(path=tmp_path / "data"), embedder) as opened:
        yield opened


class FailingEmbedder(HashingEmbedder):
    """An embedding backend that is down."""

    async def embed_query(self, text: str) -> np.ndarray:
        raise EmbedderError("backend unreachable")


class SlowEmbedder(HashingEmbedder):
    """An embedding backend that hangs."""

    async def embed_query(self, text: str) -> np.ndarray:
        await asyncio.sleep(30)
        return await super().embed_query(text)


class InlineEmbedder(HashingEmbedder):
    """The test embedder, saying (as the static model does) that it embeds a query on the spot."""

    queries_inline = True


class BrokenKeywordStore:
    """The real store, with its keyword arm failing (fault injection, everything else real)."""

    def __init__(self, store: MemoryStore, error: BaseException | None = None, delay: float = 0.0) -> None:
        self._store = store
        self._error = error
        self._delay = delay

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    async def keyword_search_pools(self, *args: Any, **kwargs: Any) -> Sequence[Any]:
        await asyncio.sleep(self._delay)
        if self._error is not None:
            raise self._error
        return await self._store.keyword_search_pools(*args, **kwargs)


class PoolSpy:
    """The real store, noting the pools each dense search asks for."""

    def __init__(self, store: MemoryStore) -> None:
        self._store = store
        self.vector_pools: list[Sequence[Pool]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    async def vector_search_pools(self, user_id: str, query: Any, pools: Sequence[Pool]) -> Sequence[Any]:
        self.vector_pools.append(pools)
        return await self._store.vector_search_pools(user_id, query, pools)


async def test_fact_from_one_conversation_is_injected_in_another_and_never_for_another_user(
    store: MemoryStore, embedder: HashingEmbedder
) -> None:
    """Maya's vegetarian fact reaches her new chat's system prompt; Bob asking the same gets none of it."""
    await store.add(
        [
            _fact("maya", "Maya is vegetarian and cooks for two kids", source_ids=("t1",)),
            _turn("maya", "I am vegetarian, by the way", "c1"),
            _fact("bob", "Bob hates mushrooms"),
        ]
    )
    messages = _ask("What should I cook for dinner, something vegetarian?")
    result = await retrieve(store, embedder, messages, "maya", _settings(), NOW, conversation_id="c2")
    injection = inject(messages, result.items, result.query.terms if result.query else (), InjectionSettings())
    system = injection.messages[0]["content"]
    assert system.startswith("You are helpful.\n\n<memory>")
    assert '"Maya is vegetarian and cooks for two kids"' in system
    assert result.arms_ran == [DENSE, BM25, ENTITY]
    other = await retrieve(store, embedder, messages, "bob", _settings(), NOW, conversation_id="c2")
    assert all(c.record.user_id == "bob" for c in other.candidates)
    assert "Maya" not in inject(messages, other.items, (), InjectionSettings()).block


async def test_embedder_down_keeps_bm25_serving(store: MemoryStore) -> None:
    """Without the embedder, the keyword arm still finds the fact and the result says dense is degraded."""
    await store.add([_fact("maya", "Maya's passport number ends in 4471"), _fact("maya", "Maya likes jazz")])
    result = await retrieve(store, FailingEmbedder(), _ask("where is my passport?"), "maya", _settings(), NOW)
    assert result.degraded == {DENSE: "embedder-EmbedderError"}
    assert DENSE not in result.arms_ran
    assert BM25 in result.arms_ran
    assert result.candidates[0].record.text == "Maya's passport number ends in 4471"
    assert not result.gated
    assert DENSE not in result.arms


async def test_embedder_timeout_is_reported_and_bm25_serves(store: MemoryStore) -> None:
    """A hanging embedder costs at most the arm timeout, and BM25 answers."""
    await store.add([_fact("maya", "Maya's passport number ends in 4471")])
    settings = _settings(arm_timeout_ms=400)
    started = asyncio.get_running_loop().time()
    result = await retrieve(store, SlowEmbedder(), _ask("my passport number?"), "maya", settings, NOW)
    assert asyncio.get_running_loop().time() - started < 5.0
    assert result.degraded[DENSE] == "embedder-timeout"
    assert [c.record.text for c in result.candidates] == ["Maya's passport number ends in 4471"]


async def _steps_one_after_the_other(store: MemoryStore, inline: bool) -> HashingEmbedder:
    """The embedder for a test run both ways: with ``inline``, one that embeds on the spot, the user's vectors
    loaded first, so that the read's steps run one after the other in its task (``at_hand``)."""
    if not inline:
        return HashingEmbedder(dim=64)
    embedder = InlineEmbedder(dim=64)
    await retrieve(store, embedder, _ask("anything"), "maya", _settings(), NOW)
    assert at_hand(store, embedder, "maya")
    return embedder


@pytest.mark.parametrize("inline", [False, True])
async def test_keyword_arm_failure_leaves_dense_serving(store: MemoryStore, inline: bool) -> None:
    """When BM25 raises, the dense arm still answers and the header names the failure (steps run as tasks, or
    one after the other)."""
    await store.add([_fact("maya", "Maya plays the saxophone")])
    embedder = await _steps_one_after_the_other(store, inline)
    broken = BrokenKeywordStore(store, error=StoreError("index locked"))
    result = await retrieve(broken, embedder, _ask("saxophone lessons"), "maya", _settings(), NOW)
    assert result.degraded == {BM25: "StoreError"}
    assert result.arms_ran == [DENSE, ENTITY]
    assert result.candidates[0].record.text == "Maya plays the saxophone"


@pytest.mark.parametrize("inline", [False, True])
async def test_keyword_arm_timeout_is_bounded(store: MemoryStore, inline: bool) -> None:
    """A hanging keyword arm is cut at its timeout and the others serve (steps run as tasks, or one after the
    other)."""
    await store.add([_fact("maya", "Maya plays the saxophone")])
    embedder = await _steps_one_after_the_other(store, inline)
    slow = BrokenKeywordStore(store, delay=30.0)
    settings = _settings(arm_timeout_ms=400)
    started = asyncio.get_running_loop().time()
    result = await retrieve(slow, embedder, _ask("saxophone"), "maya", settings, NOW)
    assert asyncio.get_running_loop().time() - started < 5.0
    assert result.degraded[BM25] == "timeout"
    assert result.candidates[0].record.text == "Maya plays the saxophone"


async def test_bm25_only_hit_surfaces(store: MemoryStore, embedder: HashingEmbedder) -> None:
    """A memory the dense arm does not return (k=1) still becomes a candidate through BM25."""
    parcel = _fact("maya", "Maya's parcel ZX4471 left the depot on Monday with the winter coats")
    await store.add([parcel, _fact("maya", "status of order, status of order")])
    settings = _settings(dense_k=1, gating=False, entity_k=0)
    result = await retrieve(store, embedder, _ask("status of order ZX4471"), "maya", settings, NOW)
    by_id = {c.id: c for c in result.candidates}
    assert set(by_id[parcel.id].arm_scores) == {BM25}


async def test_weak_keyword_matches_are_gated(store: MemoryStore, embedder: HashingEmbedder) -> None:
    """BM25 hits sharing one word of a four-word question are gated out, and the result says so."""
    await store.add([_fact("maya", "The agency called about paperwork")])
    question = _ask("Caroline adoption agency interview outcome")
    result = await retrieve(store, embedder, question, "maya", _settings(gating=True), NOW)
    assert result.gated
    assert result.arms[:4] == (DENSE, BM25, ENTITY, "gated")


async def test_turns_of_any_age_are_candidates_by_default(store: MemoryStore, embedder: HashingEmbedder) -> None:
    """With no turn window (the default), a month-old turn is found beside a fact of any age; with a 14-day window
    and nothing past it, only the fact."""
    await store.add(
        [
            _turn("maya", "We talked about tomato seedlings", "c1", days_ago=30),
            _fact("maya", "Maya grows tomato seedlings", days_ago=300),
        ]
    )
    question = _ask("How are my tomato seedlings?")
    result = await retrieve(store, embedder, question, "maya", _settings(), NOW)
    assert {c.record.kind for c in result.candidates} == {Kind.FACT, Kind.TURN}
    window = _settings(turn_window_days=14.0, turns_past_window="none")
    windowed = await retrieve(store, embedder, question, "maya", window, NOW)
    assert [c.record.kind for c in windowed.candidates] == [Kind.FACT]


def _summary(user: str, text: str, conversation: str, start_days_ago: float, end_days_ago: float) -> MemoryRecord:
    """A conversation summary spanning its turns from ``start_days_ago`` to ``end_days_ago``."""
    return MemoryRecord(
        user_id=user,
        kind=Kind.SUMMARY,
        text=text,
        conversation_id=conversation,
        created_at=NOW - timedelta(days=end_days_ago),
        start_at=NOW - timedelta(days=start_days_ago),
        end_at=NOW - timedelta(days=end_days_ago),
    )


async def _seedlings_past_the_window(store: MemoryStore) -> None:
    """Old seedling turns of three conversations: c1 summarised, c2 not, c3 summarised up to its first turn."""
    await store.add(
        [
            _turn("maya", "We talked about tomato seedlings in the summarised chat", "c1", days_ago=40),
            _summary("maya", "Maya and the assistant discussed tomato seedlings", "c1", 40, 40),
            _turn("maya", "Tomato seedlings again, in a chat nobody summarised", "c2", days_ago=30),
            _turn("maya", "Early tomato seedlings note of c3", "c3", days_ago=25),
            _summary("maya", "Tomato seedlings were planned in c3", "c3", 25, 25),
            _turn("maya", "Late tomato seedlings note of c3", "c3", days_ago=20),
            _fact("maya", "Maya grows tomato seedlings", days_ago=300),
        ]
    )


async def test_past_the_window_a_summary_stands_in_for_the_turns_it_covers(
    store: MemoryStore, embedder: HashingEmbedder
) -> None:
    """With a 14-day window, a turn past it is hidden only where its conversation's summary covers it; turns no
    summary tells (an unsummarised chat, a tail after the summary) stay, and so do summaries and facts."""
    await _seedlings_past_the_window(store)
    question = _ask("How are my tomato seedlings?")
    for names in (None, ReadCache()):  # coverage loaded from the store, or through the read cache
        settings = _settings(turn_window_days=14.0)
        result = await retrieve(store, embedder, question, "maya", settings, NOW, names=names)
        found = {c.record.text for c in result.candidates}
        assert found == {
            "Maya and the assistant discussed tomato seedlings",
            "Tomato seedlings again, in a chat nobody summarised",
            "Tomato seedlings were planned in c3",
            "Late tomato seedlings note of c3",
            "Maya grows tomato seedlings",
        }


async def test_past_the_window_none_keeps_only_summaries_and_facts(
    store: MemoryStore, embedder: HashingEmbedder
) -> None:
    """``turns_past_window = "none"`` hides every turn past the window; old summaries and facts stay."""
    await _seedlings_past_the_window(store)
    settings = _settings(turn_window_days=14.0, turns_past_window="none")
    result = await retrieve(store, embedder, _ask("How are my tomato seedlings?"), "maya", settings, NOW)
    assert {c.record.kind for c in result.candidates} == {Kind.FACT, Kind.SUMMARY}


async def test_superseded_facts_are_never_retrieved(store: MemoryStore, embedder: HashingEmbedder) -> None:
    """After "we moved to Paris", only the current city comes back."""
    london = _fact("maya", "Maya lives in London", days_ago=60)
    await store.add([london])
    await store.supersede("maya", london.id, _fact("maya", "Maya lives in Paris", days_ago=1))
    result = await retrieve(store, embedder, _ask("Which city do I live in?"), "maya", _settings(), NOW)
    assert [c.record.text for c in result.candidates] == ["Maya lives in Paris"]


async def test_insights_and_recent_activity_are_offered(store: MemoryStore, embedder: HashingEmbedder) -> None:
    """Current insights and the last user messages of other chats are items; this chat's are not."""
    insight = MemoryRecord(
        user_id="maya",
        kind=Kind.INSIGHT,
        text="Maya is learning to bake sourdough",
        confidence=0.9,
        start_at=NOW - timedelta(days=50),
        end_at=NOW - timedelta(days=2),
        created_at=NOW - timedelta(days=2),
    )
    old_insight = insight.replace(id="old-insight", text="Maya runs marathons", valid=False)
    await store.add(
        [
            insight,
            old_insight,
            _turn("maya", "Printer ink is so expensive", "c1", days_ago=0.5),
            _turn("maya", "Sure, here are some inks", "c1", days_ago=0.49, role="assistant"),
            _turn("maya", "Hello again in this chat", "c9", days_ago=0.1),
        ]
    )
    settings = _settings()
    result = await retrieve(store, embedder, _ask("hi"), "maya", settings, NOW, conversation_id="c9")
    sections = {(i.section, i.text) for i in result.items}
    assert (Section.INSIGHTS, "Maya is learning to bake sourdough") in sections
    assert (Section.RECENT, "Printer ink is so expensive") in sections
    texts = {i.text for i in result.items}
    assert "Maya runs marathons" not in texts
    assert "Sure, here are some inks" not in {i.text for i in result.items if i.section is Section.RECENT}
    assert "Hello again in this chat" not in {i.text for i in result.items if i.section is Section.RECENT}


async def test_entity_arm_surfaces_memories_by_name(store: MemoryStore, embedder: HashingEmbedder) -> None:
    """A memory tagged "Caroline" comes back for a question naming her, though it shares no other word."""
    tagged = _fact("maya", "She started a counselling course", entities=("Caroline",))
    await store.add([tagged, *(_fact("maya", f"Filler memory number {i}") for i in range(5))])
    settings = _settings(dense_k=1, gating=False)
    result = await retrieve(store, embedder, _ask("What is caroline up to?"), "maya", settings, NOW)
    by_id = {c.id: c for c in result.candidates}
    assert by_id[tagged.id].arm_scores[ENTITY] == 1.0


async def test_a_common_name_only_lifts_what_other_arms_found(store: MemoryStore, embedder: HashingEmbedder) -> None:
    """A name on more memories than entity_surface_max brings none of them in; it boosts the ones found."""
    tagged = [_fact("maya", f"Note {i} about the garden", entities=("Maya",)) for i in range(12)]
    await store.add(tagged)
    settings = _settings(dense_k=2, bm25_k=2, gating=False, entity_surface_max=10)
    result = await retrieve(store, embedder, _ask("What did Maya plant in the garden?"), "maya", settings, NOW)
    with_name = [c for c in result.candidates if ENTITY in c.arm_scores]
    assert with_name
    assert all({DENSE, BM25} & set(c.arm_scores) for c in with_name)
    assert len(result.candidates) <= 4


def test_entity_hits_join_surfaced_and_found_memories() -> None:
    """Entity hits are the surfaced memories plus found ones carrying a named name, best first."""
    rare = _fact("maya", "Priya got the job")
    common = _fact("maya", "Maya watered the plants")
    other = _fact("maya", "Unrelated")
    found = [[ArmHit(common, 0.9), ArmHit(other, 0.8)]]
    hits = entity_hits({rare.id: 1.0, common.id: 0.2}, [rare], found)
    assert [(h.record.id, h.score) for h in hits] == [(rare.id, 1.0), (common.id, 0.2)]


async def test_subject_fusion_lifts_linked_memories(store: MemoryStore, embedder: HashingEmbedder) -> None:
    """A memory linked to a subject close to the query is lifted by lambda x cos."""
    linked = _fact("maya", "Bought a used Fender last week")
    other = _fact("maya", "Bought a used bicycle last week")
    subject = MemoryRecord(
        user_id="maya", kind=Kind.SUBJECT, text="guitar music", subject_kind="topic", source_ids=(linked.id,)
    )
    await store.add([linked, other, subject])
    settings = _settings(subject_weight=0.4)  # off by default
    result = await retrieve(store, embedder, _ask("guitar music gear I bought"), "maya", settings, NOW)
    by_id = {c.id: c for c in result.candidates}
    assert by_id[linked.id].boosts.get("subject", 0.0) > 0.0
    assert "subject" not in by_id[other.id].boosts
    assert subject.id not in by_id


async def test_name_index_cache_serves_until_invalidated(store: MemoryStore, embedder: HashingEmbedder) -> None:
    """A cached name index does not see a new name until it is invalidated (or its TTL passes)."""
    cache = ReadCache(ttl_s=3600)
    question = _ask("Any news from Priya?")
    settings = _settings(dense_k=1, bm25_k=1)
    await retrieve(store, embedder, question, "maya", settings, NOW, names=cache)
    news = _fact("maya", "She got the job in Lisbon", entities=("Priya",))
    await store.add([news])
    stale = await retrieve(store, embedder, question, "maya", settings, NOW, names=cache)
    assert all(ENTITY not in c.arm_scores for c in stale.candidates)
    cache.invalidate("maya")
    fresh = await retrieve(store, embedder, question, "maya", settings, NOW, names=cache)
    assert {c.id: c.arm_scores.get(ENTITY) for c in fresh.candidates}[news.id] == 1.0


async def test_subject_search_is_skipped_once_the_user_is_known_to_have_no_subjects(
    store: MemoryStore, embedder: HashingEmbedder
) -> None:
    """The first request searches subjects; once the cached name index shows none, requests skip that search."""
    await store.add([_fact("maya", "Maya collects jazz records", entities=("Maya",))])
    cache = ReadCache(ttl_s=3600)
    question = _ask("Which records does Maya collect?")
    spy = PoolSpy(store)
    first = await retrieve(spy, embedder, question, "maya", _settings(subject_weight=0.4), NOW, names=cache)
    later = await retrieve(spy, embedder, question, "maya", _settings(subject_weight=0.4), NOW, names=cache)
    first_kinds, later_kinds = ({k for pool in pools for k in pool.kinds} for pools in spy.vector_pools)
    assert Kind.SUBJECT in first_kinds
    assert Kind.SUBJECT not in later_kinds
    assert [c.id for c in later.candidates] == [c.id for c in first.candidates]


async def test_read_cache_serves_insights_and_recent_turns_until_they_expire(
    store: MemoryStore, embedder: HashingEmbedder
) -> None:
    """Insights stay cached for ttl_s; the newest turns only for recent_ttl_s, so a new message shows soon."""
    cache = ReadCache(ttl_s=3600, recent_ttl_s=0.0)
    insight = MemoryRecord(user_id="maya", kind=Kind.INSIGHT, text="Maya bakes on weekends", confidence=0.8)
    await store.add([insight, _turn("maya", "First message elsewhere", "c1", days_ago=0.2)])
    settings = _settings()
    await retrieve(store, embedder, _ask("hi"), "maya", settings, NOW, conversation_id="c9", names=cache)
    newer = MemoryRecord(user_id="maya", kind=Kind.INSIGHT, text="Maya is training for a 10k", confidence=0.9)
    await store.add([newer, _turn("maya", "Second message elsewhere", "c2", days_ago=0.1)])
    again = await retrieve(store, embedder, _ask("hi"), "maya", settings, NOW, conversation_id="c9", names=cache)
    texts = {(i.section, i.text) for i in again.items}
    assert (Section.RECENT, "Second message elsewhere") in texts
    assert (Section.INSIGHTS, "Maya is training for a 10k") not in texts
    cache.invalidate("maya")
    fresh = await retrieve(store, embedder, _ask("hi"), "maya", settings, NOW, conversation_id="c9", names=cache)
    assert (Section.INSIGHTS, "Maya is training for a 10k") in {(i.section, i.text) for i in fresh.items}


async def test_expired_insights_are_served_while_they_reload(store: MemoryStore, embedder: HashingEmbedder) -> None:
    """Past its lifetime the cached insight set still serves (no request waits for the listing) and is replaced
    by a reload in the background; the next request sees the new set."""
    cache = ReadCache(ttl_s=0.0)
    old = MemoryRecord(user_id="maya", kind=Kind.INSIGHT, text="Maya bakes on weekends", generation_id="g1")
    await store.add([old])
    settings = _settings()
    await retrieve(store, embedder, _ask("hi"), "maya", settings, NOW, names=cache)
    new = MemoryRecord(user_id="maya", kind=Kind.INSIGHT, text="Maya trains for a 10k", generation_id="g2")
    await store.add([new])
    stale = await retrieve(store, embedder, _ask("hi"), "maya", settings, NOW, names=cache)
    await asyncio.wait_for(cache.wait_for_loads(), 10)
    fresh = await retrieve(store, embedder, _ask("hi"), "maya", settings, NOW, names=cache)
    assert [i.text for i in stale.items if i.section is Section.INSIGHTS] == ["Maya bakes on weekends"]
    assert [i.text for i in fresh.items if i.section is Section.INSIGHTS] == ["Maya trains for a 10k"]


async def test_prebuilt_name_index_is_used_as_given(store: MemoryStore, embedder: HashingEmbedder) -> None:
    """A caller-built index (as the LoCoMo harness builds one) drives the entity arm."""
    fact = _fact("maya", "Went to the pottery class")
    await store.add([fact])
    index = NameIndex.build([fact.replace(entities=("Melanie",))])
    result = await retrieve(store, embedder, _ask("what did melanie do"), "maya", _settings(), NOW, names=index)
    assert result.candidates[0].arm_scores.get(ENTITY) == 1.0


async def test_no_user_text_means_no_retrieval(store: MemoryStore, embedder: HashingEmbedder) -> None:
    """A request without user text runs no arm and injects nothing."""
    result = await retrieve(store, embedder, [{"role": "system", "content": "x"}], "maya", _settings(), NOW)
    assert result.query is None
    assert result.items == []
    assert result.arms == ()
    assert result.degraded == {}


async def test_timings_cover_every_step(store: MemoryStore, embedder: HashingEmbedder) -> None:
    """The result carries per-step timings for the metrics and the X-Memory-Retrieval-Ms header."""
    await store.add([_fact("maya", "Maya likes jazz")])
    result = await retrieve(store, embedder, _ask("jazz"), "maya", _settings(), NOW)
    assert {"embedder", DENSE, BM25, ENTITY, "fusion", "total"} <= set(result.timings_ms)
    assert result.timings_ms["total"] >= result.timings_ms["fusion"]


def _candidate(record: MemoryRecord, final: float) -> Candidate:
    """A scored candidate."""
    return Candidate(record=record, arm_scores={DENSE: final}, fused=final, final=final)


def test_plan_caps_facts_and_past_by_settings() -> None:
    """Only the best max_facts facts and max_past turns become items, scaled into [0, 1]."""
    facts = [_candidate(_fact("maya", f"fact {i}"), 3.0 - i / 10) for i in range(5)]
    turns = [_candidate(_turn("maya", f"turn {i}", "c1"), 2.0 - i / 10) for i in range(5)]
    settings = _settings(max_facts=2, max_past=1, scoring="minmax")  # totals up to 3, the sum of its weights
    items = plan_items([*facts, *turns], [], [], NOW, settings)
    assert [(i.section, i.text) for i in items] == [
        (Section.ABOUT_USER, "fact 0"),
        (Section.ABOUT_USER, "fact 1"),
        (Section.PAST, "turn 0"),
    ]
    assert items[0].score == pytest.approx(1.0)


def test_plan_keeps_bounded_scores_as_they_are() -> None:
    """With the default scoring, final scores are already in [0, 1] and become item scores unchanged."""
    items = plan_items([_candidate(_fact("maya", "fact"), 0.8)], [], [], NOW, _settings())
    assert [i.score for i in items] == [pytest.approx(0.8)]


def test_summary_cooldown_skips_a_summary_injected_minutes_ago() -> None:
    """With a cooldown set, a summary injected 5 minutes ago is left out; with none it stays."""
    summary = MemoryRecord(
        user_id="maya",
        kind=Kind.SUMMARY,
        text="Planned the Lisbon trip",
        created_at=NOW - timedelta(days=3),
        last_accessed_at=NOW - timedelta(minutes=5),
    )
    candidates = [_candidate(summary, 1.0)]
    assert plan_items(candidates, [], [], NOW, _settings()) != []
    assert plan_items(candidates, [], [], NOW, _settings(summary_cooldown_minutes=30)) == []


def test_recent_message_that_is_also_relevant_is_listed_once() -> None:
    """A relevant message from another chat appears under recent activity only, with its better score."""
    turn = _turn("maya", "Printer ink is so expensive", "c1", days_ago=0.5)
    items = plan_items([_candidate(turn, 3.0)], [], [turn], NOW, _settings(scoring="minmax"))
    assert [(i.section, i.score) for i in items] == [(Section.RECENT, pytest.approx(1.0))]


async def test_gated_rerank_orders_the_head_when_the_arms_disagree(
    store: MemoryStore, embedder: HashingEmbedder
) -> None:
    """Dense and BM25 disagree on first place: the reranker's order wins and the arms say rerank; a slow
    reranker leaves the fused order and reports rerank degraded by a timeout."""
    plan = _fact("maya", "what is the plan of the day")  # shares stop words with the question: dense's first
    dog = _fact("maya", "Maya's dog is called Rex")  # shares "dog": BM25's first
    await store.add([plan, dog, _fact("maya", "Maya's cat is called Tom")])
    question = _ask("what is the name of the dog")
    fused = await retrieve(store, embedder, question, "maya", _settings(), NOW)
    async with FakeRerank() as fake:
        settings = RerankSettings(enabled=True, api_base=fake.api_base, api_key="k")
        async with Reranker(settings) as reranker:
            reranked = await retrieve(store, embedder, question, "maya", _settings(), NOW, reranker=reranker)
    wanted = [
        t
        for t, _ in sorted(
            ((c.record.text, relevance("what is the name of the dog", c.record.text)) for c in fused.candidates),
            key=lambda p: -p[1],
        )
    ]
    assert len(fake.calls) == 1
    assert [c.record.text for c in reranked.candidates] == wanted
    assert "rerank" in reranked.arms
    async with FakeRerank(delay_s=5) as slow:
        settings = RerankSettings(enabled=True, api_base=slow.api_base, api_key="k", timeout_ms=200)
        async with Reranker(settings) as reranker:
            late = await retrieve(store, embedder, question, "maya", _settings(), NOW, reranker=reranker)
    assert [c.id for c in late.candidates] == [c.id for c in fused.candidates]
    assert late.degraded["rerank"] == "timeout"


async def test_a_regeneration_in_progress_never_injects_two_insight_sets(
    store: MemoryStore, embedder: HashingEmbedder
) -> None:
    """While a new insight set is added and the old one not yet retired, only the new set is injected."""

    def insight(text: str, generation: str, days_ago: float) -> MemoryRecord:
        return MemoryRecord(user_id="maya", kind=Kind.INSIGHT, text=text, generation_id=generation, confidence=0.8,
                            created_at=NOW - timedelta(days=days_ago))  # fmt: skip

    await store.add([insight("Maya cooks Italian food", "old", 30), insight("Maya trains for a marathon", "new", 0)])
    result = await retrieve(store, embedder, _ask("Any plans?"), "maya", _settings(), NOW)
    assert [item.text for item in result.items if item.section is Section.INSIGHTS] == ["Maya trains for a marathon"]


async def test_steps_run_one_after_the_other_only_when_nothing_waits_and_find_the_same(store: MemoryStore) -> None:
    """A read runs its steps in its own task only when the store holds the user's vectors and the embedder embeds
    on the spot; either way it finds the same candidates and items."""
    await store.add(
        [
            _fact("maya", "Maya plays the saxophone", entities=("Maya",)),
            _fact("maya", "Maya's sister Ana teaches piano", entities=("Ana",)),
            _turn("maya", "I practised scales for an hour", "c1"),
        ]
    )
    inline, plain = InlineEmbedder(dim=64), HashingEmbedder(dim=64)
    assert not at_hand(store, inline, "maya")  # not loaded yet: the first read may wait on LanceDB
    first = await retrieve(store, inline, _ask("How is Ana's piano teaching going?"), "maya", _settings(), NOW)
    assert at_hand(store, inline, "maya")
    assert not at_hand(store, plain, "maya")
    assert not at_hand(store, inline, "bob")
    for question in ("How is Ana's piano teaching going?", "saxophone practice"):
        together = await retrieve(store, plain, _ask(question), "maya", _settings(), NOW, conversation_id="c2")
        in_turn = await retrieve(store, inline, _ask(question), "maya", _settings(), NOW, conversation_id="c2")
        assert [(c.id, c.final) for c in in_turn.candidates] == [(c.id, c.final) for c in together.candidates]
        assert in_turn.items == together.items
        assert in_turn.arms_ran == together.arms_ran
    assert first.candidates
