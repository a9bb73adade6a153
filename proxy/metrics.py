"""Prometheus metrics, one registry per app (so tests can build several apps in one process).

By the Prometheus conventions: durations are histograms in seconds with what varies as labels (``stage``,
``route``, ``model``, job ``kind`` and ``step``), totals are counters (``_total``), current levels are gauges.
The job queue's numbers are read from its snapshot at scrape time (``QueueCollector``). The ``model`` label
comes from clients, so it is capped: past ``MAX_MODEL_LABELS`` distinct names, new ones count as ``other``.
``deploy/grafana-dashboard.json`` is built on these names (a test checks every query names one of them).
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable, Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest, multiprocess
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from proxy.memory.write import LATENCY_BUCKETS_S, QueueMetrics, StepLatency

# Seconds: fine resolution below 10 ms, where the proxy's own stages live.
_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

GaugeSource = Callable[[], Mapping[str, float]]
Refresh = Callable[[], Awaitable[None]]
QueueSource = Callable[[], QueueMetrics | None]
MAX_MODEL_LABELS = 50
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
_JOB_COUNTERS = (
    ("completed", "Memory jobs completed"),
    ("failed", "Memory job attempts that failed"),
    ("deferred", "Memory jobs deferred while a dependency was down"),
    ("dead", "Memory jobs that gave up (dead letters)"),
)


class _GaugeCollector(Collector):
    """Reads numbers from a component at scrape time (queue depth, oldest job age...); a name ending in
    ``_total`` is a counter."""

    def __init__(self, prefix: str, source: GaugeSource) -> None:
        self._prefix = prefix
        self._source = source

    def collect(self) -> Iterable[Metric]:
        for name, value in self._source().items():
            text = f"{self._prefix} {name.removesuffix('_total').replace('_', ' ')}"
            if name.endswith("_total"):
                yield CounterMetricFamily(f"{self._prefix}_{name.removesuffix('_total')}", text, value=float(value))
            else:
                yield GaugeMetricFamily(f"{self._prefix}_{name}", text, value=float(value))


class _PartsCollector(Collector):
    """One gauge with a ``part`` label, read from a component at scrape time (bytes held per cache)."""

    def __init__(self, name: str, text: str, source: GaugeSource) -> None:
        self._name = name
        self._text = text
        self._source = source

    def collect(self) -> Iterable[Metric]:
        family = GaugeMetricFamily(self._name, self._text, labels=["part"])
        for part, value in self._source().items():
            family.add_metric([part], float(value))
        yield family


def _buckets(latency: StepLatency) -> list[tuple[str, float]]:
    """Cumulative Prometheus buckets from the queue's per-bucket counts."""
    out, running = [], 0
    for bound, count in zip(LATENCY_BUCKETS_S, latency.buckets, strict=True):
        running += count
        out.append((repr(float(bound)), float(running)))
    out.append(("+Inf", float(latency.count)))
    return out


class QueueCollector(Collector):
    """The job queue at scrape time: levels as gauges, totals as counters, durations as histograms."""

    def __init__(self, source: QueueSource) -> None:
        self._source = source

    def collect(self) -> Iterable[Metric]:
        snap = self._source()
        if snap is None:
            return
        yield from self._levels(snap)
        for name, text in _JOB_COUNTERS:
            counter = CounterMetricFamily(f"memproxy_jobs_{name}", text)
            counter.add_metric([], float(getattr(snap, f"{name}_total")))
            yield counter
        yield from self._durations(snap)

    def _levels(self, snap: QueueMetrics) -> Iterable[Metric]:
        levels = {
            "depth": (snap.depth, "Unfinished jobs"),
            "ready": (snap.ready, "Jobs due now"),
            "scheduled": (snap.scheduled, "Jobs waiting for a later time"),
            "running": (snap.running, "Jobs running"),
            "dead_letters": (snap.dead, "Dead jobs kept"),
            "oldest_age_seconds": (snap.oldest_age_s, "Age of the oldest due job"),
        }
        for name, (value, text) in levels.items():
            yield GaugeMetricFamily(f"memproxy_jobs_{name}", text, value=float(value))
        queued = GaugeMetricFamily("memproxy_jobs_queued", "Unfinished jobs by kind", labels=["kind"])
        for kind, count in sorted(snap.depth_by_kind.items()):
            queued.add_metric([kind], float(count))
        yield queued

    def _durations(self, snap: QueueMetrics) -> Iterable[Metric]:
        jobs = HistogramMetricFamily("memproxy_job_seconds", "Duration of a successful job", labels=["kind"])
        steps = HistogramMetricFamily("memproxy_job_step_seconds", "Duration of a job step", labels=["step"])
        for name, latency in sorted(snap.step_latency.items()):
            family, label = (jobs, name.removeprefix("job.")) if name.startswith("job.") else (steps, name)
            family.add_metric([label], _buckets(latency), latency.sum_s)
        yield jobs
        yield steps


class Metrics:
    """The proxy's counters and histograms."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        # ``memproxy serve``'s processes (``PROMETHEUS_MULTIPROC_DIR``, set by the supervisor): counters and
        # histograms live in files there, and a scrape of any chat process sums them over every process (the
        # writer's included); the collectors of this process's components are rendered beside them.
        self._shared_dir = os.environ.get(MULTIPROC_ENV) or None
        self._collectors = CollectorRegistry()
        self.requests = Counter("memproxy_requests", "Requests served", ["endpoint", "status"], registry=self.registry)
        self.stage_seconds = Histogram(
            "memproxy_stage_seconds", "Time per request stage", ["stage"], buckets=_BUCKETS, registry=self.registry
        )
        self.upstream_errors = Counter(
            "memproxy_upstream_errors", "Upstream failures", ["kind"], registry=self.registry
        )
        self.memory_degraded = Counter(
            "memproxy_memory_degraded", "Requests served with degraded memory", ["component"], registry=self.registry
        )
        self.vector_cache_lookups = Counter(
            "memproxy_vector_cache_lookups",
            "Reads' lookups of a user's vectors: hit, spilled (read back from the spill files), miss (loaded from"
            " LanceDB), too_big (searched on disk)",
            ["result"],
            registry=self.registry,
        )
        self._lookups = {
            result: self.vector_cache_lookups.labels(result) for result in ("hit", "spilled", "miss", "too_big")
        }
        # ``memproxy serve``'s chat processes (``chat_routing``): summed over them, as every counter here
        self._routing = {
            "relayed": Counter(
                "memproxy_routing_relayed",
                "Chats relayed to their user's chat process",
                registry=self.registry,
            ),
            "handed_off": Counter(
                "memproxy_routing_handed_off",
                "Client connections handed to their user's chat process with a chat (served there from then on)",
                registry=self.registry,
            ),
            "owner_unreachable": Counter(
                "memproxy_routing_owner_unreachable",
                "Relays that found their user's chat process away (served where they arrived)",
                registry=self.registry,
            ),
        }
        self._stages: dict[str, Histogram] = {}
        self._refreshers: list[Refresh] = []
        self.injected = Histogram(
            "memproxy_memories_injected",
            "Memories injected per request",
            buckets=(0, 1, 2, 5, 10, 20, 50),
            registry=self.registry,
        )
        self.chat_seconds = Histogram(
            "memproxy_chat_seconds",
            "Chat request duration, end to end",
            ["route", "model"],
            buckets=_BUCKETS,
            registry=self.registry,
        )
        self.upstream_seconds = Histogram(
            "memproxy_upstream_ttfb_seconds",
            "Time to the upstream's first byte",
            ["route", "model"],
            buckets=_BUCKETS,
            registry=self.registry,
        )
        self.memory_llm_tokens = Counter(
            "memproxy_memory_llm_tokens",
            "Tokens of memory-side LLM calls",
            ["call", "model", "type"],
            registry=self.registry,
        )
        self.memory_llm_calls = Counter(
            "memproxy_memory_llm_calls", "Memory-side LLM calls answered", ["call", "model"], registry=self.registry
        )
        self._models: set[str] = set()
        # (histogram, route, model) -> its child: ``labels()`` takes a lock and builds its key on every call
        self._routed: dict[tuple[Histogram, str, str], Histogram] = {}

    def add_gauges(self, prefix: str, source: GaugeSource, refresh: Refresh | None = None) -> None:
        """Expose the numbers ``source`` returns at every scrape as ``<prefix>_<name>`` gauges.

        ``refresh`` (async) runs before each scrape, for sources whose numbers need I/O to collect.
        """
        self.register(_GaugeCollector(prefix, source))
        if refresh is not None:
            self._refreshers.append(refresh)

    def vector_cache_lookup(self, result: str) -> None:
        """Count one read's vector cache lookup (``VectorCache.observe``)."""
        self._lookups[result].inc()

    def routed(self, outcome: str) -> None:
        """Count one chat relayed to its user's chat process (``relayed``), one whose connection was handed to
        it (``handed_off``) or one whose process was away (``owner_unreachable``): ``ChatRouter.observe``."""
        self._routing[outcome].inc()

    def add_memory_parts(self, source: GaugeSource) -> None:
        """Expose ``memproxy_memory_bytes{part}``: bytes each bounded part of this process holds (``source``)."""
        self.register(_PartsCollector("memproxy_memory_bytes", "Bytes held, per bounded part", source))

    async def refresh(self) -> None:
        """Update the gauges that need I/O (before rendering)."""
        for refresh in self._refreshers:
            await refresh()

    def add_queue(self, source: QueueSource, refresh: Refresh | None = None) -> None:
        """Expose the job queue's snapshot (``source``, refreshed by ``refresh`` before each scrape)."""
        self.register(QueueCollector(source))
        if refresh is not None:
            self._refreshers.append(refresh)

    def model_label(self, model: object) -> str:
        """``model`` as a label value, capped at ``MAX_MODEL_LABELS`` distinct names (then ``other``)."""
        name = str(model or "")[:100]
        if name in self._models or len(self._models) < MAX_MODEL_LABELS:
            self._models.add(name)
            return name
        return "other"

    def _by_route(self, histogram: Histogram, route: str, model: object) -> Histogram:
        key = (histogram, route or "none", self.model_label(model))
        child = self._routed.get(key)
        if child is None:
            child = self._routed[key] = histogram.labels(key[1], key[2])
        return child

    def observe_chat(self, route: str, model: object, seconds: float) -> None:
        """One chat request's total duration."""
        self._by_route(self.chat_seconds, route, model).observe(seconds)

    def observe_upstream(self, route: str, model: object, seconds: float) -> None:
        """The upstream's time to first byte; also the ``upstream_ttfb`` stage."""
        self._by_route(self.upstream_seconds, route, model).observe(seconds)
        self.observe("upstream_ttfb", seconds)

    def observe_llm_usage(self, call: str, model: str, usage: Mapping[str, object]) -> None:
        """Tokens of one memory-side LLM call (``usage`` as OpenAI reports it)."""
        label = self.model_label(model)
        self.memory_llm_calls.labels(call, label).inc()
        for kind in ("prompt", "completion"):
            value = usage.get(f"{kind}_tokens")
            if isinstance(value, int) and value >= 0:
                self.memory_llm_tokens.labels(call, label, kind).inc(value)

    def observe(self, stage: str, seconds: float) -> None:
        """Record the duration of one request stage."""
        child = self._stages.get(stage)
        if child is None:
            child = self._stages[stage] = self.stage_seconds.labels(stage)
        child.observe(seconds)

    def register(self, collector: Collector) -> None:
        """Add a component's collector (read at scrape time, this process's numbers)."""
        self.registry.register(collector)
        self._collectors.register(collector)

    def render_collectors(self) -> bytes:
        """The exposition of this process's components only (no counters or histograms)."""
        return generate_latest(self._collectors)

    def render(self) -> bytes:
        """The Prometheus text exposition."""
        if self._shared_dir is None:
            return generate_latest(self.registry)
        shared = CollectorRegistry()
        multiprocess.MultiProcessCollector(shared, self._shared_dir)  # type: ignore[no-untyped-call]
        return generate_latest(shared) + generate_latest(self._collectors)
