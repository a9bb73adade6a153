"""Final scores of fused candidates: relevance + recency + importance (pure functions).

Each of the three is min-max normalised across the candidates, then weighted and summed, in the manner of
Generative Agents' retrieval score. Relevance is the fused score; recency is ``decay ** hours`` since the
memory was last accessed (injected), or since it was created if it never was; importance is the 1-10
rating given at write time. With all weights 1 the issue's worked "Maya" table comes out exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from proxy.memory.fusion import Candidate, min_max
from proxy.memory.records import MemoryRecord
from proxy.memory.retrieval_settings import RetrievalSettings


def hours_since_access(record: MemoryRecord, now: datetime) -> float:
    """Hours since the memory was last injected (or created), never negative."""
    last = record.last_accessed_at or record.created_at
    return max(0.0, (now - last).total_seconds() / 3600.0)


def recency(record: MemoryRecord, now: datetime, decay: float = 0.995) -> float:
    """``decay ** hours`` since last access: 1 just now, ~0.89 after a day, ~0.43 after a week."""
    return float(decay ** hours_since_access(record, now))


def combined_scores(
    relevance: Sequence[float],
    recency_values: Sequence[float],
    importance: Sequence[float],
    weights: tuple[float, float, float] = (1.0, 1.0, 1.0),
) -> list[float]:
    """Weighted sum of the three min-max normalised signals, one total per memory."""
    parts = (min_max(relevance), min_max(recency_values), min_max(importance))
    return [sum(w * p[i] for w, p in zip(weights, parts, strict=True)) for i in range(len(relevance))]


def score_candidates(candidates: Sequence[Candidate], now: datetime, settings: RetrievalSettings) -> list[Candidate]:
    """Candidates with their final score set, best first (ties keep the fused order)."""
    weights = (settings.relevance_weight, settings.recency_weight, settings.importance_weight)
    totals = combined_scores(
        [c.fused for c in candidates],
        [recency(c.record, now, settings.recency_decay) for c in candidates],
        [float(c.record.importance) for c in candidates],
        weights,
    )
    scored = [c.scored(total) for c, total in zip(candidates, totals, strict=True)]
    return sorted(scored, key=lambda c: -c.final)
