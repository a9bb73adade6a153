"""Gated rerank: the disagreement gate, the reordering, and real litellm calls to a fake Cohere rerank API."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator

import pytest
from structlog.testing import capture_logs

from proxy.memory.read.candidates import ArmHit, Candidate
from proxy.memory.read.rerank import Reranker, RerankSettings, disagree, reordered
from proxy.memory.store.records import Kind, MemoryRecord
from tests.support.fake_rerank import FakeRerank

KEY = "sk-rerank-test-4f2a9c"
QUERY = "where did Maya hike in Patagonia"
TEXTS = [
    "Maya likes pasta",  # fused 1st
    "Maya went hiking last spring",  # fused 2nd
    "Maya hiked Torres del Paine in Patagonia",  # fused 3rd
    "the weather was cold",  # fused 4th, outside top_n
    "where did I leave my keys",  # fused 5th, outside top_n
]


def record(text: str, rid: str) -> MemoryRecord:
    """A fact of one user with a readable id."""
    return MemoryRecord(user_id="u1", kind=Kind.FACT, text=text, id=rid)


def fused_candidates() -> list[Candidate]:
    """Five candidates in fused order, best first, with falling fused scores."""
    return [Candidate(record(text, f"m{i}"), {"bm25": 1.0}, fused=1.0 - 0.1 * i) for i, text in enumerate(TEXTS)]


def hits(*pairs: tuple[str, float]) -> list[ArmHit]:
    """Arm hits from (record id, score) pairs, in the given (not necessarily sorted) order."""
    return [ArmHit(record(rid, rid), score) for rid, score in pairs]


def settings(api_base: str, **changes: object) -> RerankSettings:
    """Enabled rerank settings against the fake, with a short timeout and top_n=3."""
    values: dict[str, object] = {"enabled": True, "api_base": api_base, "api_key": KEY, "top_n": 3}
    values.update(changes)
    return RerankSettings.model_validate(values)


@pytest.fixture
async def fake() -> AsyncIterator[FakeRerank]:
    """A fake rerank API answering at once."""
    async with FakeRerank() as server:
        yield server


# --- the gate ---------------------------------------------------------------------------------------------


def test_arms_with_different_first_places_disagree() -> None:
    """Dense's best memory differing from BM25's best triggers the rerank."""
    assert disagree(hits(("a", 0.9), ("b", 0.5)), hits(("b", 7.0), ("a", 3.0)))


def test_arms_with_the_same_first_place_agree() -> None:
    """Both arms ranking the same memory first skip the rerank, whatever follows it."""
    assert not disagree(hits(("a", 0.9), ("b", 0.5)), hits(("a", 7.0), ("c", 6.0)))


def test_first_place_is_the_best_score_not_the_list_position() -> None:
    """An arm's first place is its best-scoring hit even when its hits come unsorted."""
    assert not disagree(hits(("b", 0.2), ("a", 0.9)), hits(("a", 7.0), ("b", 3.0)))


def test_a_silent_arm_never_disagrees() -> None:
    """Without hits from one of the arms (failed, gated or empty) nothing is reranked."""
    assert not disagree(hits(("a", 0.9)), [])
    assert not disagree([], hits(("a", 7.0)))


def test_disabled_reranker_never_wants_a_rerank() -> None:
    """The rerank is off by default, even when the arms disagree."""
    reranker = Reranker(RerankSettings())
    assert not reranker.wanted(hits(("a", 0.9)), hits(("b", 7.0)))
    assert Reranker(RerankSettings(enabled=True)).wanted(hits(("a", 0.9)), hits(("b", 7.0)))


# --- the reordering ---------------------------------------------------------------------------------------


def test_reordered_keeps_fused_scores_sorted_and_the_tail_untouched() -> None:
    """The reranked head takes the head's fused scores in its new order, so scoring still sees that order."""
    candidates = fused_candidates()
    out = reordered(candidates, 3, [2, 0, 1])
    assert [c.id for c in out] == ["m2", "m0", "m1", "m3", "m4"]
    assert [c.fused for c in out] == [c.fused for c in candidates]
    assert out[3:] == candidates[3:]


def test_reordered_ignores_bad_indices_and_keeps_unranked_head_items() -> None:
    """A reranker answer with repeated, out-of-range or missing indices still yields every candidate once."""
    out = reordered(fused_candidates(), 3, [1, 1, 9, -1])
    assert [c.id for c in out] == ["m1", "m0", "m2", "m3", "m4"]


# --- real litellm against the fake ------------------------------------------------------------------------


async def test_rerank_reorders_the_top_n_by_the_models_scores(fake: FakeRerank) -> None:
    """The memory the cross-encoder finds most relevant moves first; candidates past top_n keep fused order."""
    async with Reranker(settings(fake.api_base)) as reranker:
        result = await reranker.rerank(QUERY, fused_candidates())
    assert result.candidates is not None
    assert [c.record.text for c in result.candidates] == [TEXTS[2], TEXTS[0], TEXTS[1], TEXTS[3], TEXTS[4]]
    assert result.degraded is None
    assert [call.body["documents"] for call in fake.calls] == [TEXTS[:3]]
    assert fake.calls[0].path == "/v2/rerank"


async def test_slow_reranker_times_out_to_the_fused_order() -> None:
    """A reranker slower than timeout_ms costs the request at most about timeout_ms, then fused order stands."""
    async with FakeRerank(delay_s=3.0) as slow, Reranker(settings(slow.api_base, timeout_ms=300)) as reranker:
        started = time.perf_counter()
        with capture_logs() as logs:
            result = await reranker.rerank(QUERY, fused_candidates())
        elapsed = time.perf_counter() - started
    assert result.candidates is None
    assert result.degraded == "rerank:timeout"
    assert elapsed < 0.3 + 0.5
    assert [(e["event"], e["reason"]) for e in logs] == [("memory.rerank_failed", "timeout")]


async def test_reranker_error_falls_back_without_raising() -> None:
    """A 500 from the rerank API leaves the fused order and names the error class, not its message."""
    # (five seconds for the call: under a loaded machine the 800 ms default was met first, and the reason
    # was ``timeout``; the error's class is what this test is about)
    async with FakeRerank(status=500) as broken, Reranker(settings(broken.api_base, timeout_ms=5000)) as reranker:
        with capture_logs() as logs:
            result = await reranker.rerank(QUERY, fused_candidates())
    assert result.candidates is None
    assert result.reason == "InternalServerError"
    assert [e["reason"] for e in logs if e["event"] == "memory.rerank_failed"] == ["InternalServerError"]


async def test_unreachable_reranker_falls_back_without_raising() -> None:
    """A rerank API that refuses connections degrades the rerank instead of failing the request."""
    async with FakeRerank() as gone:
        api_base = gone.api_base
    async with Reranker(settings(api_base)) as reranker:
        result = await reranker.rerank(QUERY, fused_candidates())
    assert result.candidates is None
    assert result.degraded is not None
    assert result.degraded.startswith("rerank:")


async def test_a_single_candidate_is_not_sent(fake: FakeRerank) -> None:
    """With fewer than two candidates there is nothing to reorder, so no rerank call is made."""
    async with Reranker(settings(fake.api_base)) as reranker:
        result = await reranker.rerank(QUERY, fused_candidates()[:1])
    assert result.candidates is not None
    assert [c.id for c in result.candidates] == ["m0"]
    assert fake.calls == []


async def test_api_key_is_sent_but_never_logged(caplog: pytest.LogCaptureFixture) -> None:
    """The key reaches the rerank API as a bearer token, yet no log line, repr or failure report shows it."""
    caplog.set_level(logging.DEBUG)
    async with FakeRerank(status=500) as broken, Reranker(settings(broken.api_base)) as reranker:
        with capture_logs() as logs:
            result = await reranker.rerank(QUERY, fused_candidates())
    assert broken.calls[0].authorization == f"Bearer {KEY}"
    shown = [repr(logs), caplog.text, repr(reranker.settings), repr(result)]
    assert not [text for text in shown if KEY in text]
    assert "Patagonia" not in repr(logs)
    assert "pasta" not in repr(logs)
