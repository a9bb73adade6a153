"""Fusion of the retrieval arms into one ranked candidate list (pure functions).

The arms are ``dense`` (cosine), ``bm25`` (keyword) and ``entity`` (names of the user's memories found in the
query). Their union is the candidate set, so a hit of any one arm can surface. Fusion is either a weighted sum
of min-max normalised arm scores or reciprocal rank fusion. The entity arm's scores are already on [0, 1] and
carry the damping by how many memories share a name, so they are used as they are (min-max would flatten
them); besides the user's name index (entities of facts, subjects), names written in the found memories'
own text count (``text_name_scores``). Additive boosts follow: subject similarity, adjacent turns, and dates
the query names (a month or year, and a whole day). Keyword gating leaves BM25 out when none of its top
results holds enough of the query's terms.
"""

from __future__ import annotations

import functools
import itertools
import math
import operator
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import date, timedelta
from typing import NamedTuple, Protocol

from proxy.memory.read.query import STOPWORDS, Query, cased_words, has_cjk, query_dates, query_days, stem, stems, words
from proxy.memory.read.retrieval_settings import RetrievalSettings
from proxy.memory.records import Kind, MemoryRecord

DENSE = "dense"
BM25 = "bm25"
ENTITY = "entity"
RAW_SCORE_ARMS = frozenset({ENTITY})  # arms whose scores are used without min-max normalisation


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


@dataclass(frozen=True, slots=True)
class Candidate:
    """A memory in the fused list: raw arm scores, additive boosts, fused relevance and final score."""

    record: MemoryRecord
    arm_scores: Mapping[str, float]
    fused: float = 0.0
    final: float = 0.0
    boosts: Mapping[str, float] = field(default_factory=dict)

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


@dataclass(frozen=True, slots=True)
class Fusion:
    """The fused candidates (best first) and whether the keyword arm was gated out."""

    candidates: list[Candidate]
    gated: bool


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


@dataclass(frozen=True, slots=True)
class _Union:
    """The union of the arms: each record, its raw score in every arm that found it, and each arm's scores."""

    records: dict[str, MemoryRecord]
    scores: dict[str, dict[str, float]]
    per_arm: dict[str, dict[str, float]]


def _union(arms: Mapping[str, Sequence[ScoredRecord]]) -> _Union:
    """One pass over the arms' hits (a record's best hit per arm counts)."""
    records: dict[str, MemoryRecord] = {}
    scores: dict[str, dict[str, float]] = {}
    per_arm: dict[str, dict[str, float]] = {}
    for arm, hits in arms.items():
        best: dict[str, float] = {}
        for hit in hits:
            rid, score = hit.record.id, float(hit.score)
            if rid not in best or score > best[rid]:
                best[rid] = score
                if rid not in records:
                    records[rid] = hit.record
                    scores[rid] = {}
        for rid, score in best.items():
            scores[rid][arm] = score
        per_arm[arm] = best
    return _Union(records, scores, per_arm)


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


def _built(
    records: Mapping[str, MemoryRecord], scores: Mapping[str, dict[str, float]], fused: Mapping[str, float]
) -> list[Candidate]:
    """Candidates from the union and their fused scores, best first."""
    return _ranked(Candidate(record=records[rid], arm_scores=scores[rid], fused=fused[rid]) for rid in records)


def weighted_fusion(arms: Mapping[str, Sequence[ScoredRecord]], weights: Mapping[str, float]) -> list[Candidate]:
    """Weighted sum of per-arm min-max normalised scores (raw for ``RAW_SCORE_ARMS``), best first."""
    union = _union(arms)
    return _built(union.records, union.scores, _weighted_scores(union, weights))


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
    return _built(union.records, union.scores, _rrf_scores(union, k))


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


# --- entity arm -------------------------------------------------------------------------------------------


def normalise_name(name: str) -> str:
    """A name as the index keys it: lowercase word tokens joined by single spaces."""
    return " ".join(words(name))


@dataclass(frozen=True, slots=True)
class NameIndex:
    """Names found on one user's memories (entities, subjects) and the memories that carry each name."""

    names: Mapping[str, tuple[str, ...]]
    max_words: int = 1
    cjk_names: tuple[str, ...] = ()  # matched as substrings: CJK text has no spaces between words
    subjects: int = 0  # subject records seen (none: the subject search can be skipped)

    @classmethod
    def build(cls, records: Iterable[MemoryRecord]) -> NameIndex:
        """Index entity names of memories, and subject names linked to their memories' ids."""
        names: dict[str, dict[str, None]] = {}
        subjects = 0
        for record in records:
            subjects += record.kind is Kind.SUBJECT
            if record.kind is Kind.SUBJECT:
                pairs = [(record.text, rid) for rid in record.source_ids]
            else:
                pairs = [(entity, record.id) for entity in record.entities]
            for name, rid in pairs:
                key = normalise_name(name)
                if _usable_name(key):
                    names.setdefault(key, {})[rid] = None
        frozen = {key: tuple(ids) for key, ids in names.items()}
        longest = max((len(key.split()) for key in frozen), default=1)
        cjk = tuple(k for k in frozen if has_cjk(k))
        return cls(names=frozen, max_words=longest, cjk_names=cjk, subjects=subjects)


def _usable_name(key: str) -> bool:
    """Names worth matching: not empty, not a lone stop word, not a single Latin letter or digit."""
    if not key:
        return False
    single_word = " " not in key
    return not (single_word and ((len(key) < 2 and key.isascii()) or key in _NAME_STOPWORDS))


_NAME_STOPWORDS = frozenset({"i", "me", "my", "we", "us", "you", "he", "she", "it", "they", "the", "a", "an"})


def names_in_query(text: str, index: NameIndex) -> list[str]:
    """Index names the query mentions, as whole words (case-insensitive); CJK names as substrings."""
    tokens = words(text)
    found: dict[str, None] = {}
    for size in range(1, index.max_words + 1):
        for start in range(len(tokens) - size + 1):
            key = " ".join(tokens[start : start + size])
            if key in index.names:
                found[key] = None
    lowered = text.lower()
    found.update(dict.fromkeys(key for key in index.cjk_names if key in lowered))
    return list(found)


@functools.lru_cache(maxsize=16_384)  # the same memories come back request after request
def written_names(text: str) -> frozenset[str]:
    """Names written in a memory's text: its capitalised words (lowercased), stop words and single letters left out.

    Crude on purpose, and cheap enough to run over every candidate of a request: a sentence-initial word
    ("Yesterday") counts too, which costs little, since only words the query also holds are ever used.
    """
    tokens = (t.lower() for t in cased_words(text) if t[0].isupper())
    return frozenset(t for t in tokens if _usable_name(t) and t not in STOPWORDS)


def text_name_scores(query_text: str, records: Iterable[MemoryRecord]) -> dict[str, float]:
    """Memory id -> damped score of the query's words written as names in the memory (among ``records``).

    Matched case-insensitively as whole words; a name written in many of ``records`` counts for less
    (``name_damping`` of how many carry it), and several names add up to at most 1.
    """
    wanted = {w for w in words(query_text) if w not in STOPWORDS}
    carried: dict[str, list[str]] = {}
    for record in {r.id: r for r in records}.values():
        for name in wanted & written_names(record.text):
            carried.setdefault(name, []).append(record.id)
    scores: dict[str, float] = {}
    for ids in carried.values():
        for rid in ids:
            scores[rid] = min(1.0, scores.get(rid, 0.0) + name_damping(len(ids)))
    return scores


def name_damping(memories_with_name: int) -> float:
    """How much one name says: 1 for a name on one memory, ~0.2 for a name on 60 (1 / (1 + ln n))."""
    return 1.0 / (1.0 + math.log(max(1, memories_with_name)))


def entity_scores(names: Iterable[str], index: NameIndex) -> dict[str, float]:
    """Memory id -> sum of the damped weights of the query names it carries, capped at 1."""
    scores: dict[str, float] = {}
    for name in names:
        ids = index.names.get(name, ())
        weight = name_damping(len(ids))
        for rid in ids:
            scores[rid] = min(1.0, scores.get(rid, 0.0) + weight)
    return dict(sorted(scores.items(), key=lambda item: -item[1]))


# --- additive boosts --------------------------------------------------------------------------------------


Lifts = dict[str, float]  # memory id -> amount added to its fused score


class Fused(Protocol):
    """What a boost looks at: a fused memory's id and record (a ``Candidate`` has this shape)."""

    @property
    def id(self) -> str: ...

    @property
    def record(self) -> MemoryRecord: ...


def subject_lifts(candidates: Sequence[Fused], subject_hits: Sequence[ScoredRecord], weight: float) -> Lifts:
    """``weight * max cos(q, s)`` over each candidate's subjects among ``subject_hits``."""
    best: dict[str, float] = {}
    for hit in subject_hits:
        for rid in hit.record.source_ids:
            best[rid] = max(best.get(rid, 0.0), float(hit.score))
    return {c.id: weight * best[c.id] for c in candidates if c.id in best}


def neighbour_lifts(
    candidates: Sequence[Fused], fused: Mapping[str, float], weight: float, window_s: float
) -> Lifts:
    """``weight`` x the best ``fused`` score of each candidate turn's adjacent turns (same conversation)."""
    by_conversation: dict[str, list[Fused]] = {}
    for c in candidates:
        if c.record.kind is Kind.TURN and c.record.conversation_id is not None:
            by_conversation.setdefault(c.record.conversation_id, []).append(c)
    lift: dict[str, float] = {}
    for turns in by_conversation.values():
        if len(turns) < 2:
            continue
        turns.sort(key=_TURN_ORDER)
        for left, right in itertools.pairwise(turns):
            if (right.record.created_at - left.record.created_at).total_seconds() <= window_s:
                lift[left.id] = max(lift.get(left.id, 0.0), fused[right.id])
                lift[right.id] = max(lift.get(right.id, 0.0), fused[left.id])
    return {rid: weight * value for rid, value in lift.items()}


_TURN_ORDER = operator.attrgetter("record.created_at", "record.id")


def _record_dates(record: MemoryRecord) -> list[tuple[int, int]]:
    """(year, month) pairs a memory is about: its creation, and a summary's or insight's span ends."""
    stamps = [record.created_at, record.start_at, record.end_at]
    return [(d.year, d.month) for d in stamps if d is not None]


def _on_named_day(record: MemoryRecord, days: Sequence[date]) -> bool:
    """Whether a memory is dated within a day of a named day (a summary's or insight's span counts whole)."""
    start = record.start_at or record.created_at
    end = record.end_at or record.created_at
    first, last = min(start, record.created_at).date(), max(end, record.created_at).date()
    return any(first - _ONE_DAY <= day <= last + _ONE_DAY for day in days)


_ONE_DAY = timedelta(days=1)


def date_lifts(candidates: Sequence[Fused], query_text: str, weight: float, day_weight: float = 0.0) -> Lifts:
    """``weight`` for memories dated in a month or year the query names, and ``day_weight`` more for those
    dated within a day of a whole day it names ("on May 3, 2023")."""
    wanted = query_dates(query_text)
    days = query_days(query_text) if day_weight > 0 else []
    if not wanted and not days:
        return {}

    def matches(record: MemoryRecord) -> bool:
        return any(
            (year is None or y == year) and (month is None or m == month)
            for y, m in _record_dates(record)
            for year, month in wanted
        )

    def lift(record: MemoryRecord) -> float:
        return (weight if matches(record) else 0.0) + (day_weight if days and _on_named_day(record, days) else 0.0)

    return {c.id: lift(c.record) for c in candidates}


def _boosted(candidates: Sequence[Candidate], name: str, lifts: Lifts) -> list[Candidate]:
    return [c.boosted(name, lifts.get(c.id, 0.0)) for c in candidates]


def apply_subject_boost(
    candidates: Sequence[Candidate], subject_hits: Sequence[ScoredRecord], weight: float
) -> list[Candidate]:
    """Add ``weight * max cos(q, s)`` over each memory's subjects among ``subject_hits`` (never negative)."""
    return _boosted(candidates, "subject", subject_lifts(candidates, subject_hits, weight))


def smooth_neighbours(candidates: Sequence[Candidate], weight: float, window_s: float) -> list[Candidate]:
    """Add ``weight`` x the best fused score of a candidate turn's adjacent turns (same conversation)."""
    fused = {c.id: c.fused for c in candidates}
    return _boosted(candidates, "neighbour", neighbour_lifts(candidates, fused, weight, window_s))


def apply_date_boost(
    candidates: Sequence[Candidate], query_text: str, weight: float, day_weight: float = 0.0
) -> list[Candidate]:
    """Add ``weight`` to memories dated in a month or year the query names, and ``day_weight`` more to those
    dated within a day of a whole day it names ("on May 3, 2023")."""
    return _boosted(candidates, "date", date_lifts(candidates, query_text, weight, day_weight))


# --- the whole fusion step --------------------------------------------------------------------------------


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
) -> Fusion:
    """Gate, fuse and boost the arms' hits into one candidate list, best first.

    ``gated`` is computed here unless the caller already decided it (with ``is_gated``). ``limit``: only the best
    this many become ``Candidate`` objects (the read path scores no more than ``max_candidates``).
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
    candidates = [_Found(rid, record) for rid, record in union.records.items()]  # what the boosts look at
    boosts: dict[str, dict[str, float]] = {}

    def add(name: str, lifts: Lifts) -> None:  # in order: a later boost sees the earlier ones in ``fused``
        for rid, amount in lifts.items():
            if amount > 0.0:
                fused[rid] += amount
                boosts.setdefault(rid, {})[name] = amount

    if settings.subject_weight > 0 and subject_hits:
        add("subject", subject_lifts(candidates, subject_hits, settings.subject_weight))
    if settings.neighbour_weight > 0:
        add("neighbour", neighbour_lifts(candidates, fused, settings.neighbour_weight, settings.neighbour_window_s))
    if settings.date_weight > 0 or settings.day_weight > 0:
        add("date", date_lifts(candidates, query.text, settings.date_weight, settings.day_weight))
    order = _ranked_ids(union.records, fused)
    chosen = order if limit is None else order[:limit]
    built = [
        Candidate(union.records[rid], union.scores[rid], fused[rid], 0.0, boosts[rid])
        if rid in boosts
        else Candidate(union.records[rid], union.scores[rid], fused[rid])
        for rid in chosen
    ]
    return Fusion(candidates=built, gated=gated)


class _Found(NamedTuple):
    """A fused memory as the boosts see it (cheaper than a ``Candidate``, which only the kept ones become)."""

    id: str
    record: MemoryRecord


def _ranked_ids(records: Mapping[str, MemoryRecord], fused: Mapping[str, float]) -> list[str]:
    """Ids by fused score, best first, ties newer first, then by id: ``_ranked``'s order, on C-level keys."""
    created = {rid: record.created_at for rid, record in records.items()}
    order = sorted(records)
    order.sort(key=created.__getitem__, reverse=True)
    order.sort(key=fused.__getitem__, reverse=True)
    return order
