"""Tests of final scoring: relevance + recency + importance, each min-max normalised."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.memory.fusion import Candidate
from proxy.memory.records import Kind, MemoryRecord
from proxy.memory.retrieval_settings import RetrievalSettings
from proxy.memory.scoring import combined_scores, hours_since_access, recency, score_candidates

NOW = datetime(2026, 6, 1, 12, tzinfo=UTC)

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
    """With weights 1/1/1 (the defaults) the eight memories come out in the table's order and totals."""
    shuffled = [_candidate(t, r, h, i) for t, r, h, i, _ in reversed(MAYA)]
    scored = score_candidates(shuffled, NOW, RetrievalSettings())
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
    settings = RetrievalSettings(recency_weight=0.0, importance_weight=0.0)
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
    scored = score_candidates(candidates, NOW, RetrievalSettings())
    ranks = [c.record.importance for c in scored]
    assert ranks == sorted(ranks, reverse=True)
