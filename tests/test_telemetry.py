"""Traces with the SDK's in-memory exporter: the real app, the real engine, the fake upstream on 127.0.0.1."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from proxy.app import build_app
from proxy.memory import spans
from proxy.telemetry import TelemetrySettings
from proxy.telemetry.tracing import otlp_endpoint, switch_on, tracer_provider
from tests.fake_upstream import FakeUpstream
from tests.support.live_app import admin_settings
from tests.support.polling import eventually

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"


@pytest.fixture
def exported() -> Iterator[InMemorySpanExporter]:
    """Spans on, into an in-memory exporter, for the test."""
    exporter = InMemorySpanExporter()
    provider = tracer_provider(TelemetrySettings(), SimpleSpanProcessor(exporter))
    switch_on(provider)
    try:
        yield exporter
    finally:
        spans.install(None, None)
        provider.shutdown()


def _by_name(exporter: InMemorySpanExporter) -> dict[str, Any]:
    return {span.name: span for span in exporter.get_finished_spans()}


async def test_a_chat_request_is_one_trace_from_its_traceparent_to_the_job_that_stores_it(
    exported: InMemorySpanExporter, tmp_path: Path
) -> None:
    """The request span continues the caller's trace; parse, retrieve and upstream are its children; the exchange
    job that stores the reply is in the same trace."""
    async with FakeUpstream() as upstream:
        settings = admin_settings(upstream={"base_url": upstream.base_url}, storage={"path": str(tmp_path)})
        client = TestClient(TestServer(build_app(settings), host="127.0.0.1"))
        await client.start_server()
        try:
            reply = await client.post(
                "/v1/chat/completions",
                json={"model": "fake-echo", "messages": [{"role": "user", "content": "I keep bees in Devon."}]},
                headers={"X-Memory-User": "tess", "traceparent": PARENT, "Authorization": "Bearer sk-app"},
            )
            assert reply.status == 200, await reply.text()

            async def stored() -> bool:
                return "memproxy.job.exchange" in _by_name(exported)

            await eventually(stored, within_s=30)
        finally:
            await client.close()
    found = _by_name(exported)
    request = found["chat /v1/chat/completions"]
    assert format(request.context.trace_id, "032x") == TRACE_ID
    assert request.attributes["http.response.status_code"] == 200
    for child in ("memproxy.parse", "memproxy.retrieve", "memproxy.upstream"):
        assert found[child].parent.span_id == request.context.span_id, child
    assert "memproxy.injected" in found["memproxy.retrieve"].attributes
    assert format(found["memproxy.job.exchange"].context.trace_id, "032x") == TRACE_ID


def test_no_endpoint_no_traces_and_the_standard_variable_is_read() -> None:
    """Without an endpoint nothing is traced; OTEL_EXPORTER_OTLP_ENDPOINT is a base URL, the config's too."""
    assert otlp_endpoint(TelemetrySettings(), {}) is None
    base = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}
    assert otlp_endpoint(TelemetrySettings(), base) == "http://127.0.0.1:4318/v1/traces"
    exact = {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:4318/custom"}
    assert otlp_endpoint(TelemetrySettings(), exact) == "http://127.0.0.1:4318/custom"
    configured = TelemetrySettings(otlp_endpoint="http://collector:4318/")
    assert otlp_endpoint(configured, base) == "http://collector:4318/v1/traces"


def test_spans_are_no_ops_while_tracing_is_off() -> None:
    """Off, the helpers make nothing and carry no traceparent."""
    assert not spans.enabled()
    with spans.span("x") as nothing:
        assert nothing is None
    spans.record_span("y", 0.1)
    assert spans.current_traceparent() is None
