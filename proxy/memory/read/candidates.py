"""What flows from the arms to fusion, rerank and scoring: arm hits, fused candidates, and their normalisation.

The arms are ``dense`` (cosine), ``bm25`` (keyword) and ``entity`` (names of the user's memories found in the
query). An arm hit is a record and the arm's score for it (``ScoredRecord``); fusion turns the union of the hits
into ``Candidate`` values, which the boosts, the rerank and the final scoring carry on (pure values, replaced,
never mutated). ``min_max`` is the normalisation both fusion and the seed's scoring formula use.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import NamedTuple, Protocol

from proxy.memory.store.records import Kind, MemoryRecord

DENSE = "dense"
BM25 = "bm25"
ENTITY = "entity"
PAST_KINDS = (Kind.TURN, Kind.SUMMARY)  # the dated record of what was said (facts are claims about now)


class ScoredRecord(Protocol):
    """One arm hit: a record and the arm's score for it (``store.Hit`` has this shape)."""

    @property
    def record(self) -> MemoryRecord: ...

    @property
    def score(self) -> float: ...


@dataclass(frozen=True, slots=True)
class ArmHit:
    """A hit of an arm computed here (the entity arm) or in tests."""

    record: MemoryRecord
    score: float


NO_BOOSTS: Mapping[str, float] = MappingProxyType({})  # a candidate no boost lifted (or, unexplained, no arm score)


class Candidate(NamedTuple):
    """A memory in the fused list: raw arm scores, additive boosts, fused relevance and final score.

    A tuple, not a frozen dataclass: ~120 are made a request, and a frozen dataclass's ``__init__`` costs
    far more than a tuple's (it sets each field through ``object.__setattr__``).
    """

    record: MemoryRecord
    arm_scores: Mapping[str, float]
    fused: float = 0.0
    final: float = 0.0
    boosts: Mapping[str, float] = NO_BOOSTS

    @property
    def id(self) -> str:
        """The record id."""
        return self.record.id

    def boosted(self, name: str, amount: float) -> Candidate:
        """This candidate with ``amount`` added to its fused score under ``name``."""
        if amount <= 0.0:
            return self
        boosts = {**self.boosts, name: amount}
        return Candidate(self.record, self.arm_scores, self.fused + amount, self.final, boosts)

    def scored(self, final: float) -> Candidate:
        """This candidate with its final score set."""
        return Candidate(self.record, self.arm_scores, self.fused, final, self.boosts)


def min_max(values: Sequence[float]) -> list[float]:
    """Values mapped onto [0, 1] by min-max; when all are equal, every value maps to 1.

    "Equal" is relative (1e-6, about float32's precision, in which Tantivy scores): two hits with the same
    BM25 score up to rounding must not become a whole point apart.
    """
    if not values:
        return []
    low, high = min(values), max(values)
    if high - low <= max(1e-12, 1e-6 * max(abs(high), abs(low))):
        return [1.0] * len(values)
    return [(v - low) / (high - low) for v in values]
