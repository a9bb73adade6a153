"""HTTP handlers of the proxy: the memory dialects (chat completions, Responses, Messages), models, health,
readiness, metrics, and every other ``/v1`` path relayed as it is.

Each memory dialect's request runs through ``proxy.relay.MemoryCall``; other ``/v1`` paths through
``proxy.passthrough``.
"""

from __future__ import annotations

from typing import Any

import structlog
from aiohttp import web

from proxy.dialects import CHAT, MESSAGES, RESPONSES, Dialect
from proxy.errors import ProxyError
from proxy.feature_report import readiness
from proxy.passthrough import anthropic_path, openai_path
from proxy.paths import CHAT_PATHS, MESSAGES_PATHS, RESPONSES_PATHS
from proxy.relay import MemoryCall, storage_degraded
from proxy.relay_memory import merged_metrics
from proxy.state import STATE

log = structlog.get_logger("memproxy.request")


async def _serve(request: web.Request, dialect: Dialect) -> web.StreamResponse:
    state = request.app[STATE]
    call = MemoryCall(request, state, dialect)
    try:
        response = await call.run()
    except ProxyError as exc:
        call.status = exc.status
        state.metrics.requests.labels(dialect.name, str(exc.status)).inc()
        raise
    finally:
        structlog.contextvars.clear_contextvars()
    state.metrics.requests.labels(dialect.name, str(response.status)).inc()
    return response


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """``POST /v1/chat/completions``."""
    return await _serve(request, CHAT)


async def responses(request: web.Request) -> web.StreamResponse:
    """``POST /v1/responses`` (OpenAI's Responses API)."""
    return await _serve(request, RESPONSES)


async def messages(request: web.Request) -> web.StreamResponse:
    """``POST /v1/messages`` (Anthropic's Messages API)."""
    return await _serve(request, MESSAGES)


async def list_models(request: web.Request) -> web.Response:
    """``GET /v1/models``: the default upstream's list, relayed."""
    state = request.app[STATE]
    status, data = await state.router.default.models(request.headers)
    return web.Response(status=status, body=data, content_type="application/json")


async def healthz(request: web.Request) -> web.Response:
    """``GET /healthz``: the process is alive."""
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    """``GET /readyz``: ready when the chat path is (memory off for a storage fault included); every memory
    feature listed as live or off, with why, and a storage fault named."""
    state = request.app[STATE]
    memory = state.memory
    storage = storage_degraded(state)
    ready = not state.stopping
    features = readiness(memory.features, state.settings)
    body: dict[str, Any] = {"status": "ready" if ready else "not ready", "memory": memory.ready, "features": features}
    if storage:
        body["storage"] = storage
    return web.json_response(body, status=200 if ready else 503)


async def metrics(request: web.Request) -> web.Response:
    """``GET /metrics``: Prometheus text."""
    state = request.app[STATE]
    await state.metrics.refresh()
    if request.query.get("collectors") == "only":  # the writer's components, for a chat process to merge
        return web.Response(body=state.metrics.render_collectors(), content_type="text/plain", charset="utf-8")
    body = state.metrics.render()
    if state.extra_metrics is not None:
        body = merged_metrics(body, await state.extra_metrics())
    return web.Response(body=body, content_type="text/plain", charset="utf-8")


def add_routes(app: web.Application) -> None:
    """Register the proxy's routes (``add_relayed_routes`` last, after every other ``/v1`` route)."""
    for path in CHAT_PATHS:
        app.router.add_post(path, chat_completions)
    for path in RESPONSES_PATHS:
        app.router.add_post(path, responses)
    for path in MESSAGES_PATHS:
        app.router.add_post(path, messages)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)


def add_relayed_routes(app: web.Application) -> None:
    """Every other ``/v1`` path, any method, relayed without memory (``proxy.passthrough``): registered after
    every other route, so that a route of memproxy's own always matches first."""
    app.router.add_route("*", "/v1/messages/{tail:.+}", anthropic_path)
    app.router.add_route("*", r"/v1/{tail:(?!memory(?:/|$)).+}", openai_path)  # never the management API
