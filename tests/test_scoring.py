"""Tests of final scoring: the bounded default (relevance x a bounded time and importance bonus) and the
seed's min-max sum (``scoring = "minmax"``, with its worked "Maya" example)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.memory.read.candidates import Candidate
from proxy.memory.read.retrieval_settings import RetrievalSettings
from proxy.memory.read.scoring import (
    DAY_S,
    bounded_scores,
    combined_scores,
    dominance_ratio,
    final_scale,
    hours_since_access,
    recency,
    recency_weights,
    score_candidates,
)
from proxy.memory.store.records import Kind, MemoryRecord

NOW = datetime(2026, 6, 1, 12, tzinfo=UTC)
MINMAX = RetrievalSettings(scoring="minmax")

# The worked example of issue 4: (memory, relevance, hours since last access, importance, expected total).
MAYA = [
    ("Sam's birthday is June 18", 0.6942, 2000, 8, 2.00),
    ("Maya loves vinyl and jazz", 0.6627, 1992, 6, 1.62),
    ("Maya is vegetarian", 0.3721, 120, 6, 1.34),
    ("Maya has two kids", 0.4058, 300, 7, 1.25),
    ("Maya saved a pasta recipe", 0.4227, 26, 2, 1.24),
    ("Maya needs printer ink", 0.3880, 1, 1, 1.12),
    ("Maya is a data engineer", 0.3475, 1500, 5, 0.57),
    ("Maya likes hiking", 0.3744, 700, 4, 0.54),
]


def _candidate(text: str, relevance: float, hours: float, importance: int) -> Candidate:
    """A fused candidate last accessed ``hours`` before NOW."""
    record = MemoryRecord(
        user_id="maya",
        kind=Kind.FACT,
        text=text,
        importance=importance,
        created_at=NOW - timedelta(days=400),
        last_accessed_at=NOW - timedelta(hours=hours),
    )
    return Candidate(record=record, arm_scores={"dense": relevance}, fused=relevance)


def test_maya_example_reproduces_the_worked_order_and_totals() -> None:
    """With the minmax formula and weights 1/1/1 the eight memories come out in the table's order and totals."""
    shuffled = [_candidate(t, r, h, i) for t, r, h, i, _ in reversed(MAYA)]
    scored = score_candidates(shuffled, NOW, MINMAX)
    assert [c.record.text for c in scored] == [row[0] for row in MAYA]
    assert [c.final for c in scored] == pytest.approx([row[4] for row in MAYA], abs=0.01)


def test_recency_is_0995_per_hour_since_last_access() -> None:
    """A memory used an hour ago scores 0.995, a week ago ~0.43; without access, creation counts."""
    record = MemoryRecord(user_id="u", kind=Kind.FACT, text="x", created_at=NOW - timedelta(days=30))
    assert recency(record.replace(last_accessed_at=NOW - timedelta(hours=1)), NOW) == pytest.approx(0.995)
    assert recency(record.replace(last_accessed_at=NOW - timedelta(days=7)), NOW) == pytest.approx(0.995**168)
    assert hours_since_access(record, NOW) == pytest.approx(720)


def test_injection_restarts_the_recency_clock() -> None:
    """An old memory injected just now (last_accessed_at = now) is as recent as a new one."""
    old = MemoryRecord(user_id="u", kind=Kind.FACT, text="x", created_at=NOW - timedelta(days=300))
    assert recency(old.replace(last_accessed_at=NOW), NOW) == 1.0


def test_weights_come_from_settings() -> None:
    """With recency and importance weighted 0, only relevance orders the memories."""
    candidates = [_candidate(t, r, h, i) for t, r, h, i, _ in MAYA]
    settings = RetrievalSettings(scoring="minmax", recency_weight=0.0, importance_weight=0.0)
    scored = score_candidates(candidates, NOW, settings)
    assert [c.fused for c in scored] == sorted((c.fused for c in candidates), reverse=True)
    assert scored[0].final == 1.0


def test_clock_skew_never_makes_a_memory_more_than_new() -> None:
    """A last access in the future (clock skew) counts as now, not as a recency above 1."""
    record = MemoryRecord(user_id="u", kind=Kind.FACT, text="x", created_at=NOW + timedelta(hours=5))
    assert recency(record, NOW) == 1.0


_signal = st.lists(st.floats(0, 1000), min_size=1, max_size=20)


@given(_signal, st.floats(0, 3), st.floats(0, 3), st.floats(0, 3))
def test_totals_stay_within_the_sum_of_weights(values: list[float], a: float, b: float, c: float) -> None:
    """Each normalised signal is in [0, 1], so a total is between 0 and the sum of the weights."""
    totals = combined_scores(values, list(reversed(values)), values, (a, b, c))
    assert all(-1e-9 <= t <= a + b + c + 1e-9 for t in totals)


@given(st.lists(st.integers(1, 10), min_size=2, max_size=10))
def test_more_important_never_ranks_lower_when_all_else_is_equal(importance: list[int]) -> None:
    """Between memories equal in relevance and recency, the more important one is never below."""
    candidates = [_candidate(f"m{i}", 0.5, 10, imp) for i, imp in enumerate(importance)]
    scored = score_candidates(candidates, NOW, MINMAX)
    ranks = [c.record.importance for c in scored]
    assert ranks == sorted(ranks, reverse=True)


# --- the bounded default ----------------------------------------------------------------------------------


def _created(text: str, relevance: float, age: timedelta, importance: int = 5) -> Candidate:
    """A fused candidate created ``age`` before NOW (and injected just now, which must not make it current)."""
    record = MemoryRecord(
        user_id="u", kind=Kind.FACT, text=text, importance=importance, created_at=NOW - age, last_accessed_at=NOW
    )
    return Candidate(record=record, arm_scores={"dense": relevance}, fused=relevance)


def test_the_newer_of_two_near_identical_memories_wins() -> None:
    """Two facts equally relevant, one told a month after the other: the newer one ranks first."""
    old = _created("I live in London", 0.80, timedelta(days=40))
    new = _created("I moved from London to Paris", 0.79, timedelta(days=2))
    scored = score_candidates([old, new], NOW, RetrievalSettings(recency_bonus=0.1, recency_half_life_days=30))
    assert [c.record.text for c in scored] == ["I moved from London to Paris", "I live in London"]


def test_minutes_apart_the_more_relevant_memory_wins() -> None:
    """Twelve near-identical facts told minutes apart: age barely differs, so the most relevant stays first."""
    facts = [_created(f"locker code {i}", 0.9 if i == 0 else 0.85, timedelta(minutes=60 - 5 * i)) for i in range(12)]
    scored = score_candidates(facts, NOW, RetrievalSettings(recency_bonus=0.3, recency_half_life_days=1))
    assert scored[0].record.text == "locker code 0"


def test_minmax_buries_the_relevant_memory_that_bounded_keeps() -> None:
    """The seed's formula ranks the newest of near-identical facts first (issue 12); the default does not."""
    relevance = [0.86, 0.80, *[0.85] * 10]  # the asked one most relevant, by little (they read alike)
    facts = [_created(f"locker code {i}", r, timedelta(minutes=60 - 5 * i)) for i, r in enumerate(relevance)]
    facts = [Candidate(c.record.replace(last_accessed_at=None), c.arm_scores, c.fused) for c in facts]
    assert score_candidates(facts, NOW, MINMAX)[0].record.text == "locker code 11"
    assert score_candidates(facts, NOW, RetrievalSettings())[0].record.text == "locker code 0"


def test_recency_halves_every_half_life_in_absolute_days() -> None:
    """The weight is 1 for a memory created now, 1/2 after one half-life, 1/4 after two; the future counts as now."""
    weights = recency_weights([0.0, 30 * DAY_S, 60 * DAY_S, -5.0], 30.0)
    assert weights.tolist() == pytest.approx([1.0, 0.5, 0.25, 1.0])


def test_bounded_scores_lie_in_zero_one_and_the_best_possible_scores_one() -> None:
    """A brand-new importance-10 memory that is the most relevant scores exactly 1; none scores above."""
    settings = RetrievalSettings(recency_bonus=0.2, importance_bonus=0.1)
    scores = bounded_scores(np.array([2.0, 1.0, 0.0]), np.array([0.0, 5 * DAY_S, 0.0]), np.array([10, 1, 5]), settings)
    assert scores[0] == pytest.approx(1.0)
    assert all(0.0 <= s <= 1.0 for s in scores)
    assert final_scale(settings) == 1.0


def test_recency_lifts_facts_not_turns() -> None:
    """A turn said yesterday gets no recency bonus over an equally relevant turn of last year; a fact does."""

    def turn(age: timedelta) -> Candidate:
        record = MemoryRecord(user_id="u", kind=Kind.TURN, text=f"turn {age.days}", created_at=NOW - age)
        return Candidate(record=record, arm_scores={"bm25": 1.0}, fused=0.5)

    scored = score_candidates([turn(timedelta(days=365)), turn(timedelta(days=1))], NOW, RetrievalSettings())
    assert scored[0].final == scored[1].final
    facts = [_created("old", 0.5, timedelta(days=365)), _created("new", 0.5, timedelta(days=1))]
    assert score_candidates(facts, NOW, RetrievalSettings())[0].record.text == "new"


def test_no_relevance_scores_zero() -> None:
    """Without any relevant candidate (all fused scores 0, or none at all) every final score is 0."""
    settings = RetrievalSettings()
    assert bounded_scores(np.zeros(3), np.zeros(3), np.full(3, 5), settings).tolist() == [0.0, 0.0, 0.0]
    assert bounded_scores(np.zeros(0), np.zeros(0), np.zeros(0), settings).size == 0


_settings = st.builds(
    RetrievalSettings,
    recency_bonus=st.floats(0, 1),
    recency_half_life_days=st.floats(0.1, 400),
    importance_bonus=st.floats(0, 0.5),
)


@given(
    _settings,
    st.floats(0.01, 10),
    st.floats(1.0, 5.0),
    st.lists(st.tuples(st.floats(0, 1e9), st.integers(1, 10)), min_size=2, max_size=2),
)
def test_time_and_importance_never_overturn_a_clear_relevance_lead(
    settings: RetrievalSettings, relevance: float, lead: float, signals: list[tuple[float, int]]
) -> None:
    """Whatever the ages and ratings, a memory more relevant than another by more than the dominance ratio
    scores higher."""
    better = relevance * dominance_ratio(settings) * lead * 1.0001
    (age_a, imp_a), (age_b, imp_b) = signals
    scores = bounded_scores([better, relevance], [age_a, age_b], [imp_a, imp_b], settings)
    assert scores[0] > scores[1]
