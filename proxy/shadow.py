"""Shadow evaluation: an alternative retrieval configuration judged on live traffic, never injected.

With ``[shadow] enabled = true``, a sampled share (``sample_rate``) of the requests whose memory was read is
kept aside. After its response (when the write path receives the exchange, or ``settle_s`` after the read for
requests that write nothing), an owned worker runs the read path twice over the same messages, with the live
``[retrieval]`` settings and with them changed by ``[shadow] retrieval = {...}``, and compares the top ``k``:
overlap@k, Spearman rank correlation, and how many memories only one of them found. The numbers go to
``memproxy_shadow_*`` metrics and a ``shadow.compared`` log line. What the request injected is never touched:
the wrapper returns the engine's own result, and the shadow runs only after it.

The queue of samples is bounded (``queue_size``); a sample that does not fit is dropped and counted. One
shadow comparison runs at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import structlog
from prometheus_client import Counter, Histogram
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from proxy.engine import MemoryEngine
from proxy.memory import Exchange, FeatureBoard, Injection, MemoryAdmin, ReadRequest
from proxy.memory.read import RetrievalSettings, retrieve
from proxy.memory.store import utcnow
from proxy.metrics import Metrics

log = structlog.get_logger("memproxy.shadow")

_RATIO_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)
_CORRELATION_BUCKETS = (-0.5, 0.0, 0.25, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)


class ShadowSettings(BaseModel):
    """``[shadow]``: an alternative retrieval configuration compared with the live one on sampled requests."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool = False
    sample_rate: float = Field(default=0.05, ge=0.0, le=1.0)
    k: int = Field(default=10, ge=1, le=100)
    retrieval: Mapping[str, Any] = Field(default_factory=dict)  # [retrieval] keys whose value differs
    settle_s: float = Field(default=2.0, ge=0.0)
    queue_size: int = Field(default=64, ge=1)

    @field_validator("retrieval")
    @classmethod
    def _known_retrieval_keys(cls, value: Mapping[str, Any]) -> Mapping[str, Any]:
        try:
            RetrievalSettings.model_validate({**RetrievalSettings().model_dump(), **value})
        except ValidationError as exc:
            error = exc.errors()[0]
            raise ValueError(f"{'.'.join(str(p) for p in error['loc'])}: {error['msg']}") from None
        return dict(value)

    def alternative(self, live: RetrievalSettings) -> RetrievalSettings:
        """The live settings with this section's changes."""
        return RetrievalSettings.model_validate({**live.model_dump(), **self.retrieval})


@dataclasses.dataclass(frozen=True, slots=True)
class Agreement:
    """How two rankings of the same request agree at ``k``."""

    overlap: float  # |live ∩ shadow| / k, over the top k of each
    rank_correlation: float  # Spearman over the union, a missing item ranked k+1
    only_live: int
    only_shadow: int


def agreement(live: Sequence[str], shadow: Sequence[str], k: int) -> Agreement:
    """Compare the top ``k`` of two rankings of memory ids (pure)."""
    a, b = list(dict.fromkeys(live))[:k], list(dict.fromkeys(shadow))[:k]
    common = set(a) & set(b)
    union = list(dict.fromkeys([*a, *b]))
    if not union:
        return Agreement(1.0, 1.0, 0, 0)
    rank_a = np.array([a.index(i) if i in a else k for i in union], dtype=np.float64)
    rank_b = np.array([b.index(i) if i in b else k for i in union], dtype=np.float64)
    if rank_a.std() == 0 or rank_b.std() == 0:
        rho = 1.0 if np.array_equal(rank_a, rank_b) else 0.0
    else:
        rho = float(np.corrcoef(rank_a, rank_b)[0, 1])
    return Agreement(len(common) / k, rho, len(set(a) - common), len(set(b) - common))


class ShadowMetrics:
    """``memproxy_shadow_*`` in the app's registry."""

    def __init__(self, metrics: Metrics) -> None:
        registry = metrics.registry
        self.overlap = Histogram(
            "memproxy_shadow_overlap",
            "Overlap@k of the shadow and live rankings",
            buckets=_RATIO_BUCKETS,
            registry=registry,
        )
        self.correlation = Histogram(
            "memproxy_shadow_rank_correlation",
            "Spearman correlation of the rankings",
            buckets=_CORRELATION_BUCKETS,
            registry=registry,
        )
        self.only_found = Counter(
            "memproxy_shadow_only_found", "Memories in the top k of one ranking only", ["side"], registry=registry
        )
        self.runs = Counter("memproxy_shadow_runs", "Shadow comparisons by outcome", ["outcome"], registry=registry)
        self.seconds = Histogram(
            "memproxy_shadow_seconds", "Time of one shadow comparison (both rankings)", registry=registry
        )

    def record(self, result: Agreement, seconds: float) -> None:
        """Count one comparison."""
        self.overlap.observe(result.overlap)
        self.correlation.observe(result.rank_correlation)
        self.only_found.labels("live").inc(result.only_live)
        self.only_found.labels("shadow").inc(result.only_shadow)
        self.runs.labels("compared").inc()
        self.seconds.observe(seconds)


@dataclasses.dataclass
class _Sample:
    user_id: str
    conversation_id: str
    messages: list[dict[str, Any]]
    taken_at: float
    released: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)


class ShadowMemory:
    """Wraps the memory engine: same answers, plus shadow comparisons on a sample, run by an owned worker.

    The rest of ``MemoryService`` (storage fault, features, management, idle release, jobs) is the engine's.
    """

    def __init__(
        self, engine: MemoryEngine, settings: ShadowSettings, metrics: Metrics, *, rng: random.Random | None = None
    ) -> None:
        self._engine = engine
        self._settings = settings
        self._metrics = ShadowMetrics(metrics)
        self._alternative = settings.alternative(engine.settings.retrieval)
        self._rng = rng or random.Random()
        self._queue: asyncio.Queue[_Sample] = asyncio.Queue(settings.queue_size)
        self._waiting: OrderedDict[tuple[str, str], _Sample] = OrderedDict()
        self._task: asyncio.Task[None] | None = None

    @property
    def ready(self) -> bool:
        """The engine's readiness."""
        return self._engine.ready

    @property
    def storage_fault(self) -> str | None:
        """The engine's storage fault."""
        return self._engine.storage_fault

    @property
    def features(self) -> FeatureBoard:
        """The engine's feature board."""
        return self._engine.features

    @property
    def admin(self) -> MemoryAdmin:
        """The engine's management operations (shadow comparisons never change what they see)."""
        return self._engine.admin

    def release_idle(self) -> int:
        """The engine's idle release."""
        return self._engine.release_idle()

    async def jobs_busy(self) -> bool:
        """Whether the engine has a job due or running."""
        return await self._engine.jobs_busy()

    async def __aenter__(self) -> ShadowMemory:
        self._task = asyncio.create_task(self._run(), name="memory-shadow")
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def inject(self, request: ReadRequest) -> Injection:
        """The engine's injection, unchanged; a sampled request is queued for a shadow comparison."""
        injection: Injection = await self._engine.inject(request)
        if self._rng.random() < self._settings.sample_rate:
            messages = [dict(m) for m in request.messages]
            self._take(_Sample(request.user_id, request.conversation_id, messages, time.monotonic()))
        return injection

    def carried(self, request: ReadRequest) -> Injection:
        """The engine's answer."""
        carried: Injection = self._engine.carried(request)
        return carried

    async def record(self, exchange: Exchange) -> None:
        """The engine's write path; the exchange's response is done, so its shadow sample may run."""
        await self._engine.record(exchange)
        sample = self._waiting.pop((exchange.user_id, exchange.conversation_id), None)
        if sample is not None:
            sample.released.set()

    def _take(self, sample: _Sample) -> None:
        try:
            self._queue.put_nowait(sample)
        except asyncio.QueueFull:
            self._metrics.runs.labels("dropped").inc()
            return
        self._waiting[(sample.user_id, sample.conversation_id)] = sample
        while len(self._waiting) > self._settings.queue_size:
            self._waiting.popitem(last=False)

    async def _run(self) -> None:
        while True:
            sample = await self._queue.get()
            remaining = self._settings.settle_s - (time.monotonic() - sample.taken_at)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(sample.released.wait(), timeout=max(0.0, remaining))
            self._waiting.pop((sample.user_id, sample.conversation_id), None)
            try:
                await self.compare(sample.user_id, sample.conversation_id, sample.messages)
            except Exception as exc:  # a shadow failure is counted and logged, never more
                self._metrics.runs.labels("failed").inc()
                log.warning("shadow.failed", error=type(exc).__name__, detail=str(exc)[:200])

    async def _ranking(
        self, user_id: str, conversation_id: str, messages: list[dict[str, Any]], settings: RetrievalSettings
    ) -> list[str]:
        engine = self._engine
        result = await retrieve(
            engine.store,
            engine.embedder,
            messages,
            user_id,
            settings,
            utcnow(),
            conversation_id=conversation_id,
            names=engine.names,
            reranker=engine.reranker,
        )
        return [candidate.id for candidate in result.candidates]

    async def compare(self, user_id: str, conversation_id: str, messages: list[dict[str, Any]]) -> Agreement:
        """Rank the request's memories with both configurations and record how they agree."""
        started = time.perf_counter()
        live = await self._ranking(user_id, conversation_id, messages, self._engine.settings.retrieval)
        shadow = await self._ranking(user_id, conversation_id, messages, self._alternative)
        result = agreement(live, shadow, self._settings.k)
        seconds = time.perf_counter() - started
        self._metrics.record(result, seconds)
        log.info(
            "shadow.compared",
            k=self._settings.k,
            overlap=round(result.overlap, 3),
            rank_correlation=round(result.rank_correlation, 3),
            only_live=result.only_live,
            only_shadow=result.only_shadow,
            ms=round(seconds * 1000, 1),
        )
        return result
