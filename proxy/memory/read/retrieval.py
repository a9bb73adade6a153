"""The read path: run the arms concurrently, fuse, rerank, score, and choose what to inject.

``retrieve`` builds the query from the chat messages (``query``), runs the arms and lookups at once, each
within its own timeout (``arms``: dense, keyword, entity, insights, recent messages; one that fails is reported
in ``degraded`` and the others still serve), fuses their hits (``fusion``), lets the optional reranker reorder
the head when the dense and keyword arms disagree (``rerank``), scores the candidates (``scoring``) and chooses
the items to inject (``selection``). The result is data: which arms ran, whether BM25 was gated out, which
steps degraded and why; the HTTP shell renders it (``X-Memory-Arms``).

Callers inject ``result.items`` with ``injection.inject`` and then ``store.touch`` the injected ids, which
restarts their recency clock.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from proxy.memory.embedders.protocol import Embedder
from proxy.memory.pieces import term_vectors_of
from proxy.memory.query_adapter import QueryAdapter
from proxy.memory.read.arms import Found, entity_hits, run_arms
from proxy.memory.read.block import MemoryItem
from proxy.memory.read.candidates import BM25, DENSE, ENTITY, Candidate, ScoredRecord
from proxy.memory.read.fusion import fuse, is_gated
from proxy.memory.read.names import NameIndex, text_name_scores
from proxy.memory.read.query import Query, build_query
from proxy.memory.read.read_cache import ReadCache, RetrievalStore
from proxy.memory.read.rerank import ARM as RERANK
from proxy.memory.read.rerank import Reranker
from proxy.memory.read.retrieval_settings import RetrievalSettings
from proxy.memory.read.scoring import score_candidates
from proxy.memory.read.selection import plan_items
from proxy.memory.read.steps import Report

GATED = "gated"  # listed among the arms when keyword gating left BM25 out


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
    def arms(self) -> tuple[str, ...]:
        """The arms that ran, in order, then ``gated`` when keyword gating left BM25 out."""
        return (*self.arms_ran, *((GATED,) if self.gated else ()))


def _arm_hits(found: Found, query: Query, settings: RetrievalSettings) -> tuple[dict[str, list[ScoredRecord]], bool]:
    """The hits of the arms that ran, by arm name, and whether BM25 is gated out."""
    dense = found.dense.hits if found.dense else None
    gated = is_gated(dense or [], found.bm25 or [], query, settings)
    arms = {name: hits for name, hits in ((DENSE, dense), (BM25, found.bm25)) if hits is not None}
    if found.entity is not None:
        kept = [hits for name, hits in arms.items() if not (gated and name == BM25)]
        scores = found.entity.scores
        if settings.entity_text_names:
            scores = _merged(text_name_scores(query.text, [h.record for hits in kept for h in hits]), scores)
        arms[ENTITY] = entity_hits(scores, found.entity.surfaced, kept)
    return arms, gated


def _merged(first: Mapping[str, float], second: Mapping[str, float]) -> dict[str, float]:
    """Per memory, the higher of two entity scores."""
    return {rid: max(first.get(rid, 0.0), second.get(rid, 0.0)) for rid in {**first, **second}}


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
    explain: bool = True,
    adapter: QueryAdapter | None = None,
) -> RetrievalResult:
    """Find, rank and choose the memories of ``user_id`` for a chat request (see the module docstring).

    ``names`` is the entity arm's name index: a prebuilt one, a cache, or None to load it from the store.
    ``conversation_id`` keeps this conversation out of "recent activity". ``reranker`` (enabled in its settings)
    reorders the best fused candidates when the dense and BM25 arms disagree on first place. ``explain``: the
    candidates list the boosts that lifted them and their arm scores (the chat path passes False: it never
    shows them). ``adapter``: the user's query adapter, applied to the dense arm's query vector (None: none).
    """
    started = time.perf_counter()
    query = build_query(messages, short_words=settings.short_query_words, expand=settings.expand_anaphoric)
    if query is None:
        return RetrievalResult(query=None)
    report = Report()
    found = await run_arms(store, embedder, user_id, query, settings, now, conversation_id, names, report, adapter)
    fusing = time.perf_counter()
    arms, gated = _arm_hits(found, query, settings)
    subjects = found.dense.subjects if found.dense else ()
    vectors = term_vectors_of(embedder)
    fused = fuse(
        arms,
        query,
        settings,
        subject_hits=subjects,
        gated=gated,
        limit=settings.max_candidates,
        term_vectors=vectors,
        stored_pieces=None if vectors is None else functools.partial(store.term_pieces, user_id, vectors=vectors),
        explain=explain,
        now=now,
    )
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
