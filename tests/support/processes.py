"""Start the fake upstream and the real ``memproxy serve`` CLI as subprocesses, and stop them."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MEMPROXY = Path(sys.executable).with_name("memproxy")


class Process:
    """A child process whose output goes to a temporary file (no reader thread in the caller)."""

    def __init__(self, args: list[str], env: Mapping[str, str], cwd: Path = ROOT) -> None:
        self._log = tempfile.NamedTemporaryFile(prefix="memproxy-proc-", suffix=".log", delete=False)  # noqa: SIM115
        self.popen = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT, env=dict(env), cwd=cwd)

    @property
    def log_path(self) -> str:
        """The file the output goes to."""
        return self._log.name

    @property
    def lines(self) -> list[str]:
        """Every line printed so far."""
        return Path(self._log.name).read_text(errors="replace").splitlines()

    def wait_for(self, pattern: str, timeout: float = 60.0) -> re.Match[str]:
        """The first output line matching ``pattern``; fails if the process dies or time runs out."""
        compiled = re.compile(pattern)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            exited = self.popen.poll() is not None
            for line in self.lines:
                if match := compiled.search(line):
                    return match
            if exited:
                break
            time.sleep(0.02)
        raise AssertionError(f"no line matching {pattern!r}; output:\n" + "\n".join(self.lines[-40:]))

    @property
    def output(self) -> str:
        """Everything printed so far."""
        return "\n".join(self.lines)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        """Send ``sig`` and wait for exit; returns the exit code."""
        if self.popen.poll() is None:
            self.popen.send_signal(sig)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)
        self._log.close()
        return self.popen.returncode

    def cleanup(self) -> None:
        """Remove the output file."""
        Path(self._log.name).unlink(missing_ok=True)


# What the Dockerfile and ``make serve`` set (docs/operations.md, "Memory (RSS)"): the benchmarks run memproxy so.
DEPLOYED_ALLOCATOR = {
    "ARROW_DEFAULT_MEMORY_POOL": "system",
    "MALLOC_MMAP_THRESHOLD_": "131072",
    "MALLOC_ARENA_MAX": "2",
}


def child_env(**extra: str) -> dict[str, str]:
    """The environment for child processes: offline, no inherited MEMPROXY_* settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMPROXY_")}
    env.update({"HF_HUB_OFFLINE": "1", "LITELLM_LOCAL_MODEL_COST_MAP": "True", "PYTHONUNBUFFERED": "1"})
    env.update(extra)
    return env


@contextmanager
def fake_upstream_process(latency_ms: float = 0.0, *, record: bool = False) -> Iterator[tuple[Process, str]]:
    """The fake upstream in its own process; yields it and its base URL (``record``: it keeps every request,
    listed at ``GET <root>/_fake/requests``). A chat request without a key gets a 401, as from any hosted API."""
    args = [sys.executable, "-m", "tests.fake_upstream", "--port", "0", "--latency-ms", str(latency_ms)]
    args += ["--record"] if record else []
    proc = Process(args, child_env())
    try:
        url = proc.wait_for(r"fake upstream on (\S+)").group(1)
        yield proc, url
    finally:
        proc.stop()
        proc.cleanup()


@contextmanager
def memproxy_process(
    env: Mapping[str, str], args: list[str] | None = None, timeout: float = 120.0, cwd: Path = ROOT
) -> Iterator[tuple[Process, str]]:
    """``memproxy serve --port 0`` with ``env`` in ``cwd``; yields it and its base URL (ending in /v1)."""
    # one chat process beside the writer unless a test asks for more (two shared cores; tests/test_processes.py
    # runs two): the same process model, a process fewer per server
    env = {"MEMPROXY_SERVER__WORKERS": "1", **env}
    proc = Process([str(MEMPROXY), "serve", "--port", "0", *(args or [])], child_env(**env), cwd)
    try:
        line = proc.wait_for(r'"event":\s*"server.started"', timeout=timeout).string
        port = json.loads(line)["port"]
        yield proc, f"http://127.0.0.1:{port}/v1"
    finally:
        proc.stop()
        proc.cleanup()


def process_tree(pid: int) -> dict[int, str]:
    """``pid`` and its descendants, each with its role in ``memproxy serve``'s process model (``supervisor``,
    ``writer-0``, ``chat-1``...; ``other`` for anything else)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    tree, todo = {pid: "supervisor"}, [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            try:
                argv = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            role = argv[argv.index(b"proxy.roles") + 1].decode() if b"proxy.roles" in argv else "other"
            index = argv[argv.index(b"--index") + 1].decode() if b"--index" in argv else "0"
            tree[child] = f"{role}-{index}"
            todo.append(child)
    return tree
