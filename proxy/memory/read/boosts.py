"""Additive boosts on fused scores: subject similarity, adjacent turns, the best match's conversation, and dates
the query names (pure functions).

Each boost computes *lifts* (memory id -> amount added to its fused score) from what fusion found; ``fuse``
adds them in order, so that a later boost sees the earlier ones. The ``apply_*`` functions add one boost to a
list of ``Candidate`` values (tests, and callers that fuse step by step).
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Mapping, Sequence
from datetime import date, timedelta
from typing import Protocol

from proxy.memory.read.candidates import Candidate, ScoredRecord
from proxy.memory.read.dates import query_dates, query_days
from proxy.memory.store.records import Kind, MemoryRecord

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


def neighbour_lifts(candidates: Sequence[Fused], fused: Mapping[str, float], weight: float, window_s: float) -> Lifts:
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


def conversation_lifts(candidates: Sequence[Fused], fused: Mapping[str, float], weight: float) -> Lifts:
    """``weight`` x the best ``fused`` score among the candidates of each candidate's conversation (itself
    included): the conversation where the best match lies is where its context is."""
    best: dict[str, float] = {}
    for c in candidates:
        conversation = c.record.conversation_id
        if conversation is not None:
            best[conversation] = max(best.get(conversation, 0.0), fused[c.id])
    return {c.id: weight * best[c.record.conversation_id] for c in candidates if c.record.conversation_id is not None}


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
