"""One aiohttp request served by an ASGI application (the MCP SDK's streamable HTTP transport is one).

``serve_asgi`` builds the ASGI ``http`` scope from the aiohttp request (its body read first, within the app's
size limit), hands the app a ``receive`` that gives that body once and then waits for the client to go away,
and relays what the app ``send``s (status, headers, body chunks as they come, so a stream stays a stream).
``extra`` joins the scope's ``state`` (what a starlette ``Request.state`` shows): how the shell tells the app
who the request is for.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from typing import Any

from aiohttp import web

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]], Awaitable[None]]
_HOP_BY_HOP = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length"})


def asgi_scope(request: web.Request, extra: Mapping[str, Any]) -> Scope:
    """The ASGI ``http`` scope of ``request``."""
    peer = request.transport.get_extra_info("peername") if request.transport is not None else None
    sock = request.transport.get_extra_info("sockname") if request.transport is not None else None
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": f"{request.version.major}.{request.version.minor}",
        "method": request.method,
        "scheme": request.scheme,
        "path": request.path,
        "raw_path": request.raw_path.split("?", 1)[0].encode(),
        "query_string": request.query_string.encode(),
        "root_path": "",
        "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in request.headers.items()],
        "client": tuple(peer[:2]) if peer else None,
        "server": tuple(sock[:2]) if sock else None,
        "state": dict(extra),
    }


class _Relay:
    """The ``send`` side: turns the app's messages into one aiohttp streamed response."""

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.response: web.StreamResponse | None = None
        self.done = asyncio.Event()

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            response = web.StreamResponse(status=int(message["status"]))
            for name, value in message.get("headers", ()):
                if name.decode("latin-1").lower() not in _HOP_BY_HOP:
                    response.headers.add(name.decode("latin-1"), value.decode("latin-1"))
            self.response = response
            await response.prepare(self.request)
        elif message["type"] == "http.response.body" and self.response is not None:
            if message.get("body"):
                await self.response.write(bytes(message["body"]))
            if not message.get("more_body", False):
                await self.response.write_eof()
                self.done.set()


async def serve_asgi(app: ASGIApp, request: web.Request, extra: Mapping[str, Any]) -> web.StreamResponse:
    """Serve ``request`` with the ASGI ``app`` (see the module doc)."""
    body = await request.read()
    relay = _Relay(request)
    sent_body = False

    async def receive() -> Message:
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": body, "more_body": False}
        await relay.done.wait()
        return {"type": "http.disconnect"}

    await app(asgi_scope(request, extra), receive, relay.send)
    if relay.response is None:
        raise web.HTTPInternalServerError(text="the ASGI app sent no response")
    return relay.response
