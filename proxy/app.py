"""The app factory: every component is built here, in one ``AsyncExitStack``, and closed in reverse.

``build_app`` takes the settings and, for tests, a factory for the memory service; it returns an aiohttp
application whose ``cleanup_ctx`` opens the upstream session, the memory service and its background workers
on startup and drains them on shutdown.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Callable

from aiohttp import web
from pydantic import SecretStr

from proxy.config import Settings
from proxy.engine import EngineSettings, MemoryEngine
from proxy.errors import error_middleware
from proxy.management import add_management_routes
from proxy.memory.llm import (
    LiteLLMClient,
    LiteLLMSettings,
    LLMClient,
    OpenAICompatibleLLM,
    OpenAICompatibleSettings,
    PrefixRouter,
    Route,
)
from proxy.memory.service import MemoryService, NullMemory
from proxy.metrics import Metrics
from proxy.routes import add_routes
from proxy.state import STATE, AppState
from proxy.upstream import build_router, build_session

MemoryFactory = Callable[[Settings, Metrics], contextlib.AbstractAsyncContextManager[MemoryService]]


@contextlib.asynccontextmanager
async def null_memory(settings: Settings, metrics: Metrics) -> AsyncIterator[MemoryService]:
    """No memory at all: the proxy is a pure passthrough."""
    yield NullMemory()


def memory_llm(settings: Settings) -> tuple[PrefixRouter, list[LLMClient]]:
    """The client for memory-side model calls (the chat's own routes, or ``[memory_llm]`` when set), and
    the clients behind it (to open and close)."""
    key = settings.memory_llm.api_key or settings.upstream.api_key
    default = OpenAICompatibleLLM(OpenAICompatibleSettings(
        base_url=settings.memory_llm.base_url or settings.upstream.base_url, api_key=key,
        timeout_s=settings.memory_llm.timeout_s, temperature=settings.memory_llm.temperature))
    routes = []
    for route in settings.routes:
        client: LLMClient
        if route.provider == "openai":
            client = OpenAICompatibleLLM(OpenAICompatibleSettings(
                base_url=route.base_url or settings.upstream.base_url, api_key=route.api_key or SecretStr(""),
                timeout_s=settings.memory_llm.timeout_s, temperature=settings.memory_llm.temperature))
        else:
            client = LiteLLMClient(LiteLLMSettings(api_base=route.base_url, api_key=route.api_key,
                                                   timeout_s=settings.memory_llm.timeout_s))
        routes.append(Route(route.prefix, client, route.strip_prefix))
    return PrefixRouter(default, routes), [default, *(r.client for r in routes)]


def engine_settings(settings: Settings) -> EngineSettings:
    """Each memory component's own settings."""
    return EngineSettings(embedder=settings.embedder, store=settings.store_settings(),
                          jobs=settings.jobs_settings(), retrieval=settings.retrieval,
                          injection=settings.injection, rerank=settings.rerank, writer=settings.writer,
                          extraction=settings.extraction, insights=settings.insights,
                          cluster=settings.storage.cluster(os.environ))


@contextlib.asynccontextmanager
async def open_memory(settings: Settings, metrics: Metrics) -> AsyncIterator[MemoryService]:
    """The real memory engine, its LLM clients opened first and closed last."""
    router, clients = memory_llm(settings)
    async with contextlib.AsyncExitStack() as stack:
        for client in clients:
            if isinstance(client, contextlib.AbstractAsyncContextManager):
                await stack.enter_async_context(client)
        engine = await stack.enter_async_context(MemoryEngine(engine_settings(settings), router))
        metrics.add_gauges("memproxy_jobs", engine.gauges, refresh=engine.refresh_metrics)
        metrics.add_gauges("memproxy_cluster", engine.cluster_gauges)
        yield engine


def default_memory_factory(settings: Settings) -> MemoryFactory:
    """The memory service the configuration asks for."""
    return open_memory if settings.memory.enabled else null_memory


def build_app(settings: Settings, *, memory_factory: MemoryFactory | None = None) -> web.Application:
    """The proxy application for ``settings``."""
    app = web.Application(client_max_size=settings.server.max_body_bytes, middlewares=[error_middleware])
    metrics = Metrics()
    state = AppState(settings=settings, metrics=metrics, memory=NullMemory())
    app[STATE] = state
    factory = memory_factory or default_memory_factory(settings)

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        async with contextlib.AsyncExitStack() as stack:
            session = await stack.enter_async_context(build_session(settings.upstream))
            state.router = build_router(settings.upstream, settings.routes, session)
            state.memory = await stack.enter_async_context(factory(settings, metrics))
            yield
            state.stopping = True

    app.cleanup_ctx.append(lifecycle)
    add_routes(app)
    add_management_routes(app)
    return app
