"""``memproxy serve`` with its imports already done: forks a fresh server per command, for crash tests.

Importing what ``memproxy serve`` needs takes ~11 s on this busy 2-core machine, which would make a test that
kills the server 20 times take minutes in imports alone. ``python -m tests.support.serve_zygote`` imports it
all once, then for every ``serve LOGFILE`` line on stdin forks a child that runs exactly what
``memproxy serve --port 0`` runs (settings from the environment, logging, ``proxy.server.serve``: model load,
store open and repair, queue reclaim, the HTTP server) with its output in LOGFILE, and prints ``CHILD <pid>``.
The children are reaped automatically (SIGCHLD ignored), so the test kills one with SIGKILL and waits for its
``/proc`` entry to go. lancedb warns that forking is experimental when its runtime may be mid-operation; the
zygote never opens a table (nor starts anything else) before forking, so there is nothing in flight to copy.
"""

from __future__ import annotations

import os
import signal
import sys
import warnings

import fastembed  # noqa: F401 - imported by the embedder at start: done here once
import uvloop

from proxy.config import load_settings
from proxy.logs import configure_logging
from proxy.server import serve


def _child(log_path: str) -> None:
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    settings = load_settings(None, overrides={"server": {"port": 0}})
    configure_logging(settings.logging.level)
    uvloop.run(serve(settings))


def main() -> None:
    """Fork one server per ``serve LOGFILE`` line until stdin closes."""
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    warnings.filterwarnings("ignore", message="lancedb fork support is experimental")
    print("ZYGOTE READY", flush=True)
    for line in sys.stdin:
        command, _, log_path = line.strip().partition(" ")
        if command != "serve":
            continue
        pid = os.fork()
        if pid == 0:
            try:
                _child(log_path)
            finally:
                os._exit(0)
        print(f"CHILD {pid}", flush=True)


if __name__ == "__main__":
    main()
