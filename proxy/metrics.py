"""Prometheus metrics, one registry per app (so tests can build several apps in one process)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

# Seconds: fine resolution below 10 ms, where the proxy's own stages live.
_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

GaugeSource = Callable[[], Mapping[str, float]]
Refresh = Callable[[], Awaitable[None]]


class _GaugeCollector(Collector):
    """Reads numbers from a component at scrape time (queue depth, oldest job age...)."""

    def __init__(self, prefix: str, source: GaugeSource) -> None:
        self._prefix = prefix
        self._source = source

    def collect(self) -> Iterable[Metric]:
        for name, value in self._source().items():
            family = GaugeMetricFamily(f"{self._prefix}_{name}", f"{self._prefix} {name.replace('_', ' ')}")
            family.add_metric([], float(value))
            yield family


class Metrics:
    """The proxy's counters and histograms."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("memproxy_requests", "Requests served", ["endpoint", "status"],
                                registry=self.registry)
        self.stage_seconds = Histogram("memproxy_stage_seconds", "Time per request stage",
                                       ["stage"], buckets=_BUCKETS, registry=self.registry)
        self.upstream_errors = Counter("memproxy_upstream_errors", "Upstream failures", ["kind"],
                                       registry=self.registry)
        self.memory_degraded = Counter("memproxy_memory_degraded", "Requests served with degraded memory",
                                       ["component"], registry=self.registry)
        self._stages: dict[str, Histogram] = {}
        self._refreshers: list[Refresh] = []
        self.injected = Histogram("memproxy_memories_injected", "Memories injected per request",
                                  buckets=(0, 1, 2, 5, 10, 20, 50), registry=self.registry)

    def add_gauges(self, prefix: str, source: GaugeSource, refresh: Refresh | None = None) -> None:
        """Expose the numbers ``source`` returns at every scrape as ``<prefix>_<name>`` gauges.

        ``refresh`` (async) runs before each scrape, for sources whose numbers need I/O to collect.
        """
        self.registry.register(_GaugeCollector(prefix, source))
        if refresh is not None:
            self._refreshers.append(refresh)

    async def refresh(self) -> None:
        """Update the gauges that need I/O (before rendering)."""
        for refresh in self._refreshers:
            await refresh()

    def observe(self, stage: str, seconds: float) -> None:
        """Record the duration of one request stage."""
        child = self._stages.get(stage)
        if child is None:
            child = self._stages[stage] = self.stage_seconds.labels(stage)
        child.observe(seconds)

    def render(self) -> bytes:
        """The Prometheus text exposition."""
        return generate_latest(self.registry)
