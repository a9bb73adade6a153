"""Final scores of fused candidates: relevance first, time and importance as bounded bonuses (pure functions).

Two formulas, chosen by ``RetrievalSettings.scoring``:

- ``"bounded"`` (the default): ``relevance x (1 + recency_bonus x 0.5 ** (age_days / half_life) +
  importance_bonus x (importance - 5) / 5)``, divided by its largest possible multiplier so that the best
  possible memory scores 1. Relevance is the fused score over the best fused score of the request (a ratio,
  not min-max, so that how much more relevant one memory is than another survives). Age is the time since
  the memory was *created*, in absolute days: a week-old fact is a week old whether the other candidates are
  seconds or years old, and a stale fact that was injected yesterday does not pass for current. The recency
  bonus goes to facts only: a fact is a claim about the user's present ("lives in Paris"), so the newer of
  two near-identical facts is the current one; turns and summaries are a dated record of what was said, as
  true months later (on LoCoMo, where questions ask about any session, a recency bonus on turns only cost
  recall). Since the
  multiplier lies in ``[1 - 0.8 importance_bonus, 1 + recency_bonus + importance_bonus]``, time and
  importance can reorder memories whose relevance is within that ratio (near-ties: the newer of two
  near-identical facts wins) and can never lift a memory above one that is more relevant by more than it
  (``dominance_ratio``).
- ``"minmax"`` (the seed's formula, Generative Agents' retrieval score): relevance, recency and importance,
  each min-max normalised across the candidates, weighted and summed. Recency is ``decay ** hours`` since
  the memory was last accessed (injected), or since it was created if it never was. With all weights 1 the
  worked "Maya" table comes out exactly. Min-max gives the newest candidate a full point whether it is
  seconds or months newer than the oldest, so on its own it can bury relevance (issue 12).

The bounded formula is written over numpy arrays (``bounded_scores``) so that an array-based read path can
call it directly; ``score_candidates`` adapts ``Candidate`` lists to it.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from datetime import datetime

import numpy as np
import numpy.typing as npt

from proxy.memory.read.candidates import Candidate, min_max
from proxy.memory.read.retrieval_settings import RetrievalSettings
from proxy.memory.store.records import Kind, MemoryRecord

DAY_S = 86_400.0
NEUTRAL_IMPORTANCE = 5.0  # the store's default rating: no bonus, no malus
FloatArray = npt.NDArray[np.float64]


# --- bounded (default) ------------------------------------------------------------------------------------


def recency_weights(age_s: npt.ArrayLike, half_life_days: float) -> FloatArray:
    """``0.5 ** (age_days / half_life_days)``: 1 for a memory created now, 0.5 one half-life ago (ages < 0: 1)."""
    age = np.maximum(np.asarray(age_s, dtype=np.float64), 0.0)
    return np.exp2(-age / (half_life_days * DAY_S))


def importance_weights(importance: npt.ArrayLike) -> FloatArray:
    """``(importance - 5) / 5`` of the 1-10 rating: -0.8 .. 1, 0 for the default 5."""
    return (np.clip(np.asarray(importance, dtype=np.float64), 1.0, 10.0) - NEUTRAL_IMPORTANCE) / NEUTRAL_IMPORTANCE


def max_multiplier(settings: RetrievalSettings) -> float:
    """The largest multiplier ``bounded_scores`` can give: a brand-new memory of importance 10."""
    return 1.0 + settings.recency_bonus + settings.importance_bonus


def dominance_ratio(settings: RetrievalSettings) -> float:
    """A memory more relevant than another by more than this ratio always scores higher (see the module doc)."""
    low = 1.0 - 0.8 * settings.importance_bonus
    return max_multiplier(settings) / low if low > 0 else float("inf")


def bounded_scores(
    relevance: npt.ArrayLike,
    age_s: npt.ArrayLike,
    importance: npt.ArrayLike,
    settings: RetrievalSettings,
    current: npt.ArrayLike | None = None,
) -> FloatArray:
    """Final scores in [0, 1]: relevance (over the best) times the bounded time and importance multiplier.

    ``current`` says which memories the recency bonus applies to (facts; None: all).
    """
    rel = np.maximum(np.asarray(relevance, dtype=np.float64), 0.0)
    top = float(rel.max()) if rel.size else 0.0
    if top <= 0.0:
        return np.zeros_like(rel)
    return (rel / top) * multipliers(age_s, importance, settings, current) / max_multiplier(settings)


def multipliers(
    age_s: npt.ArrayLike, importance: npt.ArrayLike, settings: RetrievalSettings, current: npt.ArrayLike | None = None
) -> FloatArray:
    """The time and importance multiplier of ``bounded_scores`` (``current``: which memories get the recency bonus)."""
    recency_part = recency_weights(age_s, settings.recency_half_life_days)
    if current is not None:
        recency_part = recency_part * np.asarray(current, dtype=np.float64)
    return 1.0 + settings.recency_bonus * recency_part + settings.importance_bonus * importance_weights(importance)


# --- minmax (the seed's formula) --------------------------------------------------------------------------


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


def _minmax_totals(candidates: Sequence[Candidate], now: datetime, settings: RetrievalSettings) -> list[float]:
    weights = (settings.relevance_weight, settings.recency_weight, settings.importance_weight)
    return combined_scores(
        [c.fused for c in candidates],
        [recency(c.record, now, settings.recency_decay) for c in candidates],
        [float(c.record.importance) for c in candidates],
        weights,
    )


# --- the boundary with the read path ----------------------------------------------------------------------


def final_scale(settings: RetrievalSettings) -> float:
    """What a final score is multiplied by to lie in [0, 1] (minmax totals go up to the sum of the weights)."""
    if settings.scoring == "bounded":
        return 1.0
    total = settings.relevance_weight + settings.recency_weight + settings.importance_weight
    return 1.0 / total if total > 0 else 1.0


def ages_s(candidates: Sequence[Candidate], now: datetime) -> FloatArray:
    """Seconds since each candidate's memory was created."""
    return np.array([(now - c.record.created_at).total_seconds() for c in candidates], dtype=np.float64)


def score_candidates(candidates: Sequence[Candidate], now: datetime, settings: RetrievalSettings) -> list[Candidate]:
    """Candidates with their final score set, best first (ties keep the fused order)."""
    if settings.scoring == "minmax":
        totals = _minmax_totals(candidates, now, settings)
    else:
        totals = bounded_scores(
            [c.fused for c in candidates],
            ages_s(candidates, now),
            [c.record.importance for c in candidates],
            settings,
            [c.record.kind is Kind.FACT for c in candidates],
        ).tolist()
    scored = [c.scored(total) for c, total in zip(candidates, totals, strict=True)]
    return sorted(scored, key=_FINAL, reverse=True)  # a reversed sort is stable too


_FINAL = operator.attrgetter("final")
