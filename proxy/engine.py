"""The memory engine: the real ``MemoryService``, wiring the store, read path, write path and workers.

``MemoryEngine`` is an async context manager. On enter it loads the embedder, opens the store (LanceDB +
Tantivy, with startup repair), opens the durable job queue and starts the job runner (write path and
insights); on exit it stops them in reverse, letting running jobs finish or hand them back to the queue.
The HTTP shell reaches memory only through ``inject``/``record`` and the management methods below (``admin``,
the seam's ``MemoryAdmin``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Sequence
from typing import Any, cast

import structlog

from insights.leader import LeaderInsightScheduler
from insights.scheduler import InsightJobs, InsightScheduler
from insights.service import InsightSettings
from proxy.announced import AnnouncedAdmin
from proxy.chat import arms_entries
from proxy.engine_admin import EngineAdmin
from proxy.memory import (
    Exchange,
    FeatureBoard,
    Injection,
    MemoryAdmin,
    ReadRequest,
    RetentionSweeper,
    SearchPreview,
    guard_handlers,
)
from proxy.memory.embedders import EmbedderSettings, build_embedder
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
from proxy.memory.store import (
    ClusterRuntime,
    ClusterSettings,
    Journal,
    MemoryStore,
    ObjectStore,
    ReplicatedStore,
    StorageHealth,
    StoreSettings,
    replica_name,
    utcnow,
)
from proxy.memory.write import (
    AdapterJobs,
    ExtractionSettings,
    Extractor,
    JobQueue,
    JobQueueSettings,
    JobRunner,
    LatestChats,
    LLMClient,
    QueueMetrics,
    StatedFacts,
    Webhooks,
    WebhookSettings,
    Writer,
    WriterSettings,
    exchange_payload,
)

log = structlog.get_logger("memproxy.memory")


@dataclasses.dataclass(frozen=True, slots=True)
class EngineSettings:
    """Each component's own settings, as the app factory hands them over."""

    embedder: EmbedderSettings
    store: StoreSettings
    jobs: JobQueueSettings
    retrieval: RetrievalSettings
    injection: InjectionSettings
    rerank: RerankSettings
    writer: WriterSettings
    extraction: ExtractionSettings
    insights: InsightSettings
    cluster: ClusterSettings | None = None  # the table on object storage, shared with other replicas
    webhooks: tuple[WebhookSettings, ...] = ()
    turn_retention_days: int = 0  # 0: turns are kept for good


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


class MemoryEngine:
    """Read path, write path and memory management over one store, one queue and one embedder."""

    def __init__(
        self,
        settings: EngineSettings,
        llm: LLMClient,
        latest: LatestChats | None = None,
        features: FeatureBoard | None = None,
    ) -> None:
        self.settings = settings
        self._llm = llm
        self.latest = latest or LatestChats(())
        self.features = features or FeatureBoard()
        self.embedder = build_embedder(settings.embedder)
        self.health = StorageHealth()  # one view of the data directory's faults, shared by store and queue
        self.jobs = JobQueue(settings.jobs, health=self.health)
        self.store = self._build_store(settings)
        self.events = Webhooks(settings.webhooks, self.jobs)
        extractor = Extractor(settings.extraction, llm)
        self.writer = Writer(
            settings.writer, self.store, self.jobs, extractor, self.embedder.document_cache, self.events
        )
        self.insight_jobs = InsightJobs(
            self.store, llm, settings.insights, default_model=settings.writer.model, latest_model=self.latest.model,
            events=self.events,
        )  # fmt: skip
        stated = StatedFacts(settings.writer, self.store, extractor, self.events, self.latest.model)
        self.names = NameIndexCache()
        loader = adapter_loader(self.store.adapters, self.embedder.model_id)
        self.adapters = AdapterCache(loader, settings.retrieval.query_adapter_cache_bytes)
        self.adapter_jobs = AdapterJobs(
            self.store, self.embedder, self.jobs, refit_s=settings.writer.adapter_refit_s,
            min_pairs=settings.writer.adapter_min_pairs, on_shipped=self.adapters.invalidate,
        )  # fmt: skip
        self.ledger = ConversationLedger(settings.injection.conversations_cache_bytes)
        operations = EngineAdmin(self.store, self.jobs, self.latest, self.search, self._changed, self.names.invalidate)
        self._admin = AnnouncedAdmin(operations, self.store, self.events, stated)
        self.reranker = Reranker(settings.rerank)
        self._stack = contextlib.AsyncExitStack()
        self._ready = False
        self._queue_snapshot: QueueMetrics | None = None

    def _build_store(self, settings: EngineSettings) -> MemoryStore:
        """The embedded store, or one replica's view of a store on object storage (with its journal)."""
        self.objects: ObjectStore | None = None
        self.journal: Journal | None = None
        self.cluster: ClusterRuntime | None = None
        if settings.cluster is None:
            return MemoryStore(settings.store, self.embedder, health=self.health)
        self.objects = ObjectStore(settings.cluster.location)
        replica = replica_name()
        store = ReplicatedStore(
            settings.store, self.embedder, settings.cluster, self.objects, replica, health=self.health
        )
        self.journal = Journal(self.objects, replica, self.jobs, settings.cluster.dead_after_s)
        return store

    async def _enter_cluster(self, stack: contextlib.AsyncExitStack) -> None:
        """Replica loops (lease, change feed, journal): after the queue and runner, stopped before them."""
        store, settings = self.store, self.settings.cluster
        if not isinstance(store, ReplicatedStore) or self.journal is None or settings is None:
            await stack.enter_async_context(InsightScheduler(self.store, self.jobs, self.settings.insights))
            return
        store.on_change(self._reload_read_cache)
        store.on_change(self._forget_carried)
        store.on_forget(self.jobs.forget_user)
        await stack.enter_async_context(LeaderInsightScheduler(store, self.jobs, self.settings.insights))
        self.cluster = await stack.enter_async_context(ClusterRuntime(store, self.journal, settings))

    def cluster_gauges(self) -> dict[str, float]:
        """The replica's cluster numbers (lease, sync age, adoptions, object-store requests); none when alone."""
        return self.cluster.gauges() if self.cluster is not None else {}

    async def _reload_read_cache(self, user_id: str) -> None:
        """Drop the user's read-cache entries, and any that a load in flight (from before a change) puts back."""
        self.names.invalidate(user_id)
        await self.names.wait_for_loads()
        self.names.invalidate(user_id)

    async def _forget_carried(self, user_id: str) -> None:
        """Another replica changed the user: what their conversations carry is built anew (a deleted memory
        must never be carried on)."""
        self.ledger.forget_user(user_id)

    def _changed(self, user_id: str) -> None:
        """A memory of the user was edited or deleted here: the read cache and the conversations' parts go."""
        self.names.invalidate(user_id)
        self.ledger.forget_user(user_id)
        self.adapters.invalidate(user_id)

    def release_idle(self) -> int:
        """Called every few seconds (``proxy.heap``): once no read has come for a few seconds, drop the users no
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

    @property
    def ready(self) -> bool:
        """Whether the embedder, store, queue and workers are all up."""
        return self._ready

    @property
    def storage_fault(self) -> str | None:
        """``component:reason`` while the data directory fails writes (memory waits, the chat goes on)."""
        return self.health.reason

    async def __aenter__(self) -> MemoryEngine:
        started = time.perf_counter()
        async with contextlib.AsyncExitStack() as stack:
            if self.objects is not None:
                stack.callback(self.objects.close)
                await self.objects.ensure_bucket()
            await stack.enter_async_context(self.embedder)
            await stack.enter_async_context(self.store)
            stack.callback(text_caches.clear)  # the read path's per-text caches go with the engine
            stack.push_async_callback(self.names.aclose)  # read-cache loads stop before the store closes
            await stack.enter_async_context(self.reranker)
            await stack.enter_async_context(self.jobs)
            await stack.enter_async_context(self.events)
            handlers = {
                **self.writer.handlers(), **self.insight_jobs.handlers(), **self.events.handlers(),
                **self.adapter_jobs.handlers(),
            }  # fmt: skip
            await stack.enter_async_context(JobRunner(self.jobs, guard_handlers(handlers, self.features)))
            days = self.settings.turn_retention_days
            sweeper = RetentionSweeper(self.store, self.events, days, on_deleted=self._changed)
            await stack.enter_async_context(sweeper)
            await self._enter_cluster(stack)
            self._stack = stack.pop_all()
        self._ready = True
        log.info("memory.ready", model=self.embedder.model_id, ms=round((time.perf_counter() - started) * 1000))
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._ready = False
        await self._stack.aclose()

    # ------------------------------------------------------------------------------------------ read path

    async def _retrieve(
        self, user_id: str, conversation_id: str | None, messages: list[dict[str, Any]], *, explain: bool
    ) -> RetrievalResult:
        adapter = await self.adapters.get(user_id) if self.settings.retrieval.query_adapter else None
        return await retrieve(
            self.store,
            self.embedder,
            messages,
            user_id,
            self.settings.retrieval,
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
        result = await self._retrieve(request.user_id, request.conversation_id, view, explain=False)
        chosen: list[MemoryItem] = []
        if result.items and result.query is not None:
            chosen = choose(request.messages, result.items, result.query.terms, self.settings.injection)
        planned = self._plan(request, chosen)
        carried = set(planned.carried)
        used = tuple(i.id for i in chosen if i.id in carried)  # what this request's retrieval chose and sent
        if used:
            await self.store.touch(request.user_id, used)
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
        settings = self.settings.injection
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
            block = inject_block(messages, result.items, result.query.terms, self.settings.injection).block
        return SearchPreview(
            results=[_result_row(c) for c in result.candidates[:k]],
            arms=arms_entries(result.arms, result.degraded),
            injected_block=block,
        )

    # ----------------------------------------------------------------------------------------- write path

    async def record(self, exchange: Exchange) -> None:
        """Commit the finished exchange to the durable queue (the write path runs after); note the chat's model,
        route and key for memory-side calls, and wake the user's waiting jobs when it brought something new."""
        if self.latest.remember(exchange.user_id, exchange.model, exchange.route, exchange.client_key):
            await self.jobs.resume_waiting(exchange.user_id)
        if self.journal is not None:  # with replicas, the exchange is also on object storage when this returns
            self.writer.pin_query_vectors(exchange.user_messages)
            await self.journal.record(
                "exchange", exchange.user_id, exchange_payload(exchange, self.settings.extraction)
            )
            return
        await self.writer.record(exchange)
        if self.settings.retrieval.query_adapter:  # at most one refit per user and period (``AdapterJobs``)
            await self.adapter_jobs.request(exchange.user_id)

    # ------------------------------------------------------------------------------------------ management

    @property
    def admin(self) -> MemoryAdmin:
        """The management operations (``engine_admin.EngineAdmin``), each change announced (``AnnouncedAdmin``)."""
        return self._admin

    # --------------------------------------------------------------------------------------------- metrics

    async def refresh_metrics(self) -> None:
        """Take a fresh snapshot of the queue's numbers (called before each /metrics scrape)."""
        with contextlib.suppress(Exception):  # a scrape never fails because the queue is busy
            self._queue_snapshot = await asyncio.wait_for(self.jobs.metrics(), timeout=2.0)

    async def jobs_busy(self) -> bool:
        """Whether a memory job is due or running now (jobs scheduled for later wait in the queue)."""
        snap = await self.jobs.metrics()
        return snap.ready + snap.running > 0

    def waiting(self) -> tuple[dict[str, int], dict[str, int]]:
        """Jobs waiting for a key or configuration now, and times jobs started waiting, by reason."""
        snap = self._queue_snapshot
        return (dict(snap.waiting), dict(snap.waits_total)) if snap is not None else ({}, {})

    @property
    def queue_snapshot(self) -> QueueMetrics | None:
        """The queue's numbers as of the last ``refresh_metrics`` (None before the first)."""
        return self._queue_snapshot

    def embedder_gauges(self) -> dict[str, float]:
        """Texts through the model, and the vector cache's hits, misses and vectors held for queued jobs."""
        cache = self.embedder.query_cache
        return {
            "texts_total": float(self.embedder.texts_embedded),
            "cache_hits_total": float(cache.hits),
            "cache_misses_total": float(cache.misses),
            "cache_pinned": float(cache.pinned),
        }

    def storage_gauges(self) -> dict[str, float]:
        """Whether the data directory is failing now, and how many storage faults began since start."""
        return {
            "storage_failing": float(self.health.reason is not None),
            "storage_faults_total": float(self.health.faults_total),
        }
