"""A quiet restart in place: memory a burst of work left behind goes back to the system.

After a busy stretch (a burst of chat and the writes it queued) the process keeps what its allocators cannot
hand back: free chunks of glibc's heaps and of Python's object arenas that share pages with live allocations,
and LanceDB's caches (``proxy.heap`` trims what can be trimmed). ``bench/writes.py --mode sustained --minutes
2``: 276 MB before the load, 400-420 MB after the drain, whatever the allocator settings (glibc capped arenas,
jemalloc with background purging: 391 MB). Only a new process image returns it all.

So once the process has gone quiet (no request but probes and scrapes in flight or within ``quiet_s``, no memory
job due or running, under 5% of a core over the last check) and its RSS has grown past ``growth`` times its
level after start-up (the lowest seen at a check since memory came up) and by at least ``min_growth_mb``, the
server stops as on SIGTERM (in-flight work finishes, the store closes) and re-executes itself: same PID, same
command line, same listening sockets (inherited through ``MEMPROXY_RESTART_FDS``), so a connection that arrives
meanwhile waits in the socket's backlog for the new image instead of being refused. Everything durable
stays where it is (the store, the job queue); what is lost is only what any restart loses: caches and counters.
uWSGI's ``reload-on-rss`` does the same for the same reason. ``server.recycle_rss_growth = 0`` turns it off.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import structlog
from aiohttp import web

from proxy.access import PROBE_PATHS

log = structlog.get_logger("memproxy.recycle")

LISTEN_FDS_ENV = "MEMPROXY_RESTART_FDS"  # listening sockets handed to the re-executed image (fd numbers)
UNWATCHED_PATHS = PROBE_PATHS | {"/metrics"}  # requests that do not count as work (orchestrators, scrapers)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def rss_mb() -> float:
    """This process's resident memory in MB (0 where /proc is not there)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


class Activity:
    """Requests in flight and when the last one ended (probes and metrics scrapes not counted)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.in_flight = 0
        self.last_end = clock()

    def idle_s(self) -> float:
        """Seconds since the last request ended (0 while one is in flight)."""
        return 0.0 if self.in_flight else self._clock() - self.last_end

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Count the request (the outermost middleware: a streamed reply counts until its last byte)."""
        if request.path in UNWATCHED_PATHS:
            return await handler(request)
        self.in_flight += 1
        try:
            return await handler(request)
        finally:
            self.in_flight -= 1
            self.last_end = self._clock()


class Recycler:
    """Decides when the process should restart in place (see the module doc); call ``due`` every few seconds."""

    def __init__(
        self,
        growth: float,
        min_growth_mb: float,
        quiet_s: float,
        activity: Activity,
        busy: Callable[[], Awaitable[bool | None]],
        quiet: Callable[[], bool],
        rss: Callable[[], float] = rss_mb,
    ) -> None:
        self.growth, self.min_growth_mb, self.quiet_s = growth, min_growth_mb, quiet_s
        self._activity, self._busy, self._quiet, self._rss = activity, busy, quiet, rss
        self.baseline_mb: float | None = None  # the lowest RSS seen at a check since memory came up

    async def due(self) -> str | None:
        """Why the process should restart now (a short reason for the log), or None. ``quiet``: whether the
        last check interval used little CPU (``proxy.heap.QuietTrimmer.quiet``, checked just before)."""
        rss = self._rss()
        if self.baseline_mb is None or rss < self.baseline_mb:  # its lowest level since memory came up
            if self.baseline_mb is not None or await self._busy() is not None:
                self.baseline_mb = rss
            return None
        if rss < max(self.growth * self.baseline_mb, self.baseline_mb + self.min_growth_mb):
            return None
        if not self._quiet() or self._activity.idle_s() < self.quiet_s or await self._busy() is not False:
            return None
        return f"RSS {rss:.0f} MB, {rss / self.baseline_mb:.2f}x its {self.baseline_mb:.0f} MB after start-up"


def inherited_sockets() -> list[socket.socket]:
    """The listening sockets a previous image handed over (and forget the variable: children do not get it)."""
    fds = os.environ.pop(LISTEN_FDS_ENV, "")
    return [socket.socket(fileno=int(fd)) for fd in fds.split(",") if fd.strip()]


def keep_listening(runner: web.BaseRunner) -> list[int]:
    """Duplicates of the runner's listening sockets, so that they stay open (and their backlog keeps
    connections) after the runner closes its own: for the next image to serve."""
    fds = []
    for site in runner.sites:
        server = site._server  # aiohttp's own ``BaseRunner.addresses`` reads it the same way
        for sock in getattr(server, "sockets", None) or ():
            fds.append(os.dup(sock.fileno()))
    return fds


def reexec(fds: Sequence[int]) -> None:
    """Replace this process with a fresh image of the same command, handing it the listening sockets.

    Returns only if the exec failed (logged); the caller then serves again from this image.
    """
    for fd in fds:
        os.set_inheritable(fd, True)
    env = {**os.environ, LISTEN_FDS_ENV: ",".join(str(fd) for fd in fds)}
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, sys.orig_argv, env)  # noqa: S606 (this process's own command line)
    except OSError as exc:
        log.error("server.recycle_failed", error=str(exc))
