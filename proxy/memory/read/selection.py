"""What to inject: the block items chosen from the scored candidates, the insights and the recent messages.

Candidates score their final score scaled to [0, 1]; insights and recent messages get a fixed priority. The
injection budget then drops the lowest of these first (``injection``).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta

from proxy.memory.read.block import MemoryItem, Section, item_from_record
from proxy.memory.read.candidates import PAST_KINDS, Candidate
from proxy.memory.read.retrieval_settings import RetrievalSettings
from proxy.memory.read.scoring import final_scale, recency
from proxy.memory.store.records import Kind, MemoryRecord

INSIGHT_PRIORITY = 0.5  # an insight's item score is this x its confidence (candidates score in [0, 1])
RECENT_PRIORITY = 0.3  # a recent message's item score is this x its recency


def _cooling(record: MemoryRecord, now: datetime, settings: RetrievalSettings) -> bool:
    """Whether a summary was injected so recently that it is skipped this time."""
    minutes = settings.summary_cooldown_minutes
    last = record.last_accessed_at
    if record.kind is not Kind.SUMMARY or minutes <= 0 or last is None:
        return False
    return now - last < timedelta(minutes=minutes)


def plan_items(
    candidates: Sequence[Candidate],
    insights: Sequence[MemoryRecord],
    recent: Sequence[MemoryRecord],
    now: datetime,
    settings: RetrievalSettings,
) -> list[MemoryItem]:
    """The block items before the budget: top facts, top past turns/summaries, insights, recent messages.

    Candidates score their final score scaled to [0, 1] (``scoring.final_scale``); insights
    ``INSIGHT_PRIORITY`` x confidence; recent messages ``RECENT_PRIORITY`` x recency, or their candidate
    score when higher (a recent message that is also relevant is listed once, under recent activity). The
    injection budget drops the lowest of these first. Records the screens flagged, and records past their
    ``expires_at`` (until the retention sweep deletes them), are never among them.
    """
    # flagged by the screens, or past its expiry: never injected (inline: a call per candidate costs more)
    candidates = [
        c for c in candidates if c.record.flagged is None and (c.record.expires_at is None or c.record.expires_at > now)
    ]
    insights = [r for r in insights if r.flagged is None and (r.expires_at is None or r.expires_at > now)]
    recent = [r for r in recent if r.flagged is None and (r.expires_at is None or r.expires_at > now)]
    scale = final_scale(settings)
    relevance = {c.id: c.final * scale for c in candidates}
    recent_ids = {r.id for r in recent}
    facts = [c for c in candidates if c.record.kind is Kind.FACT][: settings.max_facts]
    past = [
        c
        for c in candidates
        if c.record.kind in PAST_KINDS and c.id not in recent_ids and not _cooling(c.record, now, settings)
    ][: settings.max_past]
    items = [item_from_record(c.record, relevance[c.id]) for c in [*facts, *past]]
    items += [item_from_record(r, INSIGHT_PRIORITY * (r.confidence or 1.0)) for r in insights]
    for record in recent:
        score = max(RECENT_PRIORITY * recency(record, now, settings.recency_decay), relevance.get(record.id, 0.0))
        items.append(item_from_record(record, score, Section.RECENT))
    return items
