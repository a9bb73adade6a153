"""A chat process's memory: the read path over a follower's view of the store, and exchanges into the queue.

In ``memproxy serve``'s process model (``proxy.supervisor``) the memory writer process owns the store's writes,
the keyword index writer and the job queue; each chat process runs a ``ReplicaEngine``: the same read path as
the single-process engine (``engine_read.ReadSide``) over the same files, kept current by the writer's stream of
changes (``proxy.mirror``), and ``record`` commits each exchange to the job queue's SQLite file itself (durably,
before the reply's end goes out) for the writer to process. The management API and MCP are the writer's: the
chat process relays them (``proxy.relay_memory``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from pathlib import Path

import structlog

from proxy.engine import EngineSettings
from proxy.engine_read import ReadSide
from proxy.memory import Exchange, FeatureBoard, MemoryAdmin
from proxy.memory.embedders import build_embedder
from proxy.memory.read import text_caches
from proxy.memory.store import Journal, MemoryStore, ObjectStore, StorageHealth, shared_table, utcnow
from proxy.memory.write import AdapterJobs, JobQueue, LatestChats, enqueue_exchange, exchange_payload
from proxy.mirror import WriterLink

log = structlog.get_logger("memproxy.memory")

FIRST_CONNECT_S = 5.0  # at start, how long to wait for the writer's stream before serving anyway


class ReplicaEngine(ReadSide):
    """The read path over a follower's store; exchanges committed to the shared queue."""

    def __init__(
        self, settings: EngineSettings, link_dir: Path, latest: LatestChats, features: FeatureBoard | None = None
    ) -> None:
        self.settings = settings
        self.latest = latest
        embedder = build_embedder(settings.embedder)
        health = StorageHealth()
        self.jobs = JobQueue(settings.jobs, health=health, producer=True)
        self.objects: ObjectStore | None = None
        self.journal: Journal | None = None
        shared = None
        if settings.cluster is not None:  # replicas on object storage: the exchange is also journaled there
            self.objects = ObjectStore(settings.cluster.location)
            shared = shared_table(settings.cluster, self.objects)
            replica = settings.cluster.replica or ""
            self.journal = Journal(self.objects, replica, self.jobs, settings.cluster.dead_after_s)
        store = MemoryStore(settings.store, embedder, health=health, shared=shared, follower=True)
        super().__init__(settings.retrieval, settings.injection, settings.rerank, embedder, store, health, features)
        self.link = WriterLink(link_dir, store, latest, self._writer_changed, self._resync)
        self.adapter_jobs = AdapterJobs(  # only to request refits: the writer runs them
            store, embedder, self.jobs, refit_s=settings.writer.adapter_refit_s,
            min_pairs=settings.writer.adapter_min_pairs, on_shipped=self.adapters.invalidate,
        )  # fmt: skip

    async def __aenter__(self) -> ReplicaEngine:
        started = time.perf_counter()
        async with contextlib.AsyncExitStack() as stack:
            if self.objects is not None:
                stack.callback(self.objects.close)
            await stack.enter_async_context(self.embedder)
            await stack.enter_async_context(self.store)
            stack.callback(text_caches.clear)
            stack.push_async_callback(self.names.aclose)
            await stack.enter_async_context(self.reranker)
            await stack.enter_async_context(self.jobs)
            await stack.enter_async_context(self.link)
            await self.link.wait_connected(FIRST_CONNECT_S)
            await self._finish_opening(stack, started)
        return self

    @property
    def storage_fault(self) -> str | None:
        """The data directory's fault, else ``writer:restarting`` while the memory writer is away: exchanges are
        committed to the queue but wait for it (``X-Memory-Arms: degraded=write:...``, ``/readyz``)."""
        return self.health.reason or (None if self.link.connected else "writer:restarting")

    def _writer_changed(self, op: str, user_id: str) -> None:
        """The writer changed a user's memories (``changed``) or refitted their query adapter (``adapter``)."""
        if op == "adapter":
            self.adapters.invalidate(user_id)
        else:
            self._changed(user_id)

    async def _resync(self) -> None:
        """The writer's stream (re)connected: ops may have been missed, so every read cache is built anew."""
        self.names.clear()
        self.ledger.clear()
        self.adapters.clear()

    async def touch(self, user_id: str, ids: Sequence[str]) -> None:
        at = utcnow()  # the young ones are told apart here: the writer does not cache the user
        self.link.note_touch(user_id, ids, at, self.store.young_of(user_id, ids, at))

    async def record(self, exchange: Exchange) -> None:
        """Commit the exchange to the queue (durable when this returns); the writer hears of the chat (model,
        route, key) within ``mirror.PUSH_S``."""
        self.latest.remember(exchange.user_id, exchange.model, exchange.route, exchange.client_key)
        self.link.note_chat(exchange.user_id, exchange.model, exchange.route, exchange.client_key)
        if self.journal is not None:
            payload = exchange_payload(exchange, self.settings.extraction)
            await self.journal.record("exchange", exchange.user_id, payload)
            return
        await enqueue_exchange(self.jobs, exchange, self.settings.extraction)
        if self.settings.retrieval.query_adapter:  # at most one refit per user and period (``AdapterJobs``)
            await self.adapter_jobs.request(exchange.user_id)

    # what the writer process does, not a chat process

    @property
    def admin(self) -> MemoryAdmin | None:
        return None

    async def jobs_busy(self) -> bool | None:
        return None

    def link_gauges(self) -> dict[str, float]:
        """Whether the writer's stream is connected, and how often it (re)connected."""
        return {"connected": float(self.link.connected), "resyncs_total": float(self.link.resyncs)}
