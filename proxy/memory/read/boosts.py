"""Additive boosts on fused scores: subject similarity, adjacent turns, the best match's conversation, and dates
the query names (pure functions). The conversation lift stops short of newer facts about the same subject
(``behind_newer_facts``).

Each boost computes *lifts* (memory id -> amount added to its fused score) from what fusion found; ``fuse``
adds them in order, so that a later boost sees the earlier ones. The ``apply_*`` functions add one boost to a
list of ``Candidate`` values (tests, and callers that fuse step by step).
"""

from __future__ import annotations

import bisect
import itertools
import operator
from collections.abc import Mapping, Sequence
from datetime import date, timedelta

from proxy.memory.read.candidates import Candidate, ScoredRecord
from proxy.memory.read.dates import query_dates, query_days
from proxy.memory.store.records import Kind, MemoryRecord

Lifts = dict[str, float]  # memory id -> amount added to its fused score


def subject_lifts(records: Sequence[MemoryRecord], subject_hits: Sequence[ScoredRecord], weight: float) -> Lifts:
    """``weight * max cos(q, s)`` over each fused memory's subjects among ``subject_hits``."""
    best: dict[str, float] = {}
    for hit in subject_hits:
        for rid in hit.record.source_ids:
            best[rid] = max(best.get(rid, 0.0), float(hit.score))
    return {r.id: weight * best[r.id] for r in records if r.id in best}


def neighbour_lifts(
    records: Sequence[MemoryRecord], fused: Mapping[str, float], weight: float, window_s: float
) -> Lifts:
    """``weight`` x the best ``fused`` score of each fused turn's adjacent turns (same conversation)."""
    by_conversation: dict[str, list[MemoryRecord]] = {}
    turn = Kind.TURN
    for r in records:
        if r.kind is turn and r.conversation_id is not None:
            by_conversation.setdefault(r.conversation_id, []).append(r)
    window = timedelta(seconds=window_s) if window_s < _LONGEST_S else timedelta.max  # compared as timedeltas
    lift: dict[str, float] = {}
    get = lift.get
    for turns in by_conversation.values():
        if len(turns) < 2:
            continue
        turns.sort(key=_TURN_ORDER)
        for left, right in itertools.pairwise(turns):
            if right.created_at - left.created_at <= window:
                left_id, right_id = left.id, right.id
                if (value := fused[right_id]) > get(left_id, 0.0):
                    lift[left_id] = value
                if (value := fused[left_id]) > get(right_id, 0.0):
                    lift[right_id] = value
    return {rid: weight * value for rid, value in lift.items()}


_TURN_ORDER = operator.attrgetter("created_at", "id")
_CREATED = operator.attrgetter("created_at")
_LONGEST_S = timedelta.max.total_seconds()  # a longer window (a huge or infinite setting) is every gap


def conversation_lifts(records: Sequence[MemoryRecord], fused: Mapping[str, float], weight: float) -> Lifts:
    """``weight`` x the best ``fused`` score among the fused memories of each one's conversation (itself
    included): the conversation where the best match lies is where its context is."""
    best: dict[str, float] = {}
    get = best.get
    members: list[tuple[str, str]] = []
    for r in records:
        if (conversation := r.conversation_id) is not None:
            members.append((r.id, conversation))
            if (value := fused[r.id]) > get(conversation, 0.0):
                best[conversation] = value
    return {rid: weight * get(conversation, 0.0) for rid, conversation in members}


def behind_newer_facts(
    records: Sequence[MemoryRecord], fused: Mapping[str, float], lifts: Lifts, standing: Mapping[str, float]
) -> Lifts:
    """``lifts`` cut so that none carries a fact past a newer fact about the same subject (one naming an entity it
    names) that stands at least as high on its own (``standing``: a fact's ``fused`` score as the scoring will
    weigh it, its time and importance multiplier applied); never below the fact's own score.

    A fact is a claim about the user's present: of two about one subject ("lives in London", then "lives in
    Paris"), the newer one is current unless the older one is more relevant on its own by more than the scoring's
    time bonus. A lift says where the query's context lies, not which claim holds: an old conversation that
    matches well (its turn "I live in London") must not lift its stale fact above the fact that replaced it. Facts
    created at the same moment are not each other's newer.
    """
    facts = sorted((r for r in records if r.kind is Kind.FACT and r.entities), key=_TURN_ORDER, reverse=True)
    if len(facts) < 2:
        return lifts
    out = dict(lifts)
    newer: dict[str, _Standings] = {}  # entity -> the newer facts naming it
    for _, same_moment in itertools.groupby(facts, key=_CREATED):
        placed = [_capped(fact, fused[fact.id], standing[fact.id], out, newer) for fact in same_moment]
        for names, stands, score in placed:
            for name in names:
                standings, scores = newer.setdefault(name, ([], []))
                at = bisect.bisect_right(standings, stands)
                standings.insert(at, stands)
                scores.insert(at, score)
    return out


_Standings = tuple[list[float], list[float]]  # facts' standings (ascending) and their scores, lifts included


def _capped(
    fact: MemoryRecord, own: float, stands: float, lifts: Lifts, newer: Mapping[str, _Standings]
) -> tuple[set[str], float, float]:
    """The fact's subjects, standing and score: its lift cut (in ``lifts``) to end at the lowest score, lift
    included, of a newer fact about one of them that stands at least as high."""
    names = {entity.casefold() for entity in fact.entities}
    lift = lifts.get(fact.id, 0.0)
    score = own + lift
    for name in names:
        if (found := newer.get(name)) is not None:
            standings, scores = found
            at = bisect.bisect_left(standings, stands)
            if at < len(scores):
                score = min(score, *scores[at:])
    if score < own + lift:
        lifts[fact.id] = max(0.0, score - own)
    return names, stands, max(score, own)


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


def date_lifts(records: Sequence[MemoryRecord], query_text: str, weight: float, day_weight: float = 0.0) -> Lifts:
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

    return {r.id: lift(r) for r in records}


def _records(candidates: Sequence[Candidate]) -> list[MemoryRecord]:
    return [c.record for c in candidates]


def _boosted(candidates: Sequence[Candidate], name: str, lifts: Lifts) -> list[Candidate]:
    return [c.boosted(name, lifts.get(c.id, 0.0)) for c in candidates]


def apply_subject_boost(
    candidates: Sequence[Candidate], subject_hits: Sequence[ScoredRecord], weight: float
) -> list[Candidate]:
    """Add ``weight * max cos(q, s)`` over each memory's subjects among ``subject_hits`` (never negative)."""
    return _boosted(candidates, "subject", subject_lifts(_records(candidates), subject_hits, weight))


def smooth_neighbours(candidates: Sequence[Candidate], weight: float, window_s: float) -> list[Candidate]:
    """Add ``weight`` x the best fused score of a candidate turn's adjacent turns (same conversation)."""
    fused = {c.id: c.fused for c in candidates}
    return _boosted(candidates, "neighbour", neighbour_lifts(_records(candidates), fused, weight, window_s))


def apply_date_boost(
    candidates: Sequence[Candidate], query_text: str, weight: float, day_weight: float = 0.0
) -> list[Candidate]:
    """Add ``weight`` to memories dated in a month or year the query names, and ``day_weight`` more to those
    dated within a day of a whole day it names ("on May 3, 2023")."""
    return _boosted(candidates, "date", date_lifts(_records(candidates), query_text, weight, day_weight))
