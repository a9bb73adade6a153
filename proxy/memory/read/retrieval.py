"""The read path's I/O shell: run the arms concurrently, fuse, score, and choose what to inject.

``retrieve`` builds the query from the chat messages, embeds it, and runs at once: the dense arm (vector
search over facts of all time, and over turns and summaries within the window, plus the query's nearest
subjects for subject fusion), the keyword arm (BM25 over the same two pools), the entity arm (names of the
user's memories found in the query), the user's current insights, and their last messages from other
conversations. Each of these has its own timeout; one that raises or times out is reported in
``degraded`` (arm -> short reason, never a message text) and the others still serve: without the embedder,
BM25 alone answers. Everything else is the pure core (``query``, ``fusion``, ``scoring``, ``injection``).

The entity arm matches the query against the user's name index (entities of facts, names of subjects): a
name on at most ``entity_surface_max`` memories brings those memories in (one ``get_many``), a commoner name
only lifts memories the dense or keyword arm found; names the query shares with the capitalised words of
those memories' text lift them too (``entity_text_names``). Pass a ``ReadCache`` as ``names`` so that the
name index, the insights and the newest turns are not listed from the store on every request.

Callers inject ``result.items`` with ``injection.inject`` and then ``store.touch`` the injected ids, which
restarts their recency clock.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, TypeVar

from proxy.memory.embedders.local import Embedder
from proxy.memory.read.fusion import (
    BM25,
    DENSE,
    ENTITY,
    ArmHit,
    Candidate,
    NameIndex,
    ScoredRecord,
    entity_scores,
    fuse,
    is_gated,
    names_in_query,
    text_name_scores,
)
from proxy.memory.read.injection import MemoryItem, Section, item_from_record
from proxy.memory.read.query import Query, build_query
from proxy.memory.read.read_cache import (
    NameIndexCache,
    ReadCache,
    RetrievalStore,
    load_insights,
    load_name_index,
    load_newest_turns,
)
from proxy.memory.read.rerank import ARM as RERANK
from proxy.memory.read.rerank import Reranker
from proxy.memory.read.retrieval_settings import RetrievalSettings
from proxy.memory.read.scoring import final_scale, recency, score_candidates
from proxy.memory.records import Kind, MemoryRecord, Pool

__all__ = [
    "INSIGHT_PRIORITY",
    "RECENT_PRIORITY",
    "NameIndexCache",
    "ReadCache",
    "RetrievalResult",
    "RetrievalStore",
    "entity_hits",
    "load_name_index",
    "plan_items",
    "recent_messages",
    "retrieve",
]

_T = TypeVar("_T")
PAST_KINDS = (Kind.TURN, Kind.SUMMARY)
INSIGHT_PRIORITY = 0.5  # an insight's item score is this x its confidence (candidates score in [0, 1])
RECENT_PRIORITY = 0.3  # a recent message's item score is this x its recency


@dataclass(frozen=True, slots=True)
class RetrievalResult:
    """What the read path found for one request and how: ranked candidates, items to inject, arm report."""

    query: Query | None
    candidates: list[Candidate] = field(default_factory=list)
    items: list[MemoryItem] = field(default_factory=list)
    arms_ran: list[str] = field(default_factory=list)
    gated: bool = False
    degraded: dict[str, str] = field(default_factory=dict)
    timings_ms: dict[str, float] = field(default_factory=dict)

    @property
    def arms_header(self) -> str:
        """``X-Memory-Arms``: the arms that ran, ``gated``, and ``degraded=<arm>:<reason>`` entries."""
        parts = [*self.arms_ran, *(["gated"] if self.gated else [])]
        parts += [f"degraded={arm}:{reason}" for arm, reason in self.degraded.items()]
        return ",".join(parts)


# --- guarded concurrent steps -----------------------------------------------------------------------------


@dataclass(slots=True)
class _Report:
    """Degraded arms and per-step timings, filled in by the guarded steps of one retrieval."""

    degraded: dict[str, str] = field(default_factory=dict)
    timings_ms: dict[str, float] = field(default_factory=dict)


def _reason(error: BaseException) -> str:
    """A short, header-safe reason: ``timeout`` or the error's class name (never its message)."""
    return "timeout" if isinstance(error, TimeoutError) else type(error).__name__


async def _guarded(name: str, step: Awaitable[_T], timeout_s: float, report: _Report) -> _T | None:
    """Run one step within its timeout; on failure note it as degraded and return None."""
    started = time.perf_counter()
    try:
        async with asyncio.timeout(timeout_s):
            return await step
    # One arm failing must never fail the chat, whatever the backend raised: the others still serve.
    except Exception as error:
        report.degraded[name] = _reason(error)
        return None
    finally:
        report.timings_ms[name] = round((time.perf_counter() - started) * 1000, 3)


# --- arms -------------------------------------------------------------------------------------------------


def _since(now: datetime, settings: RetrievalSettings) -> datetime | None:
    """The start of the window for turns and summaries (None: all time)."""
    days = settings.turn_window_days
    return None if days is None else now - timedelta(days=days)


def _pools(k: int, since: datetime | None) -> list[Pool]:
    """One arm's two pools: facts of all time, and turns and summaries since ``since``."""
    return [Pool(k, (Kind.FACT,)), Pool(k, PAST_KINDS, since)]


def _by_score(found: Sequence[Sequence[ScoredRecord]]) -> list[ScoredRecord]:
    """The hits of several pools as one list, best first."""
    return sorted((hit for hits in found for hit in hits), key=lambda h: -h.score)


@dataclass(frozen=True, slots=True)
class _Dense:
    """The dense arm's hits and the query's nearest subjects."""

    hits: list[ScoredRecord]
    subjects: list[ScoredRecord]


async def _dense_arm(
    store: RetrievalStore,
    embedder: Embedder,
    user_id: str,
    query: Query,
    settings: RetrievalSettings,
    since: datetime | None,
    report: _Report,
    subjects_wanted: bool = True,
) -> _Dense | None:
    """Embed the query, then search both pools and (when wanted) the subjects in one pass over the vectors."""
    timeout_s = settings.arm_timeout_ms / 1000
    vector = await _guarded("embedder", embedder.embed_query(query.text), timeout_s, report)
    if vector is None:
        report.degraded[DENSE] = f"embedder-{report.degraded.pop('embedder')}"
        return None

    pools = _pools(settings.dense_k, since)
    if subjects_wanted and settings.subject_weight > 0:
        pools.append(Pool(settings.subject_top_n, (Kind.SUBJECT,)))
    found = await store.vector_search_pools(user_id, vector, pools)
    kept = [h for h in _by_score(found[:2]) if h.score >= settings.min_dense_score]
    return _Dense(hits=kept, subjects=list(found[2]) if len(found) > 2 else [])


def _has_subjects(user_id: str, names: NameIndex | ReadCache | None) -> bool:
    """False only when the user's known name index (given, or fresh in the cache) was built without subjects."""
    known = names if isinstance(names, NameIndex) else None
    if isinstance(names, ReadCache):
        known = names.cached_names(user_id)
    return known is None or known.subjects > 0


async def _keyword_arm(
    store: RetrievalStore, user_id: str, text: str, settings: RetrievalSettings, since: datetime | None
) -> list[ScoredRecord]:
    """BM25 hits over both pools."""
    return _by_score(await store.keyword_search_pools(user_id, text, _pools(settings.bm25_k, since)))


def _in_scope(record: MemoryRecord, since: datetime | None) -> bool:
    """Whether a memory belongs in the candidates: valid facts, and valid turns/summaries in the window."""
    if not record.valid:
        return False
    if record.kind is Kind.FACT:
        return True
    return record.kind in PAST_KINDS and (since is None or record.created_at >= since)


@dataclass(frozen=True, slots=True)
class _Entity:
    """The entity arm's finding: memory id -> damped name score, and the rare-name memories it fetched."""

    scores: dict[str, float]
    surfaced: list[MemoryRecord]


async def _entity_arm(
    store: RetrievalStore,
    user_id: str,
    query: Query,
    index: NameIndex,
    settings: RetrievalSettings,
    since: datetime | None,
) -> _Entity:
    """Score memories by the names the query mentions; fetch those of rare names so they can surface.

    A name on more than ``entity_surface_max`` memories cannot say which of them matter, so it only lifts
    memories the other arms found; a rarer name also brings its memories in (at most ``entity_k``).
    """
    names = names_in_query(query.text, index)
    scores = entity_scores(names, index)
    rare = {rid for name in names if len(index.names[name]) <= settings.entity_surface_max for rid in index.names[name]}
    ids = [rid for rid in scores if rid in rare][: settings.entity_k]
    records = await store.get_many(user_id, ids) if ids else []
    return _Entity(scores=scores, surfaced=[r for r in records if _in_scope(r, since)])


def entity_hits(
    scores: Mapping[str, float], surfaced: Sequence[MemoryRecord], found: Sequence[Sequence[ScoredRecord]]
) -> list[ScoredRecord]:
    """The entity arm's hits: surfaced memories, and memories other arms ``found`` that carry a named name."""
    if not scores:
        return []
    records = {r.id: r for r in surfaced}
    for hits in found:
        records.update((h.record.id, h.record) for h in hits if h.record.id in scores)
    return sorted((ArmHit(r, scores[rid]) for rid, r in records.items()), key=lambda h: -h.score)


async def _name_index(store: RetrievalStore, user_id: str, names: NameIndex | ReadCache | None) -> NameIndex:
    """The name index to match the query against: given, cached, or loaded now."""
    if isinstance(names, NameIndex):
        return names
    if isinstance(names, ReadCache):
        return await names.names(store, user_id)
    return await load_name_index(store, user_id)


async def _entity_step(
    store: RetrievalStore,
    user_id: str,
    query: Query,
    names: NameIndex | ReadCache | None,
    settings: RetrievalSettings,
    since: datetime | None,
) -> _Entity:
    """The entity arm with its name index."""
    index = await _name_index(store, user_id, names)
    return await _entity_arm(store, user_id, query, index, settings, since)


async def _insights(
    store: RetrievalStore, user_id: str, limit: int, cache: NameIndex | ReadCache | None
) -> list[MemoryRecord]:
    """The user's current insights (cached when a ``ReadCache`` is given)."""
    if isinstance(cache, ReadCache):
        return await cache.insights(store, user_id, limit)
    return await load_insights(store, user_id, limit)


def recent_messages(turns: Sequence[MemoryRecord], conversation_id: str | None, count: int) -> list[MemoryRecord]:
    """The newest ``count`` user messages among ``turns`` that belong to other conversations than this one."""
    others = [
        t for t in turns if t.role == "user" and (conversation_id is None or t.conversation_id != conversation_id)
    ]
    return others[:count]


async def _recent(
    store: RetrievalStore, user_id: str, conversation_id: str | None, count: int, cache: NameIndex | ReadCache | None
) -> list[MemoryRecord]:
    """The user's last ``count`` messages from other conversations (newest first).

    Looks at the user's newest ``max(20, 6 x count)`` turns; when those all belong to this conversation, fewer
    (or none) come back, which is the right answer for one long chat.
    """
    limit = max(20, count * 6)
    if isinstance(cache, ReadCache):
        turns = await cache.newest_turns(store, user_id, limit)
    else:
        turns = await load_newest_turns(store, user_id, limit)
    return recent_messages(turns, conversation_id, count)


# --- choosing what to inject ------------------------------------------------------------------------------


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
    injection budget drops the lowest of these first. Records the screens flagged are never among them.
    """
    candidates = [c for c in candidates if c.record.flagged is None]  # flagged by the screens: never injected
    insights = [r for r in insights if r.flagged is None]
    recent = [r for r in recent if r.flagged is None]
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


# --- the read path ----------------------------------------------------------------------------------------


async def _nothing() -> None:
    """A step that is switched off."""


def _step(
    name: str, make: Callable[[], Awaitable[_T]], enabled: bool, timeout_s: float, report: _Report
) -> Awaitable[_T | None]:
    """A guarded step, or nothing when it is switched off (its coroutine is then never created)."""
    return _guarded(name, make(), timeout_s, report) if enabled else _nothing()


@dataclass(frozen=True, slots=True)
class _Found:
    """What the concurrent steps returned (None: the step did not run or failed)."""

    dense: _Dense | None
    bm25: list[ScoredRecord] | None
    entity: _Entity | None
    insights: list[MemoryRecord] | None
    recent: list[MemoryRecord] | None

    def arms(self, query: Query, settings: RetrievalSettings) -> tuple[dict[str, list[ScoredRecord]], bool]:
        """The hits of the arms that ran, by arm name, and whether BM25 is gated out."""
        dense = self.dense.hits if self.dense else None
        gated = is_gated(dense or [], self.bm25 or [], query, settings)
        arms = {name: hits for name, hits in ((DENSE, dense), (BM25, self.bm25)) if hits is not None}
        if self.entity is not None:
            found = [hits for name, hits in arms.items() if not (gated and name == BM25)]
            scores = self.entity.scores
            if settings.entity_text_names:
                scores = _merged(text_name_scores(query.text, [h.record for hits in found for h in hits]), scores)
            arms[ENTITY] = entity_hits(scores, self.entity.surfaced, found)
        return arms, gated


def _merged(first: Mapping[str, float], second: Mapping[str, float]) -> dict[str, float]:
    """Per memory, the higher of two entity scores."""
    return {rid: max(first.get(rid, 0.0), second.get(rid, 0.0)) for rid in {**first, **second}}


async def _run_steps(
    store: RetrievalStore,
    embedder: Embedder,
    user_id: str,
    query: Query,
    settings: RetrievalSettings,
    now: datetime,
    conversation_id: str | None,
    names: NameIndex | ReadCache | None,
    report: _Report,
) -> _Found:
    """Run every arm and lookup concurrently, each within its timeout."""
    since, timeout_s = _since(now, settings), settings.arm_timeout_ms / 1000
    keyword_text = " ".join(query.terms) if settings.bm25_drop_stopwords else query.text
    found = await asyncio.gather(
        _step(
            DENSE,
            lambda: _dense_arm(
                store, embedder, user_id, query, settings, since, report, _has_subjects(user_id, names)
            ),
            True,
            2 * timeout_s,
            report,
        ),
        _step(
            BM25,
            lambda: _keyword_arm(store, user_id, keyword_text, settings, since),
            bool(keyword_text.strip()),
            timeout_s,
            report,
        ),
        _step(
            ENTITY,
            lambda: _entity_step(store, user_id, query, names, settings, since),
            settings.entity_k > 0,
            timeout_s,
            report,
        ),
        _step(
            "insights",
            lambda: _insights(store, user_id, settings.max_insights, names),
            settings.max_insights > 0,
            timeout_s,
            report,
        ),
        _step(
            "recent",
            lambda: _recent(store, user_id, conversation_id, settings.recent_messages, names),
            settings.recent_messages > 0,
            timeout_s,
            report,
        ),
    )
    return _Found(*found)


async def retrieve(
    store: RetrievalStore,
    embedder: Embedder,
    messages: Sequence[Mapping[str, Any]],
    user_id: str,
    settings: RetrievalSettings,
    now: datetime,
    *,
    conversation_id: str | None = None,
    names: NameIndex | ReadCache | None = None,
    reranker: Reranker | None = None,
) -> RetrievalResult:
    """Find, rank and choose the memories of ``user_id`` for a chat request (see the module docstring).

    ``names`` is the entity arm's name index: a prebuilt one, a cache, or None to load it from the store.
    ``conversation_id`` keeps this conversation out of "recent activity". ``reranker`` (enabled in its settings)
    reorders the best fused candidates when the dense and BM25 arms disagree on first place.
    """
    started = time.perf_counter()
    query = build_query(messages, short_words=settings.short_query_words, expand=settings.expand_anaphoric)
    if query is None:
        return RetrievalResult(query=None)
    report = _Report()
    found = await _run_steps(store, embedder, user_id, query, settings, now, conversation_id, names, report)
    fusing = time.perf_counter()
    arms, gated = found.arms(query, settings)
    subjects = found.dense.subjects if found.dense else ()
    fused = fuse(arms, query, settings, subject_hits=subjects, gated=gated, limit=settings.max_candidates)
    candidates, ran = fused.candidates, list(arms)
    if reranker is not None and reranker.wanted(arms.get(DENSE, ()), () if gated else arms.get(BM25, ())):
        reranking = time.perf_counter()
        reranked = await reranker.rerank(query.text, candidates)
        report.timings_ms[RERANK] = round((time.perf_counter() - reranking) * 1000, 3)
        if reranked.candidates is None:
            report.degraded[RERANK] = reranked.reason or "error"
        else:
            candidates, ran = reranked.candidates, [*ran, RERANK]
    scored = score_candidates(candidates[: settings.max_candidates], now, settings)
    items = plan_items(scored, found.insights or [], found.recent or [], now, settings)
    report.timings_ms["fusion"] = round((time.perf_counter() - fusing) * 1000, 3)
    report.timings_ms["total"] = round((time.perf_counter() - started) * 1000, 3)
    return RetrievalResult(
        query=query,
        candidates=scored,
        items=items,
        arms_ran=ran,
        gated=fused.gated,
        degraded=report.degraded,
        timings_ms=report.timings_ms,
    )
