"""The app factory: every component is built here, in one ``AsyncExitStack``, and closed in reverse.

``build_app`` takes the settings and, for tests, a factory for the memory service; it returns an aiohttp
application whose ``cleanup_ctx`` opens the upstream session, the memory service and its background workers
on startup and drains them on shutdown.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from pydantic import SecretStr

from proxy.access import install_access
from proxy.bounds import body_deadline_middleware
from proxy.commit import ExchangeCommitter
from proxy.config import Settings
from proxy.dialects.anthropic_upstream import AnthropicUpstream
from proxy.dialects.targets import Targets
from proxy.engine import EngineSettings, MemoryEngine
from proxy.errors import error_middleware
from proxy.feature_report import FeatureCollector, report_features
from proxy.header_bytes import install_header_check
from proxy.management import add_management_routes, add_operations_routes
from proxy.mcp import add_mcp_routes
from proxy.memory import FeatureBoard, MemoryService, NullMemory, ReportingLLM
from proxy.memory.write import (
    ANTHROPIC_ROUTE,
    DialectLLM,
    DialectRouter,
    KeySource,
    LatestChats,
    LiteLLMClient,
    LiteLLMSettings,
    LLMClient,
    OpenAICompatibleLLM,
    OpenAICompatibleSettings,
    PrefixRouter,
    Route,
    UsageObserver,
)
from proxy.metrics import Metrics
from proxy.mirror import Mirror
from proxy.relay_memory import add_memory_relay, writer_metrics
from proxy.routes import add_relayed_routes, add_routes
from proxy.shadow import ShadowMemory
from proxy.state import STATE, AppState
from proxy.telemetry import install_tracing
from proxy.unavailable import open_memory_or_unavailable
from proxy.upstream import Router, build_router, build_session

MemoryFactory = Callable[[Settings, Metrics], contextlib.AbstractAsyncContextManager[MemoryService]]


@contextlib.asynccontextmanager
async def null_memory(settings: Settings, metrics: Metrics) -> AsyncIterator[MemoryService]:
    """No memory at all: the proxy is a pure passthrough."""
    yield NullMemory()


def keyed_routes(settings: Settings) -> set[str]:
    """The chat routes that pass the client's own key upstream (OpenAI-compatible or Anthropic's API, no key
    configured)."""
    routes = {"default", "responses:default"} if not settings.upstream.api_key.get_secret_value() else set()
    if settings.upstream.anthropic_base_url and not settings.upstream.anthropic_api_key.get_secret_value():
        routes.add(ANTHROPIC_ROUTE)
    return routes | {
        f"openai:{r.prefix}"
        for r in settings.routes
        if r.provider == "openai" and not (r.api_key and r.api_key.get_secret_value())
    }


def memory_llm(
    settings: Settings, keys: KeySource | None = None, on_usage: UsageObserver | None = None
) -> tuple[LLMClient, list[LLMClient]]:
    """The client for memory-side model calls (the chat's own routes, or ``[memory_llm]`` when set), and
    the clients behind it (to open and close). ``keys`` gives each user's held chat key, used only where
    the chat itself sends the client's key (the same route, the same base URL); ``on_usage`` gets the token
    counts of every answer."""
    key = settings.memory_llm.api_key or settings.upstream.api_key
    base_url = settings.memory_llm.base_url or settings.upstream.base_url
    same_server = base_url.rstrip("/") == settings.upstream.base_url
    default = OpenAICompatibleLLM(
        OpenAICompatibleSettings(
            base_url=base_url,
            api_key=key,
            timeout_s=settings.memory_llm.timeout_s,
            temperature=settings.memory_llm.temperature,
        ),
        route="default",
        keys=keys if same_server else None,
        on_usage=on_usage,
    )
    routes = []
    for route in settings.routes:
        client: LLMClient
        if route.provider == "openai":
            client = OpenAICompatibleLLM(
                OpenAICompatibleSettings(
                    base_url=route.base_url or settings.upstream.base_url,
                    api_key=route.api_key or SecretStr(""),
                    timeout_s=settings.memory_llm.timeout_s,
                    temperature=settings.memory_llm.temperature,
                ),
                route=f"openai:{route.prefix}",
                keys=keys,
                on_usage=on_usage,
            )
        else:
            client = LiteLLMClient(
                LiteLLMSettings(
                    api_base=route.base_url,
                    api_key=route.api_key,
                    timeout_s=settings.memory_llm.timeout_s,
                    provider=route.pinned_provider,
                ),
                on_usage=on_usage,
            )
        routes.append(Route(route.prefix, client, route.strip_prefix))
    prefixes = PrefixRouter(default, routes)
    dialects = dialect_clients(settings, keys, on_usage) if not settings.memory_llm.base_url else {}
    clients = [default, *(r.client for r in routes), *dialects.values()]
    if not dialects or not isinstance(keys, LatestChats):
        return prefixes, clients
    return DialectRouter(prefixes, dialects, keys), clients


def dialect_clients(settings: Settings, keys: KeySource | None, on_usage: UsageObserver | None) -> dict[str, LLMClient]:
    """Memory-side clients for users whose latest chat came through the Responses API (default upstream) or
    Anthropic's Messages API: the same API, model and key as that chat."""
    upstream, memory = settings.upstream, settings.memory_llm
    options: dict[str, Any] = {"keys": keys, "timeout_s": memory.timeout_s, "temperature": memory.temperature,
                               "on_usage": on_usage}  # fmt: skip
    clients: dict[str, LLMClient] = {
        "responses:default": DialectLLM(
            "responses", f"{upstream.base_url}/responses", upstream.api_key, route="responses:default", **options
        )
    }
    if upstream.anthropic_base_url:
        url = f"{upstream.anthropic_base_url}/v1/messages"
        clients[ANTHROPIC_ROUTE] = DialectLLM(
            "messages", url, upstream.anthropic_api_key, route=ANTHROPIC_ROUTE, **options
        )
    return clients


def engine_settings(settings: Settings) -> EngineSettings:
    """Each memory component's own settings (``[memory_llm] model`` is the default memory model)."""
    writer = settings.writer
    if writer.model is None and settings.memory_llm.model:
        writer = writer.model_copy(update={"model": settings.memory_llm.model})
    return EngineSettings(
        embedder=settings.embedder,
        store=settings.store_settings(),
        jobs=settings.jobs_settings(),
        retrieval=settings.retrieval,
        injection=settings.injection,
        rerank=settings.rerank,
        writer=writer,
        extraction=settings.extraction,
        insights=settings.insights,
        cluster=settings.storage.cluster(os.environ),
        webhooks=settings.webhooks,
        turn_retention_days=settings.memory.turn_retention_days,
    )


def with_replica(settings: EngineSettings, replica: str | None) -> EngineSettings:
    """``settings`` with the supervisor's replica name (every process of one ``memproxy serve`` is one replica)."""
    if settings.cluster is None or replica is None:
        return settings
    return dataclasses.replace(settings, cluster=dataclasses.replace(settings.cluster, replica=replica))


def latest_chats(settings: Settings) -> LatestChats:
    """Each user's latest chat model, route and (where the chat passes it on) key, in memory only."""
    return LatestChats(
        keyed_routes(settings),
        key_ttl_s=settings.memory_llm.client_key_ttl_s,
        hold_keys=settings.memory_llm.hold_client_keys,
    )


@contextlib.asynccontextmanager
async def open_memory(
    settings: Settings,
    metrics: Metrics,
    mirror: Mirror | None = None,
    opened: list[MemoryEngine] | None = None,
    replica: str | None = None,
) -> AsyncIterator[MemoryService]:
    """The real memory engine, its LLM clients opened first and closed last. ``mirror``: the memory writer
    process's (``proxy.mirror``), whose writes the chat processes follow; ``opened`` gets the engine;
    ``replica``: the name of every process of one ``memproxy serve`` on a shared store."""
    latest, board = latest_chats(settings), FeatureBoard()
    router, clients = memory_llm(settings, latest, metrics.observe_llm_usage)
    async with contextlib.AsyncExitStack() as stack:
        for client in clients:
            if isinstance(client, contextlib.AbstractAsyncContextManager):
                await stack.enter_async_context(client)
        llm = ReportingLLM(router, board)
        engine = await stack.enter_async_context(
            MemoryEngine(with_replica(engine_settings(settings), replica), llm, latest, board, mirror=mirror)
        )
        if opened is not None:
            opened.append(engine)
        metrics.add_queue(lambda: engine.queue_snapshot, refresh=engine.refresh_metrics)
        metrics.add_gauges("memproxy_jobs", engine.storage_gauges)
        metrics.add_gauges("memproxy_cluster", engine.cluster_gauges)
        metrics.add_gauges("memproxy_embedder", engine.embedder_gauges)
        metrics.add_memory_parts(engine.memory_parts)
        engine.store.cache.observe = metrics.vector_cache_lookup
        metrics.register(FeatureCollector(board, engine.waiting))
        if settings.shadow.enabled:  # the engine's answers, plus comparisons with [shadow] on a sample
            yield await stack.enter_async_context(ShadowMemory(engine, settings.shadow, metrics))
            return
        yield engine


def default_memory_factory(settings: Settings) -> MemoryFactory:
    """The memory service the configuration asks for."""
    return open_memory if settings.memory.enabled else null_memory


def build_targets(settings: Settings, router: Router, session: aiohttp.ClientSession) -> Targets:
    """Where each dialect goes: Anthropic's API when ``upstream.anthropic_base_url`` is set, else translation."""
    upstream = settings.upstream
    anthropic = None
    if upstream.anthropic_base_url:
        key = upstream.anthropic_api_key.get_secret_value()
        anthropic = AnthropicUpstream(upstream.anthropic_base_url, key, session)
    return Targets(router, anthropic)


def build_app(
    settings: Settings, *, memory_factory: MemoryFactory | None = None, memory_relay: Path | None = None
) -> web.Application:
    """The proxy application for ``settings``. ``memory_relay``: a chat process of ``memproxy serve``'s process
    model, whose management API, MCP endpoint and web page are the memory writer's (its socket directory)."""
    deadline = body_deadline_middleware(settings.server.body_timeout_s, settings.server.max_body_bytes)
    app = web.Application(client_max_size=settings.server.max_body_bytes, middlewares=[error_middleware, deadline])
    metrics = Metrics()
    state = AppState(settings=settings, metrics=metrics, memory=NullMemory())
    app[STATE] = state
    factory = memory_factory or default_memory_factory(settings)

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        async with contextlib.AsyncExitStack() as stack:
            session = await stack.enter_async_context(build_session(settings.upstream))
            state.router = build_router(settings.upstream, settings.routes, session)
            state.targets = build_targets(settings, state.router, session)
            state.memory = await open_memory_or_unavailable(stack, factory(settings, metrics))
            await report_features(settings, state.memory.features)
            # after the memory service, so closed before it: commits still running reach the queue first
            state.commits = await stack.enter_async_context(ExchangeCommitter(state.memory, metrics))
            yield
            state.stopping = True

    app.cleanup_ctx.append(lifecycle)
    install_access(app)
    install_header_check(app)  # before the access checks: they read headers
    add_routes(app)
    if memory_relay is not None:
        add_memory_relay(app, memory_relay)
        state.extra_metrics = functools.partial(writer_metrics, app)
    else:
        add_management_routes(app)
        add_operations_routes(app)
        add_mcp_routes(app)
    add_relayed_routes(app)  # last: every route of memproxy's own matches first
    install_tracing(app)
    return app
