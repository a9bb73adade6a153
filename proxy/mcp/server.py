"""``/mcp``: memproxy as an MCP server over streamable HTTP, for agents and desktop assistants.

The transport is the official SDK's (``mcp``: its low-level ``Server`` and ``StreamableHTTPSessionManager``, in
stateless mode with JSON answers), an ASGI app served from aiohttp through ``proxy.mcp.asgi_bridge``; the tools are
``proxy.mcp.tools``. Each HTTP request is checked here first, under the chat path's access rules:

- ``Origin``: a browser origin not in ``server.allowed_origins`` is a 403 (the MCP spec's DNS-rebinding rule);
  ``server.allowed_hosts`` applies as on every path (``proxy.access``);
- client keys: with ``[[clients]]`` entries, ``Authorization: Bearer <client key>`` is required (else 401) and
  the user id is scoped to the key's namespace (``appA:alice``), as on the chat path;
- the user: ``X-Memory-User`` (else a 400): every tool acts for that user only.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from importlib.metadata import PackageNotFoundError, version

from aiohttp import web
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
from mcp.server.transport_security import TransportSecuritySettings

from proxy.access import client_for, scoped
from proxy.config import Settings
from proxy.errors import BadRequest, Forbidden, Unauthorized
from proxy.identity import USER_HEADER, Identity, Mode
from proxy.mcp.asgi_bridge import serve_asgi
from proxy.mcp.tools import USER_KEY, MemoryTools, build_server
from proxy.memory.store import APP_ID_RULE, valid_app_id
from proxy.state import STATE

MCP_PATH = "/mcp"


def mcp_user(request: web.Request, settings: Settings) -> str:
    """The user an MCP request is for, after the access checks (see the module doc)."""
    origin = request.headers.get("Origin")
    if origin is not None and origin not in settings.server.allowed_origins:
        raise Forbidden(f"cross-origin request from {origin[:100]} refused: allow it in server.allowed_origins")
    namespace = None
    if settings.clients:
        client = client_for(settings.clients, request.headers.get("Authorization"))
        if client is None:
            raise Unauthorized("missing or wrong client key: send the header Authorization: Bearer <client key>")
        namespace = client.namespace
    user = request.headers.get(USER_HEADER)
    if user is None or not valid_app_id(user):
        raise BadRequest(
            f"the MCP endpoint acts for one user: send the header {USER_HEADER} ({APP_ID_RULE})",
            param=USER_HEADER,
            code="invalid_memory_id",
        )
    return scoped(Identity(user, None, Mode.FULL), namespace).user_id or user


def _version() -> str:
    try:
        return version("memproxy")
    except PackageNotFoundError:  # a source tree that was never installed
        return "0"


class McpEndpoint:
    """The session manager (started with the app, stopped before it) and the route's handler."""

    def __init__(self, app: web.Application) -> None:
        self._app = app
        tools = MemoryTools(lambda: app[STATE].memory)
        self._manager = StreamableHTTPSessionManager(
            app=build_server(tools, _version()),
            json_response=True,
            stateless=True,
            # Origin and Host are checked by memproxy itself (``mcp_user``, ``proxy.access``)
            security_settings=TransportSecuritySettings(enable_dns_rebinding_protection=False),
        )

    async def lifecycle(self, app: web.Application) -> AsyncIterator[None]:
        """The session manager's task group, for the app's lifetime, in a task of its own: an anyio task group
        must be left by the task that entered it, and an app's start and cleanup may run in different tasks."""
        started, stop = asyncio.Event(), asyncio.Event()

        async def run() -> None:
            async with self._manager.run():
                started.set()
                await stop.wait()

        task = asyncio.create_task(run(), name="memproxy-mcp")
        waiter = asyncio.create_task(started.wait())
        await asyncio.wait([task, waiter], return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        if task.done():
            task.result()  # it failed to start: say why
        try:
            yield
        finally:
            stop.set()
            await task

    async def handle(self, request: web.Request) -> web.StreamResponse:
        """One MCP HTTP request: access checks, then the SDK's transport."""
        user = mcp_user(request, request.app[STATE].settings)
        return await serve_asgi(self._manager.handle_request, request, {USER_KEY: user})


def add_mcp_routes(app: web.Application) -> None:
    """``/mcp`` on ``app``; its session manager starts after (and stops before) the memory service."""
    endpoint = McpEndpoint(app)
    app.cleanup_ctx.append(endpoint.lifecycle)
    app.router.add_route("*", MCP_PATH, endpoint.handle)
