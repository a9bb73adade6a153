"""Traces: OpenTelemetry spans over OTLP/HTTP when an endpoint is configured, nothing otherwise.

``tracing`` (entered by the app's lifecycle) builds the SDK's tracer provider (``service.name``, a parent-based
ratio sampler, a batch processor to the OTLP exporter) and switches ``proxy.memory.spans`` on; on exit it
flushes and switches them off. The SDK is the optional extra ``memproxy[otel]``: with an endpoint configured and
the extra missing, memproxy starts without traces and says so once (``telemetry.unavailable``).

``tracing_middleware`` makes one server span per chat request, the incoming ``traceparent`` as its parent; the
steps inside add their children (``memory.spans``): parse, retrieve (and each arm), upstream, and the write-side
job that stores the exchange (its payload carries the request's ``traceparent``). Tracing off, the middleware
costs one function call and one ``None`` check.
"""

from __future__ import annotations

import contextlib
import importlib
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import structlog
from aiohttp import web

from proxy.memory import Injection, spans
from proxy.paths import MEMORY_PATHS
from proxy.state import STATE
from proxy.telemetry.settings import TelemetrySettings

log = structlog.get_logger("memproxy.telemetry")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")


def otlp_endpoint(settings: TelemetrySettings, environ: Mapping[str, str]) -> str | None:
    """The traces URL: ``telemetry.otlp_endpoint``, else the standard variables; ``/v1/traces`` added to a bare
    base URL (the OTLP/HTTP convention); None when none is set."""
    configured = settings.otlp_endpoint or next((environ[n] for n in ENDPOINT_VARIABLES if environ.get(n)), "")
    if not configured:
        return None
    if configured == environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        return configured
    return configured if configured.rstrip("/").endswith("/v1/traces") else configured.rstrip("/") + "/v1/traces"


def tracer_provider(settings: TelemetrySettings, processor: Any) -> Any:
    """The SDK's tracer provider with ``processor`` (raises ``ImportError`` without the ``otel`` extra)."""
    sdk = importlib.import_module("opentelemetry.sdk.trace")
    sampling = importlib.import_module("opentelemetry.sdk.trace.sampling")
    resources = importlib.import_module("opentelemetry.sdk.resources")
    sampler = sampling.ParentBased(sampling.TraceIdRatioBased(settings.sample_ratio))
    provider = sdk.TracerProvider(
        resource=resources.Resource.create({"service.name": settings.service_name}), sampler=sampler
    )
    provider.add_span_processor(processor)
    return provider


def switch_on(provider: Any) -> None:
    """Spans from ``provider``'s tracer, with W3C trace-context propagation."""
    propagation = importlib.import_module("opentelemetry.trace.propagation.tracecontext")
    spans.install(provider.get_tracer("memproxy"), propagation.TraceContextTextMapPropagator())


@contextlib.asynccontextmanager
async def tracing(settings: TelemetrySettings, environ: Mapping[str, str]) -> AsyncIterator[bool]:
    """Traces to the configured OTLP endpoint for the block (see the module doc); whether they are on."""
    endpoint = otlp_endpoint(settings, environ)
    if endpoint is None:
        yield False
        return
    try:
        exporter = importlib.import_module("opentelemetry.exporter.otlp.proto.http.trace_exporter")
        export = importlib.import_module("opentelemetry.sdk.trace.export")
        provider = tracer_provider(settings, export.BatchSpanProcessor(exporter.OTLPSpanExporter(endpoint=endpoint)))
    except ImportError:
        log.warning("telemetry.unavailable", reason="install the otel extra: pip install 'memproxy[otel]'")
        yield False
        return
    switch_on(provider)
    log.info("telemetry.started", endpoint=endpoint)
    try:
        yield True
    finally:
        spans.install(None, None)
        provider.shutdown()


def record_retrieve(injection: Injection) -> None:
    """The read path's span: how long it took, what it injected, which arms ran and which could not."""
    if not spans.enabled():
        return
    degraded = ",".join(f"{arm}:{reason}" for arm, reason in injection.degraded.items())
    attributes = {"memproxy.injected": len(injection.injected_ids), "memproxy.arms": ",".join(injection.arms)}
    spans.record_span(
        "memproxy.retrieve", injection.retrieval_ms / 1000, **attributes, **{"memproxy.degraded": degraded}
    )


@web.middleware
async def tracing_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """One server span per chat request (its ``traceparent`` header as the parent)."""
    if not spans.enabled() or request.path not in MEMORY_PATHS:
        return await handler(request)
    parent = request.headers.get("traceparent")
    with spans.job_span("chat " + request.path, parent, **{"http.request.method": request.method}) as current:
        response = await handler(request)
        current.set_attribute("http.response.status_code", response.status)
        return response


def install_tracing(app: web.Application) -> None:
    """The request spans (outermost middleware, so a refused request has one too) and the tracer's lifetime."""
    app.middlewares.insert(0, tracing_middleware)

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        async with tracing(app[STATE].settings.telemetry, os.environ):
            yield

    app.cleanup_ctx.append(lifecycle)
