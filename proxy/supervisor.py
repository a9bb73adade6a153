"""``memproxy serve``'s process model: one supervisor, ``server.workers`` chat processes, one memory writer.

The supervisor binds the port and starts the children (``python -m proxy.roles``), each with the listening socket
inherited (the kernel spreads connections over the chat processes that accept on it):

* the **memory writer** owns every write: the store (LanceDB writes, the Tantivy writer), the job queue and the
  write side's work (turn embeddings, extraction, summaries, insights, compaction, retention, webhooks). It
  serves the management API, MCP and the web page on a private socket (the chat processes relay them) and
  streams what it writes to the chat processes (``proxy.mirror``). It starts first (it creates and migrates
  the store). It is replaced after ``server.writer_max_jobs`` jobs or once past ``server.writer_max_rss_mb``
  (it exits 75, and the supervisor starts a new one at once; the chat never waits for it: exchanges go to
  the queue's file, reads use the chat processes' own view of the store, and the chat processes hand the new
  writer the users' latest chats and keys they hold).
* **chat processes** (``server.workers``, 0: one per core) answer chats: the read path over a follower's view
  of the store, the upstream relay, and each exchange committed to the queue before the reply's end goes out.

A child that exits on its own is started again (after a pause that grows while it keeps failing within
``CRASH_WINDOW_S``). SIGTERM/SIGINT stop the chat processes first (in-flight requests finish within
``server.shutdown_grace_s``), then the writer (running jobs finish or go back to the queue). Each child is
killed with the supervisor (``PR_SET_PDEATHSIG``), so a supervisor killed with SIGKILL leaves nothing behind.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog
import uvloop

from proxy.access import open_relay_problem
from proxy.config import ConfigError, Settings, load_settings
from proxy.logs import configure_logging
from proxy.memory.store import replica_name
from proxy.metrics import MULTIPROC_ENV

log = structlog.get_logger("memproxy.supervisor")

EXIT_CONFIG = 2
EXIT_RECYCLE = 75  # a writer that reached its job count or RSS limit (EX_TEMPFAIL): started again at once
CRASH_WINDOW_S = 10.0
READY_TIMEOUT_S = 600.0
BIND_RETRY_S = 5.0  # a writer's first start may repair a big store


@dataclass
class Child:
    """One child process and what the supervisor knows of it."""

    role: str
    index: int
    process: asyncio.subprocess.Process | None = None
    started_at: float = 0.0
    failures: int = 0
    restarts: int = 0
    ready: asyncio.Event = field(default_factory=asyncio.Event)


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


def serve_command(args: argparse.Namespace) -> None:
    """``memproxy serve``: the supervisor (it imports little; each child imports what its part needs)."""
    settings = load_or_exit(args)
    problem = open_relay_problem(settings)
    if problem is not None:  # like Redis's protected mode: refuse rather than serve an open relay
        print(problem, file=sys.stderr)
        raise SystemExit(EXIT_CONFIG)
    configure_logging(settings.logging.level)
    # lancedb warns at every fork of a process that imported it; the supervisor only forks to exec a child
    warnings.filterwarnings("ignore", message="lancedb fork support")
    raise SystemExit(uvloop.run(Supervisor(settings, getattr(args, "config", None)).run()))


def worker_count(settings: Settings) -> int:
    """Chat processes: ``server.workers``, or one per core."""
    return settings.server.workers or len(os.sched_getaffinity(0)) or 1


class Supervisor:
    """Starts, watches and stops the children of one ``memproxy serve``."""

    def __init__(self, settings: Settings, config: Path | None) -> None:
        self.settings = settings
        self._config = config
        self._sock: socket.socket | None = None
        self._dir = Path(tempfile.mkdtemp(prefix="memproxy-"))  # 0700: only this user reaches the sockets
        self._replica = replica_name()
        self._metrics_dir = self._dir / "metrics"  # the children's counters, summed by every scrape (proxy.metrics)
        self._metrics_dir.mkdir()
        self._stopping = False
        self._children: list[Child] = []

    def _args(self, child: Child, ready_fd: int) -> list[str]:
        args = [sys.executable, "-m", "proxy.roles", child.role, "--dir", str(self._dir), "--ready-fd", str(ready_fd)]
        args += ["--replica", self._replica, "--index", str(child.index)]
        if child.role == "chat" and self._sock is not None:
            args += ["--fd", str(self._sock.fileno())]
        if self._config:
            args += ["--config", str(self._config)]
        return args

    async def _start(self, child: Child) -> None:
        read_fd, write_fd = os.pipe()
        fds = [write_fd] + ([self._sock.fileno()] if child.role == "chat" and self._sock is not None else [])
        child.ready.clear()
        env = {**os.environ, MULTIPROC_ENV: str(self._metrics_dir)}
        child.process = await asyncio.create_subprocess_exec(*self._args(child, write_fd), pass_fds=fds, env=env)
        os.close(write_fd)
        child.started_at = time.monotonic()
        asyncio.get_running_loop().run_in_executor(None, _wait_ready, read_fd, child, asyncio.get_running_loop())

    async def _await_ready(self, children: list[Child], timeout_s: float) -> None:
        await asyncio.wait_for(asyncio.gather(*(c.ready.wait() for c in children)), timeout_s)

    async def _watch(self, child: Child) -> None:
        """Start ``child`` again whenever it exits, until the supervisor stops."""
        while True:
            assert child.process is not None
            code = await child.process.wait()
            if self._stopping:
                return
            quick = time.monotonic() - child.started_at < CRASH_WINDOW_S
            child.failures = child.failures + 1 if quick and code != EXIT_RECYCLE else 0
            pause = 0.0 if code == EXIT_RECYCLE else min(0.2 * 2 ** max(child.failures - 1, 0), 10.0)
            event = "supervisor.recycled" if code == EXIT_RECYCLE else "supervisor.child_exited"
            log.warning(event, role=child.role, index=child.index, pid=child.process.pid, code=code, restart_in_s=pause)
            await asyncio.sleep(pause)
            if self._stopping:
                return
            child.restarts += 1
            await self._start(child)

    async def run(self) -> int:
        """Serve until SIGTERM/SIGINT; returns the exit code."""
        server = self.settings.server
        try:
            self._sock = await _listen(server.host, server.port)
        except OSError as exc:
            print(f"memproxy: cannot listen on {server.host}:{server.port}: {exc.strerror}", file=sys.stderr)
            shutil.rmtree(self._dir, ignore_errors=True)
            return 1
        self._sock.set_inheritable(True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        writer = Child("writer", 0) if self.settings.memory.enabled else None
        chats = [Child("chat", i) for i in range(worker_count(self.settings))]
        self._children = ([writer] if writer else []) + chats
        watchers: list[asyncio.Task[None]] = []
        try:
            if writer is not None:  # it creates and migrates the store the chat processes open
                await self._start(writer)
                await self._first_ready(writer, stop)
                watchers.append(asyncio.create_task(self._watch(writer)))
            for chat in chats:
                await self._start(chat)
            for chat in chats:
                await self._first_ready(chat, stop)
                watchers.append(asyncio.create_task(self._watch(chat)))
            host, port = self._sock.getsockname()[:2]
            log.info("server.started", addresses=[f"http://{host}:{port}"], port=port, workers=len(chats),
                     pids={f"{c.role}-{c.index}": c.process.pid for c in self._children if c.process},
                     upstream=self.settings.upstream.base_url, memory=self.settings.memory.enabled)  # fmt: skip
            await stop.wait()
        except _ChildFailed as failed:
            log.error("supervisor.start_failed", role=failed.args[0])
            return 1
        finally:
            self._stopping = True
            for task in watchers:
                task.cancel()
            await self._stop(chats, writer)
            self._sock.close()
            shutil.rmtree(self._dir, ignore_errors=True)
            log.info("server.stopped")
        return 0

    async def _first_ready(self, child: Child, stop: asyncio.Event) -> None:
        """Wait for a child's first start; a child that exits first, or a stop, ends the serve."""
        assert child.process is not None
        ready = asyncio.create_task(child.ready.wait())
        exited = asyncio.create_task(child.process.wait())
        stopped = asyncio.create_task(stop.wait())
        done, pending = await asyncio.wait({ready, exited, stopped}, timeout=READY_TIMEOUT_S,
                                           return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
        for task in pending:
            task.cancel()
        if ready not in done:
            raise _ChildFailed(child.role)

    async def _stop(self, chats: list[Child], writer: Child | None) -> None:
        grace = self.settings.server.shutdown_grace_s + 10.0
        log.info("server.stopping", grace_s=self.settings.server.shutdown_grace_s)
        await _terminate([c for c in chats if c.process is not None], grace)
        if writer is not None and writer.process is not None:
            await _terminate([writer], grace + 30.0)


async def _listen(host: str, port: int) -> socket.socket:
    """The listening socket; a port still held for a moment (the children of a memproxy killed just now, on their
    way out) is tried again for up to ``BIND_RETRY_S``."""
    deadline = time.monotonic() + BIND_RETRY_S
    while True:
        try:
            return socket.create_server((host, port), backlog=2048)
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE or time.monotonic() >= deadline:
                raise
            await asyncio.sleep(0.2)


class _ChildFailed(Exception):
    pass


def _wait_ready(read_fd: int, child: Child, loop: asyncio.AbstractEventLoop) -> None:
    """In a thread: the child writes a line to the pipe once it serves (EOF first: it died before)."""
    try:
        data = os.read(read_fd, 64)
    finally:
        os.close(read_fd)
    if data:
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            loop.call_soon_threadsafe(child.ready.set)


async def _terminate(children: list[Child], grace_s: float) -> None:
    for child in children:
        if child.process is not None and child.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                child.process.send_signal(signal.SIGTERM)
    for child in children:
        if child.process is None:
            continue
        try:
            await asyncio.wait_for(child.process.wait(), grace_s)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                child.process.kill()
            await child.process.wait()
