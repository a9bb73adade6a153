"""Running the app: bind, serve until SIGTERM/SIGINT, then shut down gracefully.

Shutdown order: stop accepting connections, let in-flight requests (streams included) finish up to
``server.shutdown_grace_s``, then run the app's cleanup (which drains the background workers). ``memproxy serve``
runs the app in several processes (``proxy.supervisor``, ``proxy.roles``); ``serve`` alone is one process with
everything in it (the tests' servers, and each of those processes with its part).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import signal
import socket
import sys
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from pathlib import Path
from typing import Any, cast

import orjson
import structlog
import uvloop
from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from tqdm import tqdm

from proxy.app import MemoryFactory, build_app
from proxy.chat_handoff import HandoffReceiver, handoff_socket
from proxy.chat_routing import ChatRouter, chat_socket
from proxy.config import Settings
from proxy.errors import BadRequest, ProxyError, error_response
from proxy.logs import configure_logging
from proxy.memory.embedders import build_embedder
from proxy.memory.store import MemoryStore
from proxy.state import STATE
from proxy.supervisor import EXIT_CONFIG, load_or_exit

log = structlog.get_logger("memproxy.server")


HEAD_TIMEOUT_BODY = orjson.dumps(
    {"error": {"message": "the request head did not arrive in time", "type": "invalid_request_error",
               "param": None, "code": "request_timeout"}}
)  # fmt: skip


class _JsonProtocolErrors(RequestHandler):
    """Errors aiohttp answers itself, before the app sees a request, as OpenAI error JSON; and a deadline for
    request heads.

    A request line or header that is too long or malformed never reaches the app's error middleware:
    aiohttp answers it with ``text/plain`` that echoes the offending bytes back. Here the client gets the
    same status with an OpenAI-style body naming only what was wrong, and the log gets one line.

    aiohttp has no timeout for a request head: a client sending its headers a byte at a time holds the
    connection until the keep-alive timeout (an hour). Here a head must be complete within ``head_timeout_s``
    of the connection's start or of its first byte (a later request on a kept-alive connection); otherwise the
    client gets a 408 and the connection is closed (like nginx's ``client_header_timeout``).
    """

    head_timeout_s = 0.0  # set by the server that made it (``_JsonErrorServer``); 0: no deadline
    _head_timer: asyncio.TimerHandle | None = None
    _heads_seen = 0
    primed = b""  # a request another chat process handed over with the connection (``chat_handoff``)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._arm_head_timer()
        if self.primed:  # the connection's first bytes, before anything read from the socket
            request, self.primed = self.primed, b""
            self.data_received(request)

    def data_received(self, data: bytes) -> None:
        if self._head_timer is None and self._between_requests():
            self._arm_head_timer()  # the first byte of a new head on a kept-alive connection
        super().data_received(data)
        if self._head_timer is not None and self._request_count != self._heads_seen:
            self._head_timer.cancel()  # the head is complete
            self._head_timer = None

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        super().connection_lost(exc)

    def _between_requests(self) -> bool:
        """No request is being handled: the connection waits for a head (or is about to)."""
        waiting = self._waiter is not None and not self._waiter.done()
        return waiting or (self._waiter is None and not self._request_in_progress)

    def _arm_head_timer(self) -> None:
        if self.head_timeout_s > 0:
            self._heads_seen = self._request_count
            self._head_timer = self._loop.call_later(self.head_timeout_s, self._head_timed_out)

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport is None or self._request_count != self._heads_seen:
            return
        if not self._between_requests():  # a request is being handled: its head was complete
            return
        log.info("http.head_timeout", timeout_s=self.head_timeout_s)
        self.transport.write(
            b"HTTP/1.1 408 Request Timeout\r\nContent-Type: application/json\r\nConnection: close\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(HEAD_TIMEOUT_BODY), HEAD_TIMEOUT_BODY)
        )
        self.force_close()  # the transport sends what it holds, then closes

    def handle_error(
        self, request: Any, status: int = 500, exc: BaseException | None = None, message: str | None = None
    ) -> web.StreamResponse:
        if request.writer.output_size > 0:  # a response already started: aiohttp closes the connection
            return super().handle_error(request, status, exc, message)
        if status >= 500:
            log.error("http.unhandled_error", status=status, error=type(exc).__name__, exc_info=exc)
            err: ProxyError = ProxyError("internal server error")
        else:
            log.info("http.malformed_request", status=status, error=type(exc).__name__)
            err = BadRequest(
                f"{HTTPStatus(status).phrase}: the request line or headers are malformed or too long",
                code="malformed_request",
            )
        err.status = status
        response = error_response(err)
        response.force_close()
        return response


class _JsonErrorServer(web.Server):
    head_timeout_s = 0.0

    def __call__(self) -> RequestHandler:
        handler = _JsonProtocolErrors(self, loop=self._loop, **self._kwargs)
        handler.head_timeout_s = self.head_timeout_s
        return handler

    def primed(self, request: bytes) -> RequestHandler:
        """A connection's handler that reads ``request`` (a handed-over one) first."""
        handler = self()
        cast(_JsonProtocolErrors, handler).primed = request
        return handler


class AppRunner(web.AppRunner):
    """``web.AppRunner`` whose connections answer protocol errors as OpenAI error JSON and time out slow request
    heads after ``server.head_timeout_s`` (see above)."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _JsonErrorServer  # aiohttp offers no hook for the handler class
        if STATE in self.app:
            cast(_JsonErrorServer, server).head_timeout_s = self.app[STATE].settings.server.head_timeout_s
        return server


async def serve(
    settings: Settings,
    *,
    memory_factory: MemoryFactory | None = None,
    listening: list[socket.socket] | None = None,
    unix_path: str | None = None,
    memory_relay: Path | None = None,
    chat_router: ChatRouter | None = None,
    started: Callable[[web.Application], Awaitable[None]] | None = None,
) -> None:
    """Serve the app until a termination signal arrives.

    ``listening``: sockets to serve on (a chat process's, inherited from the supervisor) instead of binding
    ``server.host``/``port``; ``unix_path``: serve on that Unix socket instead (the memory writer's copy of the
    app); ``memory_relay``: a chat process (``build_app``); ``chat_router``: a chat process of several, which
    also serves on its private socket (``chat_routing``); ``started(app)``: awaited once serving.
    """
    app = build_app(settings, memory_factory=memory_factory, memory_relay=memory_relay)
    if chat_router is not None:
        app[STATE].chat_router = chat_router
        chat_router.observe = app[STATE].metrics.routed
        unix_path = str(chat_socket(chat_router.directory, chat_router.index))
    runner = AppRunner(
        app, handler_cancellation=True, access_log=None, shutdown_timeout=settings.server.shutdown_grace_s
    )
    await runner.setup()
    handoffs = None
    if chat_router is not None:  # connections other chat processes hand over, served as if accepted here
        path = handoff_socket(chat_router.directory, chat_router.index)
        handoffs = HandoffReceiver(path, cast(_JsonErrorServer, runner.server).primed)
        await handoffs.start()
    gc.freeze()  # the start-up objects live as long as the process: no collection needs to walk them again
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    server = settings.server
    try:
        sites: list[web.BaseSite] = [web.SockSite(runner, sock) for sock in listening or ()]
        if unix_path is not None:
            sites.append(web.UnixSite(runner, unix_path))
        sites = sites or [web.TCPSite(runner, server.host, server.port, reuse_address=True)]
        for site in sites:
            await site.start()
        if listening is None and unix_path is None:
            addresses = [f"http://{a[0]}:{a[1]}" for a in runner.addresses if isinstance(a, tuple)]
            log.info("server.started", addresses=addresses, port=runner.addresses[0][1],
                     upstream=settings.upstream.base_url, memory=settings.memory.enabled)  # fmt: skip
        if started is not None:
            await started(app)
        await stop.wait()
        log.info("server.stopping", grace_s=server.shutdown_grace_s)
        app[STATE].stopping = True
    finally:
        if handoffs is not None:
            await handoffs.aclose()
        await runner.cleanup()
        if chat_router is not None:
            await chat_router.aclose()
        log.info("server.stopped")


async def reindex(settings: Settings) -> int:
    """Re-embed every stored memory with the configured embedder, with a progress bar; returns the count."""
    async with build_embedder(settings.embedder) as embedder:
        store = MemoryStore(settings.store_settings(), embedder, allow_mismatch=True)
        async with store:
            with tqdm(unit="memory", desc="reindex") as bar:

                def progress(done: int, total: int) -> None:
                    bar.total = total
                    bar.update(done - bar.n)

                return await store.reindex(progress)


def run_command(args: argparse.Namespace) -> None:
    """``memproxy reindex`` (``memproxy serve``: ``proxy.supervisor.serve_command``)."""
    settings = load_or_exit(args)
    if settings.storage.uri and "://" in settings.storage.uri:  # replicas share it: docs/scaling.md
        print("config error: storage.uri: memproxy reindex works on a local store only", file=sys.stderr)
        raise SystemExit(EXIT_CONFIG)
    configure_logging("warning")
    count = uvloop.run(reindex(settings))
    print(f"re-embedded {count} memories with {settings.embedder.label}")
