"""The arms and lookups of one retrieval, run concurrently: dense, keyword, entity, insights, recent messages.

The dense arm embeds the query and searches the vectors (facts and summaries of all time, turns within the window
and, past it, turns that no summary stands in for; plus the query's nearest subjects for subject fusion); the
keyword arm runs BM25 over the same pools; the entity arm matches the query against the user's name index (entities
of facts, names of subjects): a name on at most ``entity_surface_max`` memories brings those memories in (one
``read_many``), a commoner name only lifts memories the dense or keyword arm found. The user's current insights and
their last messages from other conversations are looked up beside them, and so is what the user's summaries cover
(``visible``). Each runs as a guarded step (``steps``) within its own timeout; without the embedder, BM25 alone
answers. Pass a ``ReadCache`` as ``names`` so that the name index, the insights and the newest turns are not listed
from the store on every request.
"""

from __future__ import annotations

import asyncio
import itertools
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from proxy.memory.embedders.protocol import Embedder
from proxy.memory.query_adapter import QueryAdapter
from proxy.memory.read.candidates import BM25, DENSE, ENTITY, PAST_KINDS, ArmHit, ScoredRecord
from proxy.memory.read.names import NameIndex, entity_scores, names_in_query
from proxy.memory.read.query import Query
from proxy.memory.read.read_cache import (
    Coverage,
    ReadCache,
    RetrievalStore,
    load_coverage,
    load_insights,
    load_name_index,
    load_newest_turns,
)
from proxy.memory.read.retrieval_settings import RetrievalSettings
from proxy.memory.read.steps import Report, guarded, step
from proxy.memory.store.records import Kind, MemoryRecord, Pool


def window_start(now: datetime, settings: RetrievalSettings) -> datetime | None:
    """The start of the window for turns (None: all time)."""
    days = settings.turn_window_days
    return None if days is None else now - timedelta(days=days)


def _pools(k: int, since: datetime | None, settings: RetrievalSettings) -> list[Pool]:
    """One arm's pools: facts of all time, and turns and summaries of all time (``visible`` then drops the turns
    past the window that a summary stands in for) or, with ``turns_past_window = "none"``, turns and summaries
    since ``since`` and summaries before it."""
    if since is None or settings.turns_past_window == "unsummarised":
        return [Pool(k, (Kind.FACT,)), Pool(k, PAST_KINDS)]
    return [Pool(k, (Kind.FACT,)), Pool(k, PAST_KINDS, since), Pool(k, (Kind.SUMMARY,), until=since - _TICK)]


_TICK = timedelta(microseconds=1)


def visible(record: MemoryRecord, since: datetime | None, coverage: Coverage | None) -> bool:
    """Whether a memory may be a candidate: facts, summaries and turns within the window always; a turn past the
    window only where no summary stands in for it (``coverage`` None: none past the window).

    A summary stands in for the turns of its conversation up to the end of its span. Turns nothing stands in
    for (the summariser off, a conversation too short to be summarised, the tail not summarised yet) stay
    searchable: hiding them would lose what the user said outright.
    """
    if record.kind is not Kind.TURN or since is None or record.created_at >= since:
        return True
    if coverage is None:
        return False
    covered = coverage.get(record.conversation_id or "")
    return covered is None or record.created_at > covered


def _by_score(found: Sequence[Sequence[ScoredRecord]]) -> list[ScoredRecord]:
    """The hits of several pools as one list, best first (ties in the pools' order: a reversed sort is stable)."""
    return sorted(itertools.chain.from_iterable(found), key=_SCORE, reverse=True)


_SCORE = operator.attrgetter("score")


@dataclass(frozen=True, slots=True)
class Dense:
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
    report: Report,
    subjects_wanted: bool = True,
    adapter: QueryAdapter | None = None,
) -> Dense | None:
    """Embed the query (through the user's query adapter, if any), then search both pools and (when wanted) the
    subjects in one pass over the vectors."""
    timeout_s = settings.arm_timeout_ms / 1000
    vector = await guarded("embedder", embedder.embed_query(query.text), timeout_s, report)
    if vector is None:
        report.degraded[DENSE] = f"embedder-{report.degraded.pop('embedder')}"
        return None
    if adapter is not None and adapter.model_id == embedder.model_id:
        vector = adapter.apply(vector)

    pools = _pools(settings.dense_k, since, settings)
    searched = len(pools)
    if subjects_wanted and settings.subject_weight > 0:
        pools.append(Pool(settings.subject_top_n, (Kind.SUBJECT,)))
    found = await store.vector_search_pools(user_id, vector, pools)
    kept = [h for h in _by_score(found[:searched]) if h.score >= settings.min_dense_score]
    return Dense(hits=kept, subjects=list(found[searched]) if len(found) > searched else [])


def _has_subjects(user_id: str, names: NameIndex | ReadCache | None) -> bool:
    """False only when the user's known name index (given, or fresh in the cache) was built without subjects."""
    known = names if isinstance(names, NameIndex) else None
    if isinstance(names, ReadCache):
        known = names.cached_names(user_id)
    return known is None or known.subjects > 0


async def _keyword_arm(
    store: RetrievalStore, user_id: str, text: str, settings: RetrievalSettings, since: datetime | None
) -> list[ScoredRecord]:
    """BM25 hits over the same pools as the dense arm."""
    return _by_score(await store.keyword_search_pools(user_id, text, _pools(settings.bm25_k, since, settings)))


def _in_scope(record: MemoryRecord) -> bool:
    """Whether a memory belongs in the candidates: valid facts, turns and summaries (``visible`` then applies the
    window)."""
    return record.valid and (record.kind is Kind.FACT or record.kind in PAST_KINDS)


@dataclass(frozen=True, slots=True)
class Entity:
    """The entity arm's finding: memory id -> damped name score, and the rare-name memories it fetched."""

    scores: dict[str, float]
    surfaced: list[MemoryRecord]


async def _entity_arm(
    store: RetrievalStore,
    user_id: str,
    query: Query,
    index: NameIndex,
    settings: RetrievalSettings,
) -> Entity:
    """Score memories by the names the query mentions; fetch those of rare names so they can surface.

    A name on more than ``entity_surface_max`` memories cannot say which of them matter, so it only lifts
    memories the other arms found; a rarer name also brings its memories in (at most ``entity_k``).
    """
    names = names_in_query(query.text, index)
    scores = entity_scores(names, index)
    rare = {rid for name in names if len(index.names[name]) <= settings.entity_surface_max for rid in index.names[name]}
    ids = sorted((rid for rid in scores if rid in rare), key=lambda rid: -scores[rid])[: settings.entity_k]
    records = await store.read_many(user_id, ids) if ids else []
    return Entity(scores=scores, surfaced=[r for r in records if _in_scope(r)])


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
) -> Entity:
    """The entity arm with its name index."""
    index = await _name_index(store, user_id, names)
    return await _entity_arm(store, user_id, query, index, settings)


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


@dataclass(frozen=True, slots=True)
class Found:
    """What the concurrent steps returned (None: the step did not run or failed)."""

    dense: Dense | None
    bm25: list[ScoredRecord] | None
    entity: Entity | None
    insights: list[MemoryRecord] | None
    recent: list[MemoryRecord] | None


async def run_arms(
    store: RetrievalStore,
    embedder: Embedder,
    user_id: str,
    query: Query,
    settings: RetrievalSettings,
    now: datetime,
    conversation_id: str | None,
    names: NameIndex | ReadCache | None,
    report: Report,
    adapter: QueryAdapter | None = None,
) -> Found:
    """Run every arm and lookup, each within its timeout: concurrently, or one after the other when none of
    them waits on anything (``at_hand``). ``adapter``: the user's query adapter (None: the query as embedded)."""
    since, timeout_s = window_start(now, settings), settings.arm_timeout_ms / 1000
    keyword_text = " ".join(query.terms) if settings.bm25_drop_stopwords else query.text
    steps = (
        step(
            DENSE,
            lambda: _dense_arm(
                store, embedder, user_id, query, settings, since, report, _has_subjects(user_id, names), adapter
            ),
            True,
            2 * timeout_s,
            report,
        ),
        step(
            BM25,
            lambda: _keyword_arm(store, user_id, keyword_text, settings, since),
            bool(keyword_text.strip()),
            timeout_s,
            report,
        ),
        step(
            ENTITY,
            lambda: _entity_step(store, user_id, query, names, settings),
            settings.entity_k > 0,
            timeout_s,
            report,
        ),
        step(
            "insights",
            lambda: _insights(store, user_id, settings.max_insights, names),
            settings.max_insights > 0,
            timeout_s,
            report,
        ),
        step(
            "recent",
            lambda: _recent(store, user_id, conversation_id, settings.recent_messages, names),
            settings.recent_messages > 0,
            timeout_s,
            report,
        ),
    )
    covering = step(
        "coverage", lambda: _coverage(store, user_id, names), _summaries_stand_in(since, settings), timeout_s, report
    )
    dense, bm25, entity, insights, recent = steps
    if at_hand(store, embedder, user_id):
        found = Found(await dense, await bm25, await entity, await insights, await recent)
        coverage = await covering
    else:
        gathered = await asyncio.gather(dense, bm25, entity, insights, recent, covering)
        found, coverage = Found(*gathered[:5]), gathered[5]
    if since is None:
        return found
    return _windowed(found, since, (coverage or {}) if _summaries_stand_in(since, settings) else None)


def _summaries_stand_in(since: datetime | None, settings: RetrievalSettings) -> bool:
    """Whether turns past the window are searched, so what the summaries cover must be known."""
    return since is not None and settings.turns_past_window == "unsummarised"


async def _coverage(store: RetrievalStore, user_id: str, cache: NameIndex | ReadCache | None) -> Coverage:
    """What the user's summaries cover (cached when a ``ReadCache`` is given)."""
    if isinstance(cache, ReadCache):
        return await cache.coverage(store, user_id)
    return await load_coverage(store, user_id)


def _windowed(found: Found, since: datetime, coverage: Coverage | None) -> Found:
    """``found`` without the turns past the window that a summary stands in for (``visible``)."""
    dense = found.dense
    if dense is not None:
        dense = Dense([h for h in dense.hits if visible(h.record, since, coverage)], dense.subjects)
    bm25 = None if found.bm25 is None else [h for h in found.bm25 if visible(h.record, since, coverage)]
    entity = found.entity
    if entity is not None:
        entity = Entity(entity.scores, [r for r in entity.surfaced if visible(r, since, coverage)])
    return Found(dense, bm25, entity, found.insights, found.recent)


def at_hand(store: RetrievalStore, embedder: Embedder, user_id: str) -> bool:
    """Whether every step of a read of ``user_id`` runs without waiting on anything: the store serves the user
    from memory (``at_hand``: their vectors cached) and the embedder embeds a query on the spot
    (``queries_inline``). Such steps gain nothing from running as tasks, and five tasks with their timers
    are a cost of their own on every read. Looked up by name, as ``term_vectors_of`` does: stores and embedders
    without them run their steps concurrently."""
    held = getattr(store, "at_hand", None)
    return bool(getattr(embedder, "queries_inline", False)) and callable(held) and bool(held(user_id))
