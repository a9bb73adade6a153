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

import structlog

from insights.leader import LeaderInsightScheduler
from insights.scheduler import InsightJobs, InsightScheduler
from insights.service import InsightSettings
from proxy.announced import AnnouncedAdmin
from proxy.engine_admin import EngineAdmin
from proxy.engine_read import ReadSide
from proxy.memory import (
    Exchange,
    FeatureBoard,
    MemoryAdmin,
    RetentionSweeper,
    guard_handlers,
)
from proxy.memory.embedders import BaseEmbedder, EmbedderSettings, build_embedder
from proxy.memory.read import (
    InjectionSettings,
    RerankSettings,
    RetrievalSettings,
    text_caches,
)
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
from proxy.mirror import SHARED_QUEUE_WATCH_S, Mirror

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


class MemoryEngine(ReadSide):
    """Read path (``ReadSide``), write path and memory management over one store, one queue and one embedder.

    ``mirror``: the memory writer process of ``memproxy serve``'s process model, whose writes the chat
    processes follow (``proxy.mirror``): every write to the vector cache and every keyword commit goes to it,
    and the queue looks for the chat processes' enqueues.
    """

    def __init__(
        self,
        settings: EngineSettings,
        llm: LLMClient,
        latest: LatestChats | None = None,
        features: FeatureBoard | None = None,
        mirror: Mirror | None = None,
    ) -> None:
        self.settings = settings
        self._llm = llm
        self.latest = latest or LatestChats(())
        self.mirror = mirror
        embedder = build_embedder(settings.embedder)
        health = StorageHealth()  # one view of the data directory's faults, shared by store and queue
        self.jobs = JobQueue(settings.jobs, health=health, watch_s=SHARED_QUEUE_WATCH_S if mirror else 0.0)
        store = self._build_store(settings, embedder, health)
        super().__init__(settings.retrieval, settings.injection, settings.rerank, embedder, store, health, features)
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
        self.adapter_jobs = AdapterJobs(
            self.store, self.embedder, self.jobs, refit_s=settings.writer.adapter_refit_s,
            min_pairs=settings.writer.adapter_min_pairs, on_shipped=self._adapter_shipped,
        )  # fmt: skip
        operations = EngineAdmin(self.store, self.jobs, self.latest, self.search, self._changed, self.names.invalidate)
        settle = mirror.settled if mirror is not None else None
        self._admin = AnnouncedAdmin(operations, self.store, self.events, stated, settle)
        self._queue_snapshot: QueueMetrics | None = None

    def _build_store(self, settings: EngineSettings, embedder: BaseEmbedder, health: StorageHealth) -> MemoryStore:
        """The embedded store, or one replica's view of a store on object storage (with its journal)."""
        self.objects: ObjectStore | None = None
        self.journal: Journal | None = None
        self.cluster: ClusterRuntime | None = None
        if settings.cluster is None:
            return MemoryStore(settings.store, embedder, health=health)
        self.objects = ObjectStore(settings.cluster.location)
        replica = settings.cluster.replica or replica_name()
        store = ReplicatedStore(settings.store, embedder, settings.cluster, self.objects, replica, health=health)
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
        if self.mirror is not None:
            self.mirror.emit("changed", (user_id,))

    def _adapter_shipped(self, user_id: str) -> None:
        """A refit stored the user's new query adapter: every process loads it anew."""
        self.adapters.invalidate(user_id)
        if self.mirror is not None:
            self.mirror.emit("adapter", (user_id,))

    def _changed(self, user_id: str) -> None:
        """A memory of the user was edited or deleted here: the read caches and the conversations' parts go,
        here and in the chat processes that follow this one."""
        super()._changed(user_id)
        if self.mirror is not None:
            self.mirror.emit("changed", (user_id,))

    async def __aenter__(self) -> MemoryEngine:
        started = time.perf_counter()
        async with contextlib.AsyncExitStack() as stack:
            if self.objects is not None:
                stack.callback(self.objects.close)
                await self.objects.ensure_bucket()
            await stack.enter_async_context(self.embedder)
            await stack.enter_async_context(self.store)
            if self.mirror is not None:
                self.store.mirror_to(self.mirror.emit)
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
            await self._finish_opening(stack, started)
        return self

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
