"""Running the app: bind, serve until SIGTERM/SIGINT, then shut down gracefully.

Shutdown order: stop accepting connections, let in-flight requests (streams included) finish up to
``server.shutdown_grace_s``, then run the app's cleanup (which drains the background workers). A restart in
place (``proxy.recycle``) shuts down the same way, keeping the listening sockets open for the next image.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import signal
import socket
import sys
from http import HTTPStatus
from typing import Any, cast

import orjson
import structlog
import uvloop
from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from tqdm import tqdm

from proxy.access import open_relay_problem
from proxy.app import MemoryFactory, build_app
from proxy.config import ConfigError, Settings, load_settings
from proxy.errors import BadRequest, ProxyError, error_response
from proxy.heap import QUIET_CHECK_S, QuietTrimmer, arrow_on_system_malloc, fix_mmap_threshold, freeze_startup_objects
from proxy.logs import configure_logging
from proxy.memory.embedders import build_embedder
from proxy.memory.store import MemoryStore, SchemaError, Ticker
from proxy.recycle import Activity, Recycler, inherited_sockets, keep_listening, reexec
from proxy.state import STATE

log = structlog.get_logger("memproxy.server")

EXIT_CONFIG = 2


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

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._arm_head_timer()

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


class AppRunner(web.AppRunner):
    """``web.AppRunner`` whose connections answer protocol errors as OpenAI error JSON and time out slow request
    heads after ``server.head_timeout_s`` (see above)."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _JsonErrorServer  # aiohttp offers no hook for the handler class
        if STATE in self.app:
            cast(_JsonErrorServer, server).head_timeout_s = self.app[STATE].settings.server.head_timeout_s
        return server


def release_idle(app: web.Application) -> int:
    """The memory service's ``release_idle`` (users dropped from its caches), once the service is up."""
    state = app.get(STATE)
    return state.memory.release_idle() if state is not None else 0


async def jobs_busy(app: web.Application) -> bool | None:
    """Whether a memory job is due or running (None while the memory service is not up, or has no queue)."""
    state = app.get(STATE)
    memory = state.memory if state is not None else None
    if memory is None or not memory.ready:
        return None
    try:
        return await asyncio.wait_for(memory.jobs_busy(), timeout=2.0)
    except Exception:  # a queue too busy to answer is busy
        return True


async def serve(
    settings: Settings, *, memory_factory: MemoryFactory | None = None, listening: list[socket.socket] | None = None
) -> list[int]:
    """Serve until a termination signal arrives (returns []) or the process should restart in place
    (``proxy.recycle``: returns the listening sockets' descriptors, kept open for the next image).

    ``listening``: sockets to serve on (a previous image's) instead of binding ``server.host``/``port``.
    """
    app = build_app(settings, memory_factory=memory_factory)
    activity = Activity()
    app.middlewares.insert(0, activity.middleware)
    runner = AppRunner(
        app, handler_cancellation=True, access_log=None, shutdown_timeout=settings.server.shutdown_grace_s
    )
    await runner.setup()
    freeze_startup_objects()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    server = settings.server
    trimmer = QuietTrimmer(release=functools.partial(release_idle, app))
    recycler = None
    if server.recycle_rss_growth > 0:
        busy = functools.partial(jobs_busy, app)
        recycler = Recycler(
            server.recycle_rss_growth,
            server.recycle_min_growth_mb,
            server.recycle_quiet_s,
            activity,
            busy,
            quiet=lambda: trimmer.quiet,
        )
    recycling: list[str] = []

    async def tick() -> None:
        await trimmer.tick()  # proxy.heap; its check also says whether the last interval was quiet
        if recycler is not None and not stop.is_set() and (reason := await recycler.due()) is not None:
            recycling.append(reason)
            stop.set()

    kept: list[int] = []
    try:
        async with Ticker("heap-trim", QUIET_CHECK_S, tick):
            sites: list[web.BaseSite] = [web.SockSite(runner, sock) for sock in listening or ()]
            sites = sites or [web.TCPSite(runner, server.host, server.port, reuse_address=True)]
            for site in sites:
                await site.start()
            addresses = [f"http://{a[0]}:{a[1]}" for a in runner.addresses if isinstance(a, tuple)]
            log.info(
                "server.started",
                addresses=addresses,
                port=runner.addresses[0][1],
                upstream=settings.upstream.base_url,
                memory=settings.memory.enabled,
                restarted_in_place=bool(listening),
            )
            await stop.wait()
            if recycling:
                kept = keep_listening(runner)
                log.info("server.recycling", reason=recycling[0], grace_s=server.shutdown_grace_s)
            else:
                log.info("server.stopping", grace_s=server.shutdown_grace_s)
            app[STATE].stopping = True
    finally:
        await runner.cleanup()
        log.info("server.stopped")
    return kept


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


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    server: dict[str, Any] = {}
    if getattr(args, "host", None) is not None:
        server["host"] = args.host
    if getattr(args, "port", None) is not None:
        server["port"] = args.port
    return {"server": server} if server else {}


def load_or_exit(args: argparse.Namespace) -> Settings:
    """The settings, or exit code 2 with one message naming the bad key."""
    try:
        return load_settings(getattr(args, "config", None), overrides=_overrides(args))
    except ConfigError as exc:
        print(str(exc), file=sys.stderr)
        raise SystemExit(EXIT_CONFIG) from None


def run_command(args: argparse.Namespace) -> None:
    """``memproxy serve`` and ``memproxy reindex``."""
    listening = inherited_sockets() if args.command == "serve" else []  # a restart in place (proxy.recycle)
    settings = load_or_exit(args)
    if args.command == "serve":
        problem = open_relay_problem(settings)
        if problem is not None:  # like Redis's protected mode: refuse rather than serve an open relay
            print(problem, file=sys.stderr)
            raise SystemExit(EXIT_CONFIG)
        configure_logging(settings.logging.level)
        fix_mmap_threshold()
        arrow_on_system_malloc()
        try:
            while kept := uvloop.run(serve(settings, listening=listening)):
                reexec(kept)  # returns only if the exec failed: serve again from this image
                listening = [socket.socket(fileno=fd) for fd in kept]
        except SchemaError as exc:  # a store this version cannot serve: say what to do, no traceback
            print(f"memproxy: {exc}", file=sys.stderr)
            raise SystemExit(1) from None
        return
    if settings.storage.uri and "://" in settings.storage.uri:  # replicas share it: docs/scaling.md
        print("config error: storage.uri: memproxy reindex works on a local store only", file=sys.stderr)
        raise SystemExit(EXIT_CONFIG)
    configure_logging("warning")
    count = uvloop.run(reindex(settings))
    print(f"re-embedded {count} memories with {settings.embedder.label}")
