"""Fusion of the retrieval arms into one ranked candidate list (pure functions).

The arms' union is the candidate set, so a hit of any one arm can surface. Fusion is either a weighted sum
of min-max normalised arm scores or reciprocal rank fusion. The entity arm's scores are already on [0, 1] and
carry the damping by how many memories share a name, so they are used as they are (min-max would flatten
them). The boosts follow: subject similarity, term matching (``term_match``), adjacent turns, the best match's
conversation (never past a newer fact about the same subject), and dates the query names (``boosts``). Keyword
gating leaves BM25 out when none of its top results holds enough of the query's terms.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime

from proxy.memory.pieces import TermVectors
from proxy.memory.read.boosts import (
    Lifts,
    behind_newer_facts,
    conversation_lifts,
    date_lifts,
    neighbour_lifts,
    subject_lifts,
)
from proxy.memory.read.candidates import BM25, DENSE, ENTITY, NO_BOOSTS, Candidate, ScoredRecord, min_max
from proxy.memory.read.query import Query
from proxy.memory.read.retrieval_settings import RetrievalSettings
from proxy.memory.read.scoring import multipliers
from proxy.memory.read.term_match import StoredPieces, term_match_lifts
from proxy.memory.store.records import Kind, MemoryRecord
from proxy.memory.words import stem, stems

RAW_SCORE_ARMS = frozenset({ENTITY})  # arms whose scores are used without min-max normalisation


@dataclass(frozen=True, slots=True)
class Fusion:
    """The fused candidates (best first) and whether the keyword arm was gated out."""

    candidates: list[Candidate]
    gated: bool


@dataclass(frozen=True, slots=True)
class _Union:
    """The union of the arms: each record (in the order the arms first found them) and each arm's best score
    per record."""

    records: dict[str, MemoryRecord]
    per_arm: dict[str, dict[str, float]]

    def scores(self, rid: str) -> dict[str, float]:
        """The record's raw score in every arm that found it (made per candidate: fuse keeps the best few)."""
        return {arm: best[rid] for arm, best in self.per_arm.items() if rid in best}


def _union(arms: Mapping[str, Sequence[ScoredRecord]]) -> _Union:
    """One pass over the arms' hits (a record's best hit per arm counts)."""
    records: dict[str, MemoryRecord] = {}
    per_arm: dict[str, dict[str, float]] = {}
    for arm, hits in arms.items():
        best: dict[str, float] = {}
        get = best.get
        for hit in hits:
            record = hit.record
            rid, score = record.id, float(hit.score)
            known = get(rid)
            if known is None:
                best[rid] = score
                if rid not in records:
                    records[rid] = record
            elif score > known:
                best[rid] = score
        per_arm[arm] = best
    return _Union(records, per_arm)


def _ranked(candidates: Iterable[Candidate]) -> list[Candidate]:
    """Candidates by fused score, best first (ties: newer first, then id, so the order is stable).

    Three stable sorts on C-level keys, cheaper than one sort on a computed tuple.
    """
    out = sorted(candidates, key=_RECORD_ID)
    out.sort(key=_CREATED, reverse=True)
    out.sort(key=_FUSED, reverse=True)
    return out


_RECORD_ID = operator.attrgetter("record.id")
_CREATED = operator.attrgetter("record.created_at")
_FUSED = operator.attrgetter("fused")


def _built(union: _Union, fused: Mapping[str, float]) -> list[Candidate]:
    """Candidates from the union and their fused scores, best first."""
    return _ranked(Candidate(record, union.scores(rid), fused[rid]) for rid, record in union.records.items())


def weighted_fusion(arms: Mapping[str, Sequence[ScoredRecord]], weights: Mapping[str, float]) -> list[Candidate]:
    """Weighted sum of per-arm min-max normalised scores (raw for ``RAW_SCORE_ARMS``), best first."""
    union = _union(arms)
    return _built(union, _weighted_scores(union, weights))


def _weighted_scores(union: _Union, weights: Mapping[str, float]) -> dict[str, float]:
    fused = dict.fromkeys(union.records, 0.0)
    for arm, best in union.per_arm.items():
        values = list(best.values())
        normalised = values if arm in RAW_SCORE_ARMS else min_max(values)
        weight = weights.get(arm, 0.0)
        for rid, value in zip(best, normalised, strict=True):
            fused[rid] += weight * value
    return fused


def reciprocal_rank_fusion(arms: Mapping[str, Sequence[ScoredRecord]], k: int = 60) -> list[Candidate]:
    """Sum of 1 / (k + rank) over the arms, best first.

    Ranks start at 1 and tied scores share a rank. The entity arm's term is scaled by its damped score, since
    its ties say nothing about order and a common name should count for less.
    """
    union = _union(arms)
    return _built(union, _rrf_scores(union, k))


def _rrf_scores(union: _Union, k: int) -> dict[str, float]:
    fused = dict.fromkeys(union.records, 0.0)
    for arm, best in union.per_arm.items():
        ordered = sorted(((score, rid) for rid, score in best.items()), key=lambda p: -p[0])
        rank, previous = 0, math.inf
        for position, (score, rid) in enumerate(ordered, start=1):
            if score < previous:
                rank, previous = position, score
            scale = score if arm in RAW_SCORE_ARMS else 1.0
            fused[rid] += scale / (k + rank)
    return fused


def keyword_gate(
    query_terms: Sequence[str], bm25_hits: Sequence[ScoredRecord], *, top_n: int, min_fraction: float
) -> bool:
    """Whether BM25 should be left out: none of its top hits holds ``min_fraction`` of the query's terms.

    A query without content terms (only stop words) gates BM25 whenever it has hits: they matched noise.
    """
    if not bm25_hits:
        return False
    wanted = {stem(t) for t in query_terms}
    if not wanted:
        return True
    need = max(1, math.ceil(min_fraction * len(wanted)))
    top = sorted(bm25_hits, key=lambda h: -h.score)[:top_n]
    return all(len(wanted & stems(h.record.text)) < need for h in top)


def is_gated(
    dense_hits: Sequence[ScoredRecord], bm25_hits: Sequence[ScoredRecord], query: Query, settings: RetrievalSettings
) -> bool:
    """Whether keyword gating leaves BM25 out: gating on, the dense arm answered, and BM25's top hits are weak."""
    if not settings.gating or not dense_hits:
        return False
    return keyword_gate(
        query.terms, bm25_hits, top_n=settings.gating_top_n, min_fraction=settings.gating_min_term_fraction
    )


def fuse(
    arms: Mapping[str, Sequence[ScoredRecord]],
    query: Query,
    settings: RetrievalSettings,
    subject_hits: Sequence[ScoredRecord] = (),
    *,
    gated: bool | None = None,
    limit: int | None = None,
    term_vectors: TermVectors | None = None,
    stored_pieces: StoredPieces | None = None,
    explain: bool = True,
    now: datetime | None = None,
) -> Fusion:
    """Gate, fuse and boost the arms' hits into one candidate list, best first.

    ``gated`` is computed here unless the caller already decided it (with ``is_gated``). ``limit``: only the best
    this many become ``Candidate`` objects (the read path scores no more than ``max_candidates``).
    ``term_vectors``: the embedding model's word piece vectors, for term matching (None: no term matching);
    ``stored_pieces``: the memories' pieces the store keeps (``term_match_lifts``).
    ``explain``: each candidate lists the boosts that lifted it and its score in each arm that found it
    (``Candidate.boosts``, ``Candidate.arm_scores``, for the search preview); the chat path, which never shows
    them, passes False and gets neither. ``now``: the request's clock, for the time bonus the scoring will give
    the facts that the conversation lift may not carry past a newer one (``boosts.behind_newer_facts``; None:
    their fused scores alone decide).
    """
    if gated is None:
        gated = is_gated(arms.get(DENSE, ()), arms.get(BM25, ()), query, settings)
    used = {arm: hits for arm, hits in arms.items() if not (gated and arm == BM25)}
    union = _union(used)
    if settings.fusion == "rrf":
        fused = _rrf_scores(union, settings.rrf_k)
    else:
        weights = {DENSE: settings.dense_weight, BM25: settings.bm25_weight, ENTITY: settings.entity_weight}
        fused = _weighted_scores(union, weights)
    records = list(union.records.values())  # what the boosts look at
    applied: list[tuple[str, Lifts]] = []  # each boost's lifts, in order (only the kept candidates list them)

    def add(name: str, lifts: Lifts) -> None:  # in order: a later boost sees the earlier ones in ``fused``
        for rid, amount in lifts.items():
            if amount > 0.0:
                fused[rid] += amount
        applied.append((name, lifts))

    if settings.subject_weight > 0 and subject_hits:
        add("subject", subject_lifts(records, subject_hits, settings.subject_weight))
    if settings.term_match_weight > 0 and term_vectors is not None:
        depth = settings.max_candidates
        weight = settings.term_match_weight
        add("terms", term_match_lifts(records, fused, query.terms, term_vectors, weight, depth, stored_pieces))
    if settings.neighbour_weight > 0:
        add("neighbour", neighbour_lifts(records, fused, settings.neighbour_weight, settings.neighbour_window_s))
    if settings.conversation_weight > 0:
        lifts = conversation_lifts(records, fused, settings.conversation_weight)
        add("conversation", behind_newer_facts(records, fused, lifts, _standing(records, fused, settings, now)))
    if settings.date_weight > 0 or settings.day_weight > 0:
        add("date", date_lifts(records, query.text, settings.date_weight, settings.day_weight))
    order = _ranked_ids(union.records, fused)
    chosen = order if limit is None else order[:limit]
    if not explain:  # the chat path: neither the boosts nor the arms' own scores are shown
        return Fusion(candidates=[Candidate(union.records[rid], NO_BOOSTS, fused[rid]) for rid in chosen], gated=gated)
    boosts = _boosts_of(chosen, applied)
    built = [
        Candidate(union.records[rid], union.scores(rid), fused[rid], 0.0, boosts.get(rid, NO_BOOSTS)) for rid in chosen
    ]
    return Fusion(candidates=built, gated=gated)


def _standing(
    records: Sequence[MemoryRecord], fused: Mapping[str, float], settings: RetrievalSettings, now: datetime | None
) -> dict[str, float]:
    """The facts that name an entity, each at its ``fused`` score times the multiplier the scoring will give it
    (``bounded``; under ``minmax``, or without ``now``, the fused score alone)."""
    facts = [r for r in records if r.kind is Kind.FACT and r.entities]
    if now is None or settings.scoring != "bounded" or len(facts) < 2:
        return {r.id: fused[r.id] for r in facts}
    ages = [(now - r.created_at).total_seconds() for r in facts]
    weights = multipliers(ages, [r.importance for r in facts], settings)
    return {r.id: fused[r.id] * float(w) for r, w in zip(facts, weights, strict=True)}


def _boosts_of(chosen: Sequence[str], applied: Sequence[tuple[str, Lifts]]) -> dict[str, dict[str, float]]:
    """The boosts that lifted each chosen memory, by name, in the order they were applied (memories that no
    boost lifted are left out): one pass over each boost's lifts, not one lookup per memory and boost."""
    wanted = set(chosen)
    out: dict[str, dict[str, float]] = {}
    for name, lifts in applied:
        for rid, amount in lifts.items():
            if amount > 0.0 and rid in wanted:
                out.setdefault(rid, {})[name] = amount
    return out


def _ranked_ids(records: Mapping[str, MemoryRecord], fused: Mapping[str, float]) -> list[str]:
    """Ids by fused score, best first, ties newer first, then by id: ``_ranked``'s order, on C-level keys (only
    runs of tied scores are sorted again)."""
    order = sorted(records, key=fused.__getitem__, reverse=True)
    scores = [fused[rid] for rid in order]
    start = 0
    for end in range(1, len(order) + 1):
        if end == len(order) or scores[end] != scores[start]:
            if end - start > 1:
                tied = sorted(order[start:end])
                tied.sort(key=lambda rid: records[rid].created_at, reverse=True)
                order[start:end] = tied
            start = end
    return order
