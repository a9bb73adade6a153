"""/metrics by the Prometheus conventions, trace context forwarded upstream, and the Grafana dashboard's queries."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

from aiohttp.test_utils import TestClient
from prometheus_client.parser import text_string_to_metric_families

from proxy.metrics import MAX_MODEL_LABELS, Metrics
from proxy.state import STATE
from tests.conftest import ProxyFactory
from tests.fake_upstream import FakeUpstream

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "deploy" / "grafana-dashboard.json"
CHAT = "/v1/chat/completions"
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
_SUFFIXES = {
    "counter": ("_total",),
    "histogram": ("_bucket", "_sum", "_count"),
    "gauge": ("",),
    "summary": ("_sum", "_count", ""),
}


def _chat(text: str, model: str = "fake-echo") -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": text}]}


async def _scrape(proxy: TestClient[Any, Any]) -> str:
    response = await proxy.get("/metrics")
    assert response.status == 200
    return await response.text()


async def _after_memory_traffic(proxy: TestClient[Any, Any]) -> str:
    """/metrics once a chat's write path (turns, facts through the memory LLM) has completed."""
    assert (await proxy.post(CHAT, json=_chat("I play the oboe."), headers={"X-Memory-User": "mia"})).status == 200
    assert (await proxy.post(CHAT, json=_chat("x", "fake-error-500"))).status == 500
    for _ in range(200):
        text = await _scrape(proxy)
        completed = re.search(r"^memproxy_jobs_completed_total [1-9]", text, re.M)
        if completed and "memproxy_memory_llm_tokens_total{" in text:
            return text
        await asyncio.sleep(0.1)
    raise AssertionError("the write path did not complete:\n" + text)


def exported_names(metrics: Metrics) -> set[str]:
    """Every sample name the registry can export (families with no sample yet included)."""
    names = set()
    for family in metrics.registry.collect():
        names.update(family.name + suffix for suffix in _SUFFIXES.get(family.type, ("",)))
    return names


async def test_metrics_use_labels_histograms_and_counters(make_proxy: ProxyFactory) -> None:
    """No `_avg`/`_max` gauges; job and chat durations are labelled histograms, totals are counters."""
    proxy = await make_proxy()
    text = await _after_memory_traffic(proxy)
    families = {family.name: family for family in text_string_to_metric_families(text)}
    assert not [name for name in families if re.search(r"_(avg|max)$", name)]
    assert families["memproxy_job_step_seconds"].type == "histogram"
    assert families["memproxy_job_seconds"].type == "histogram"
    assert families["memproxy_jobs_completed"].type == "counter"
    assert families["memproxy_jobs_storage_faults"].type == "counter"
    assert families["memproxy_embedder_texts"].type == "counter"
    assert families["memproxy_embedder_cache_pinned"].type == "gauge"
    assert re.search(r"^memproxy_embedder_texts_total [1-9]", text, re.M)  # the query, then the turns
    assert 'memproxy_job_step_seconds_bucket{le="+Inf",step="turns"}' in text
    assert re.search(r'memproxy_job_seconds_count\{kind="exchange"\} [1-9]', text)
    assert re.search(r'memproxy_chat_seconds_count\{model="fake-echo",route="default"\} 1\.0', text)
    assert re.search(r'memproxy_upstream_ttfb_seconds_count\{model="fake-error-500",route="default"\} 1\.0', text)
    prompt = [
        s
        for s in families["memproxy_memory_llm_tokens"].samples
        if s.name.endswith("_total") and s.labels["type"] == "prompt"
    ]
    assert prompt
    assert all(s.labels["model"] == "fake-echo" for s in prompt)
    assert sum(s.value for s in prompt) >= 10  # the fake upstream reports 10 prompt tokens per call


async def test_dashboard_queries_name_exported_metrics(make_proxy: ProxyFactory) -> None:
    """Every query of deploy/grafana-dashboard.json names only metrics memproxy exports."""
    proxy = await make_proxy()
    await _after_memory_traffic(proxy)
    exported = exported_names(proxy.app[STATE].metrics)
    dashboard = json.loads(DASHBOARD.read_text())
    queries = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    assert len(queries) >= 15
    named = {name for query in queries for name in re.findall(r"\bmemproxy_[a-z_]+", query)}
    assert named, "the dashboard names no memproxy metric"
    assert named <= exported, sorted(named - exported)


async def test_client_trace_context_reaches_the_upstream(make_proxy: ProxyFactory, fake: FakeUpstream) -> None:
    """A client's traceparent and tracestate arrive at the upstream unchanged, so the trace continues there."""
    proxy = await make_proxy()
    headers = {"traceparent": TRACEPARENT, "tracestate": "vendor=abc", "X-Memory-Mode": "off"}
    assert (await proxy.post(CHAT, json=_chat("hello"), headers=headers)).status == 200
    seen = {k.lower(): v for k, v in fake.requests[-1]["headers"].items()}
    assert seen["traceparent"] == TRACEPARENT
    assert seen["tracestate"] == "vendor=abc"


def test_model_label_is_capped() -> None:
    """Client-chosen model names cannot grow the label set without bound: the excess counts as `other`."""
    metrics = Metrics()
    for i in range(MAX_MODEL_LABELS + 10):
        metrics.observe_chat("default", f"model-{i}", 0.01)
    models = {
        s.labels["model"] for f in metrics.registry.collect() if f.name == "memproxy_chat_seconds" for s in f.samples
    }
    assert len(models) == MAX_MODEL_LABELS + 1
    assert "other" in models
