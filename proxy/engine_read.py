"""The read side of the memory engine: retrieval, the block's placement and the read caches over one store.

``ReadSide`` is what every process that answers chats runs: the single-process ``engine.MemoryEngine`` (which adds
the write side) and each chat process's ``replica.ReplicaEngine`` (over a follower's view of the store the memory
writer process owns).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from typing import Any, cast

import pyarrow as pa
import structlog

from proxy.chat import arms_entries
from proxy.memory import FeatureBoard, Injection, ReadRequest, SearchPreview
from proxy.memory.embedders import BaseEmbedder
from proxy.memory.read import (
    AdapterCache,
    BlockPlan,
    CachedBudgets,
    Candidate,
    ConversationLedger,
    InjectionSettings,
    MemoryItem,
    NameIndexCache,
    Placement,
    Planned,
    Reranker,
    RerankSettings,
    RetrievalResult,
    RetrievalSettings,
    adapter_loader,
    choose,
    plan_cached,
    plan_simple,
    retrieve,
    text_caches,
)
from proxy.memory.read import inject as inject_block
from proxy.memory.store import MemoryStore, StorageHealth, Ticker, holding, utcnow

log = structlog.get_logger("memproxy.memory")

IDLE_CHECK_S = 5.0  # how often ``release_idle`` runs


def _result_row(candidate: Candidate) -> dict[str, Any]:
    record = candidate.record
    row = {k: v for k, v in record.public_dict().items() if k in _PUBLIC_FIELDS}
    row["score"] = round(candidate.final, 6)
    row["relevance"] = round(candidate.fused, 6)
    row["arms"] = {name: round(score, 6) for name, score in candidate.arm_scores.items()}
    row["boosts"] = {name: round(score, 6) for name, score in candidate.boosts.items()}
    return row


_PUBLIC_FIELDS = (
    "id",
    "kind",
    "text",
    "created_at",
    "category",
    "importance",
    "conversation_id",
    "role",
    "entities",
    "last_accessed_at",
    "flagged",
    "expires_at",
)


class ReadSide:
    """Retrieval and placement over one store and one embedder, with the read caches they fill."""

    def __init__(
        self,
        retrieval: RetrievalSettings,
        injection: InjectionSettings,
        rerank: RerankSettings,
        embedder: BaseEmbedder,
        store: MemoryStore,
        health: StorageHealth,
        features: FeatureBoard | None,
    ) -> None:
        self.retrieval = retrieval
        self.injection = injection
        self.embedder = embedder
        self.store = store
        self.health = health  # one view of the data directory's faults
        self.features = features or FeatureBoard()
        self.names = NameIndexCache()
        self.ledger = ConversationLedger(injection.conversations_cache_bytes)
        self.reranker = Reranker(rerank)
        self.adapters = AdapterCache(
            adapter_loader(store.adapters, embedder.model_id), retrieval.query_adapter_cache_bytes
        )
        self._ready = False
        self._stack = contextlib.AsyncExitStack()

    @property
    def ready(self) -> bool:
        """Whether the embedder, store, queue and workers are all up."""
        return self._ready

    @property
    def storage_fault(self) -> str | None:
        """``component:reason`` while the data directory fails writes (memory waits, the chat goes on)."""
        return self.health.reason

    def _changed(self, user_id: str) -> None:
        """A memory of the user was edited or deleted here: the read cache and the conversations' parts go."""
        self.names.invalidate(user_id)
        self.ledger.forget_user(user_id)
        self.adapters.invalidate(user_id)

    def release_idle(self) -> int:
        """Called every few seconds (``IDLE_CHECK_S``): once no read has come for a few seconds, drop the users no
        read has used for ``store.vector_cache_idle_s`` from the vector cache and the read cache, and once no
        user is left there, the read path's per-text caches and the query vectors' LRU too (readers gone idle
        hand that memory back; the next reads refill them). Returns how many users were dropped."""
        released = self.store.release_idle()
        for user_id in released:  # their name index, insights, newest turns and query adapter go too: a reload
            self.names.invalidate(user_id)  # is cheap once the vector cache holds them again
            self.adapters.invalidate(user_id)
        if released:
            emptied = self.store.cached_users == 0
            if emptied:
                text_caches.clear()
                self.embedder.query_cache.clear()
            log.info("memory.released_idle", users=len(released), cache_emptied=emptied)
        return len(released)

    async def _retrieve(
        self, user_id: str, conversation_id: str | None, messages: list[dict[str, Any]], *, explain: bool
    ) -> RetrievalResult:
        adapter = await self.adapters.get(user_id) if self.retrieval.query_adapter else None
        with holding():  # the arms' lookups of the user share the first one's entry
            return await retrieve(
                self.store,
                self.embedder,
                messages,
                user_id,
                self.retrieval,
                utcnow(),
                conversation_id=conversation_id,
                names=self.names,
                reranker=self.reranker,
                explain=explain,
                adapter=adapter,
            )

    async def inject(self, request: ReadRequest) -> Injection:
        """Retrieve the user's memories and plan where the block goes in the request (its chat view, whatever
        the API)."""
        started = time.perf_counter()
        view = cast("list[dict[str, Any]]", request.messages)  # read only: retrieval never changes the messages
        with holding():  # (the access times noted below are judged on the entry the arms searched)
            result = await self._retrieve(request.user_id, request.conversation_id, view, explain=False)
            chosen: list[MemoryItem] = []
            if result.items and result.query is not None:
                chosen = choose(request.messages, result.items, result.query.terms, self.injection)
            planned = self._plan(request, chosen)
            carried = set(planned.carried)
            used = tuple(i.id for i in chosen if i.id in carried)  # what this request's retrieval chose and sent
            if used:
                await self.touch(request.user_id, used)
        return Injection(
            plan=planned.plan,
            injected_ids=planned.carried,
            arms=result.arms,
            degraded=result.degraded,
            retrieval_ms=(time.perf_counter() - started) * 1000,
        )

    def carried(self, request: ReadRequest) -> Injection:
        """What the conversation already carries, without a retrieval (when one failed or timed out): the cached
        prefix stays whole and the request keeps its earlier memory."""
        return Injection(plan=self._plan(request, [], start=False).plan)

    def _plan(self, request: ReadRequest, chosen: Sequence[MemoryItem], *, start: bool = True) -> Planned:
        """Where ``chosen`` goes in the request (``start``: a conversation without an entry may start one)."""
        settings = self.injection
        placement = Placement(settings.placement)
        if placement is not Placement.CACHED:
            return plan_simple(placement, request.messages, chosen)
        entry = self.ledger.get(request.user_id, request.conversation_id)
        if entry is not None and entry.expired(utcnow()):  # a carried memory expired: it must not be sent again
            entry = None
        if entry is None and not start:
            return Planned(BlockPlan(), ())
        budgets = CachedBudgets(settings.turn_budget_tokens, settings.conversation_budget_tokens)
        holds = request.provider_holds_history
        planned = plan_cached(request.messages, chosen, entry, budgets, provider_holds_history=holds)
        if planned.entry is not None:
            self.ledger.put(request.user_id, request.conversation_id, planned.entry)
        return planned

    async def search(self, user_id: str, query: str, k: int = 10) -> SearchPreview:
        """Exactly what the proxy would inject for a conversation whose last user message is ``query``."""
        messages = [{"role": "user", "content": query}]
        result = await self._retrieve(user_id, None, messages, explain=True)
        block = ""
        if result.items and result.query is not None:
            block = inject_block(messages, result.items, result.query.terms, self.injection).block
        return SearchPreview(
            results=[_result_row(c) for c in result.candidates[:k]],
            arms=arms_entries(result.arms, result.degraded),
            injected_block=block,
        )

    def embedder_gauges(self) -> dict[str, float]:
        """Texts through the model, and the vector cache's hits, misses and vectors held for queued jobs."""
        cache = self.embedder.query_cache
        return {
            "texts_total": float(self.embedder.texts_embedded),
            "quick_texts_total": float(self.embedder.quick_texts),
            "model_texts_total": float(self.embedder.model_texts),
            "model_cpu_seconds_total": float(self.embedder.model_cpu_s),
            "cache_hits_total": float(cache.hits),
            "cache_misses_total": float(cache.misses),
            "cache_pinned": float(cache.pinned),
        }

    def memory_parts(self) -> dict[str, float]:
        """Bytes each bounded part of this process holds (``memproxy_memory_bytes{part}``)."""
        return {
            "vector_cache": float(self.store.cache.nbytes),
            "vector_spill": float(spill.patch_bytes if (spill := self.store.cache.spill) is not None else 0),
            "lance_cache": float(self.store.lance_cache_bytes),
            "conversations": float(self.ledger.bytes),
            "query_vectors": float(self.embedder.cached_vector_bytes),
            "text_caches": float(text_caches.nbytes()),
            "arrow": float(pa.total_allocated_bytes()),
        }

    def storage_gauges(self) -> dict[str, float]:
        """Whether the data directory is failing now, and how many storage faults began since start."""
        return {
            "storage_failing": float(self.health.reason is not None),
            "storage_faults_total": float(self.health.faults_total),
        }

    async def _finish_opening(self, stack: contextlib.AsyncExitStack, started: float) -> None:
        """Opening's last step (inside the opener's stack): idle users released every ``IDLE_CHECK_S``, then
        ready; the stack is kept for ``__aexit__``."""
        await stack.enter_async_context(Ticker("release-idle", IDLE_CHECK_S, self.release_idle_async))
        self._stack = stack.pop_all()
        self._ready = True
        log.info("memory.ready", model=self.embedder.model_id, ms=round((time.perf_counter() - started) * 1000))

    async def __aexit__(self, *exc: object) -> None:
        self._ready = False
        await self._stack.aclose()

    async def release_idle_async(self) -> None:
        """``release_idle`` for a ticker."""
        self.release_idle()

    async def touch(self, user_id: str, ids: Sequence[str]) -> None:
        """Note that a request sent these memories (their access time)."""
        await self.store.touch(user_id, ids)
