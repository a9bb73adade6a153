"""The app factory: every component is built here, in one ``AsyncExitStack``, and closed in reverse.

``build_app`` takes the settings and, for tests, a factory for the memory service; it returns an aiohttp
application whose ``cleanup_ctx`` opens the upstream session, the memory service and its background workers
on startup and drains them on shutdown.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable

from aiohttp import web

from proxy.config import Settings
from proxy.errors import error_middleware
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


def default_memory_factory(settings: Settings) -> MemoryFactory:
    """The memory service the configuration asks for."""
    return null_memory


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
    return app
