"""The feature report: which memory features are live with this configuration, and why.

At start-up ``configured_features`` turns the settings (and, when the proxy holds a key for memory-side
calls, one ``GET {base_url}/models`` with it: ``probe_key``) into a ``FeatureState`` per feature; the app
seeds the memory engine's ``FeatureBoard`` with them and logs one ``memory.feature`` line per feature.
``/readyz`` lists the board (``readiness``), and ``FeatureCollector`` exposes it in ``/metrics``:
``memproxy_memory_feature_live{feature}`` (1 live, 0 off), ``memproxy_jobs_waiting{reason}`` (jobs waiting
now for a key or configuration) and ``memproxy_jobs_waits_total{reason}`` (times a job started waiting).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import aiohttp
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from proxy.config import Settings
from proxy.memory import FEATURES, FeatureBoard, FeatureState

WaitingSource = Callable[[], tuple[Mapping[str, int], Mapping[str, int]]]
PROBE_TIMEOUT_S = 5.0
WAIT_REASONS = ("no_key", "key_rejected", "no_model")


def _memory_model(settings: Settings, configured: str | None, fallback: str) -> str:
    model = configured or settings.memory_llm.model
    return f"model {model}" if model else fallback


def _memory_key(settings: Settings) -> str:
    """How memory-side calls on the default route get their key, in words."""
    if settings.memory_llm.api_key or settings.upstream.api_key.get_secret_value():
        return "the configured key"
    separate = settings.memory_llm.base_url and settings.memory_llm.base_url.rstrip("/") != settings.upstream.base_url
    if separate:
        return "no key ([memory_llm] base_url has no api_key; client keys only go to the chat's own upstream)"
    if not settings.memory_llm.hold_client_keys:
        return "no key (hold_client_keys = false and no key configured)"
    return "each user's own chat key, held in memory only (after a restart, jobs wait for the user's next chat)"


def configured_features(settings: Settings, rejected: str | None = None) -> dict[str, FeatureState]:
    """Each feature's state under ``settings``; ``rejected`` says why the configured key was refused."""
    if not settings.memory.enabled:
        off = FeatureState(False, "memory is off ([memory] enabled = false)")
        return dict.fromkeys(FEATURES, off)
    mode = settings.memory.default_mode
    key = _memory_key(settings)
    writes = _memory_model(settings, settings.writer.model, "each chat's own model and route")
    insights = _memory_model(
        settings, settings.insights.model or settings.writer.model, "each user's latest chat model and route"
    )
    states = {
        "retrieval": FeatureState(True, f"embedder {settings.embedder.label}; default mode {mode}"),
        "turns": FeatureState(True, f"stored after each reply; default mode {mode}"),
        "facts": FeatureState(True, f"{writes}; key: {key}"),
        "summaries": FeatureState(True, f"{writes}; key: {key}"),
        "insights": FeatureState(True, f"{insights}; key: {key}"),
    }
    if rejected is not None:
        for name in ("facts", "summaries", "insights"):
            states[name] = FeatureState(
                False, f"the upstream rejects the configured memory key ({rejected}); jobs wait until the key is fixed"
            )
    return states


async def probe_key(settings: Settings) -> str | None:
    """When the proxy holds a key for memory-side calls: ``"HTTP 401 on GET /models"`` if the upstream rejects
    it, else None (accepted, not checked, or not reachable now: calls retry by themselves)."""
    key = settings.memory_llm.api_key or settings.upstream.api_key
    if not key.get_secret_value():
        return None
    base_url = (settings.memory_llm.base_url or settings.upstream.base_url).rstrip("/")
    headers = {"Authorization": f"Bearer {key.get_secret_value()}"}
    try:
        timeout = aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S)
        async with (
            aiohttp.ClientSession(timeout=timeout) as session,
            session.get(f"{base_url}/models", headers=headers) as response,
        ):
            status = response.status
    except (aiohttp.ClientError, TimeoutError):
        return None
    return f"HTTP {status} on GET /models" if status in (401, 403) else None


async def report_features(settings: Settings, board: FeatureBoard | None) -> None:
    """Seed the board from the configuration (and key probe), then log one line per feature."""
    board = board or FeatureBoard()
    rejected = await probe_key(settings) if settings.memory.enabled else None
    board.configure(configured_features(settings, rejected))
    board.log_all()


def readiness(board: FeatureBoard | None, settings: Settings) -> dict[str, dict[str, Any]]:
    """The features for ``/readyz``: the board's, or what the configuration says when memory has none."""
    if board is not None:
        return board.report()
    return {name: {"live": s.live, "reason": s.reason} for name, s in configured_features(settings).items()}


class FeatureCollector(Collector):
    """Prometheus view of the board and of the jobs waiting for a key or configuration."""

    def __init__(self, board: FeatureBoard, waiting: WaitingSource) -> None:
        self._board = board
        self._waiting = waiting

    def collect(self) -> Iterable[Metric]:
        live = GaugeMetricFamily(
            "memproxy_memory_feature_live", "Memory feature live (1) or off (0)", labels=["feature"]
        )
        for name, value in self._board.gauges().items():
            live.add_metric([name], value)
        now, total = self._waiting()
        waiting = GaugeMetricFamily(
            "memproxy_jobs_waiting", "Jobs waiting for a key or configuration", labels=["reason"]
        )
        waits = CounterMetricFamily(
            "memproxy_jobs_waits", "Times a job started waiting for a key or configuration", labels=["reason"]
        )
        for reason in sorted({*WAIT_REASONS, *now, *total}):
            waiting.add_metric([reason], float(now.get(reason, 0)))
            waits.add_metric([reason], float(total.get(reason, 0)))
        yield from (live, waiting, waits)
