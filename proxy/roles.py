"""The children of ``memproxy serve`` (``proxy.supervisor``): ``python -m proxy.roles writer|chat ...``.

* ``writer``: the whole app with the real memory engine, on the private socket ``memory.sock`` (the management
  API, MCP and the web page, relayed by the chat processes), the engine's writes mirrored to the chat processes
  over ``writer.sock`` (``proxy.mirror``); replaced after ``server.writer_max_jobs`` jobs or past
  ``server.writer_max_rss_mb`` of RSS (exit 75, once no job runs).
* ``chat``: the app on the inherited listening socket, memory through ``replica.ReplicaEngine``.

Each tells the supervisor it serves by writing a line to ``--ready-fd``, and dies with the supervisor.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import structlog
import uvloop
from aiohttp import web

from proxy.app import engine_settings, latest_chats, open_memory, with_replica
from proxy.chat_routing import ChatRouter
from proxy.config import ConfigError, Settings, load_settings
from proxy.engine import MemoryEngine
from proxy.logs import configure_logging
from proxy.memory import FeatureBoard, MemoryService
from proxy.memory.store import SchemaError, Ticker
from proxy.metrics import Metrics
from proxy.mirror import MEMORY_SOCKET, WRITER_SOCKET, Mirror, writer_routes
from proxy.replica import ReplicaEngine
from proxy.server import serve
from proxy.supervisor import EXIT_RECYCLE

log = structlog.get_logger("memproxy.roles")

RECYCLE_CHECK_S = 5.0
CHAT_NICE = 10  # the chat processes' scheduling priority below the writer's (CFS weight 110 against 1024)
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """SIGKILL this process when the supervisor dies (Linux): a supervisor gone without stopping its children
    (kill -9, a crash) leaves none behind holding the port, the store's locks or half of a shutdown; what they
    answered is already in the queue's file."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() == 1:  # the supervisor was already gone
        raise SystemExit(1)


def _ready(fd: int) -> None:
    os.write(fd, b"ready\n")
    os.close(fd)


def rss_mb() -> float:
    """This process's resident set, MB."""
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


async def run_writer(settings: Settings, directory: Path, replica: str, ready_fd: int) -> int:
    mirror = Mirror()
    recycle: list[str] = []
    limits = settings.server

    @contextlib.asynccontextmanager
    async def memory(settings: Settings, metrics: Metrics) -> AsyncIterator[MemoryService]:
        opened: list[MemoryEngine] = []
        async with open_memory(settings, metrics, mirror=mirror, opened=opened, replica=replica) as service:
            if not opened:  # memory did not come up: nothing is written (the chat processes read on their own)
                yield service
                return
            engine = opened[0]
            metrics.add_gauges("memproxy_mirror", mirror.gauges)
            # The document model's threads (MiniLM int8 on every core) share the cores with the chat processes
            # rather than going before them: a turn they would be late for gets the static side's vectors instead
            # ([writer] quick_vectors_after_s), so the chat keeps its share and turns stay searchable in time.
            # (Nice 19, idle CPU only, was tried in one 8-minute bench-writes run: no better than two runs at
            # nice 10, within those runs' spread: docs/benchmarks.md, "Write side".)
            engine.embedder.background_priority(CHAT_NICE)
            internal = web.Application()
            writer_routes(internal, mirror, engine.latest, engine.jobs, engine.store)
            runner = web.AppRunner(internal, access_log=None, handler_cancellation=True, shutdown_timeout=1.0)
            await runner.setup()
            try:
                await web.UnixSite(runner, str(directory / WRITER_SOCKET)).start()
                check = functools.partial(_recycle_check, engine, limits.writer_max_jobs, limits.writer_max_rss_mb,
                                          recycle)  # fmt: skip
                async with Ticker("writer-recycle", RECYCLE_CHECK_S, check):
                    yield service
            finally:
                mirror.close()
                await runner.cleanup()

    async def started(app: web.Application) -> None:
        _ready(ready_fd)

    await serve(settings, memory_factory=memory, unix_path=str(directory / MEMORY_SOCKET), started=started)
    return EXIT_RECYCLE if recycle else 0


async def _recycle_check(engine: MemoryEngine, max_jobs: int, max_rss_mb: float, recycle: list[str]) -> None:
    """End the writer (SIGTERM to itself: the supervisor starts another) once it reached its limits."""
    if recycle:
        return
    jobs = engine.jobs.completed_total
    reason = "jobs" if max_jobs and jobs >= max_jobs else None
    if reason is None and max_rss_mb and rss_mb() >= max_rss_mb and not await engine.jobs_busy():
        reason = "rss"
    if reason is not None:
        recycle.append(reason)
        log.info("writer.recycling", reason=reason, jobs=jobs, rss_mb=round(rss_mb()))
        os.kill(os.getpid(), signal.SIGTERM)


async def run_chat(
    settings: Settings, directory: Path, replica: str, fd: int, ready_fd: int, router: ChatRouter
) -> int:
    sock = socket.socket(fileno=fd)
    # The writer first: when the cores are all busy, it gets them before the chat processes, so the write side keeps
    # up with what the chat brings it (new memories searchable within seconds) and an overloaded machine answers
    # chats more slowly instead of letting memory fall minutes behind (within memproxy's own processes: a
    # container's cgroup shares its CPU by these weights; nothing outside memproxy is affected).
    with contextlib.suppress(OSError):
        os.nice(CHAT_NICE)

    @contextlib.asynccontextmanager
    async def memory(settings: Settings, metrics: Metrics) -> AsyncIterator[MemoryService]:
        engine_config = with_replica(engine_settings(settings), replica)
        engine = ReplicaEngine(engine_config, directory, latest_chats(settings), FeatureBoard())
        async with engine:
            metrics.add_gauges("memproxy_embedder", engine.embedder_gauges)
            metrics.add_gauges("memproxy_writer", engine.link_gauges)
            metrics.add_gauges("memproxy_jobs", engine.storage_gauges)  # this process's enqueues failing
            metrics.add_memory_parts(engine.memory_parts)
            engine.store.cache.observe = metrics.vector_cache_lookup
            yield engine

    async def started(app: web.Application) -> None:
        _ready(ready_fd)

    if not settings.memory.enabled:  # no writer: the management API says memory is off, here
        await serve(settings, listening=[sock], started=started)
        return 0
    routing = router if router.processes > 1 else None
    await serve(
        settings, memory_factory=memory, listening=[sock], memory_relay=directory, chat_router=routing, started=started
    )
    return 0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="proxy.roles")
    parser.add_argument("role", choices=("writer", "chat"))
    parser.add_argument("--dir", required=True, type=Path)
    parser.add_argument("--ready-fd", required=True, type=int)
    parser.add_argument("--replica", required=True)
    parser.add_argument("--index", type=int, default=0)
    parser.add_argument("--fd", type=int)
    parser.add_argument("--chats", type=int, default=1, help="how many chat processes serve (chat_routing)")
    parser.add_argument("--config", type=Path)
    args = parser.parse_args(argv)
    _die_with_parent()
    try:
        settings = load_settings(args.config, overrides={})
    except ConfigError as exc:
        print(str(exc), file=sys.stderr)
        raise SystemExit(2) from None
    configure_logging(settings.logging.level)
    structlog.contextvars.bind_contextvars(process=f"{args.role}-{args.index}")
    try:
        if args.role == "writer":
            code = uvloop.run(run_writer(settings, args.dir, args.replica, args.ready_fd))
        else:
            router = ChatRouter(args.dir, args.index, args.chats)
            code = uvloop.run(run_chat(settings, args.dir, args.replica, args.fd, args.ready_fd, router))
    except SchemaError as exc:  # a store this version cannot serve: say what to do, no traceback
        print(f"memproxy: {exc}", file=sys.stderr)
        raise SystemExit(1) from None
    raise SystemExit(code)


if __name__ == "__main__":
    main()
