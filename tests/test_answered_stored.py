"""Answered means stored: kill -9 under mixed write load, clients that hang up, and a disconnect during a commit.

The crash test runs the real ``memproxy serve`` (real model, LanceDB, Tantivy, job queue) against the fake
upstream, 20 times over one data directory: each time clients send streamed and non-streamed chats (some of
them hang up the moment they hold the complete answer, as curl and one-shot clients do) and the process is
killed with SIGKILL at a random moment. A client notes an exchange as answered only once it holds the complete
answer (the whole body; a stream's finish event). At the end, every answered exchange must be stored exactly
once: one user turn and one assistant turn carrying its unique token.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import re
import signal
import sqlite3
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from proxy.memory.embedders.factory import build_embedder
from proxy.memory.embedders.settings import EmbedderSettings
from proxy.memory.service import Exchange, Injection, NullMemory, ReadRequest
from proxy.memory.store.memory_store import MemoryStore, StoreSettings
from proxy.memory.store.records import Kind
from proxy.memory.write.job_types import JobQueueSettings
from proxy.memory.write.queue import JobQueue
from tests.conftest import ProxyFactory
from tests.support.processes import ROOT, child_env, fake_upstream_process
from tests.test_proxy import _factory

CYCLES = 20
USERS = ("crash-ann", "crash-ben", "crash-cat")
TOKEN = re.compile(r"<(k\d+x\d+)>")


class Load:
    """Clients of four kinds sending chats until stopped; ``answered`` holds the tokens of complete answers."""

    def __init__(self, url: str, cycle: int, rng: random.Random) -> None:
        self.url = f"{url}/chat/completions"
        self.cycle = cycle
        self.rng = rng
        self.sent = 0
        self.answered: set[str] = set()
        self.stop = asyncio.Event()

    def _request(self) -> tuple[str, dict[str, Any], dict[str, str]]:
        token = f"k{self.cycle}x{self.sent}"
        self.sent += 1
        user = self.rng.choice(USERS)
        body = {"model": "fake-echo", "messages": [{"role": "user", "content": f"please note item <{token}> now"}]}
        return token, body, {"X-Memory-User": user, "X-Memory-Conversation": f"conv-{user}"}

    async def _non_stream(self, session: aiohttp.ClientSession) -> None:
        token, body, headers = self._request()
        async with session.post(self.url, json=body, headers=headers) as response:
            data = await response.read()  # with force_close, the client hangs up as soon as it has this
        if response.status == 200 and f"<{token}>" in orjson.loads(data)["choices"][0]["message"]["content"]:
            self.answered.add(token)

    async def _stream(self, session: aiohttp.ClientSession, hang_up: bool) -> None:
        token, body, headers = self._request()
        text = ""
        async with session.post(self.url, json={**body, "stream": True}, headers=headers) as response:
            async for line in response.content:
                if not line.startswith(b"data: {"):
                    continue
                choice = orjson.loads(line[6:])["choices"][0]
                text += choice["delta"].get("content") or ""
                if choice.get("finish_reason"):  # the complete answer is here
                    if f"<{token}>" in text:
                        self.answered.add(token)
                    if hang_up:
                        response.close()
                        return

    async def client(self, kind: str) -> None:
        """One client looping until stopped; a killed server only ends its current request."""
        connector = aiohttp.TCPConnector(force_close=kind in ("hangup_json", "hangup_stream"))
        async with aiohttp.ClientSession(connector=connector) as session:
            while not self.stop.is_set():
                try:
                    if kind.endswith("json"):
                        await self._non_stream(session)
                    else:
                        await self._stream(session, hang_up=kind == "hangup_stream")
                except (TimeoutError, aiohttp.ClientError, ValueError):
                    await asyncio.sleep(0.01)

    async def run_until_killed(self, pid: int, after_s: float) -> None:
        """Clients of every kind for ``after_s`` seconds, then SIGKILL, then the clients stop."""
        kinds = ["json", "stream", "hangup_json", "hangup_stream"] * 2
        clients = [asyncio.create_task(self.client(kind)) for kind in kinds]
        await asyncio.sleep(after_s)
        os.kill(pid, signal.SIGKILL)
        await gone(pid)
        self.stop.set()
        await asyncio.gather(*clients)


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists (children of the zygote are reaped at once, no zombies)."""
    return Path(f"/proc/{pid}").exists()


async def gone(pid: int, within_s: float = 30.0) -> None:
    """Wait until process ``pid`` no longer exists."""
    deadline = time.monotonic() + within_s
    while alive(pid):
        assert time.monotonic() < deadline, f"process {pid} is still there"
        await asyncio.sleep(0.02)


class Zygote:
    """``tests.support.serve_zygote``: real ``memproxy serve`` processes forked after the imports are done."""

    def __init__(self, env: Mapping[str, str], logs: Path) -> None:
        self._logs = logs
        self._count = 0
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "tests.support.serve_zygote"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=child_env(**env),
            cwd=ROOT,
            text=True,
        )
        assert self._line() == "ZYGOTE READY"

    def _line(self) -> str:
        assert self.popen.stdout is not None
        return self.popen.stdout.readline().strip()

    async def serve(self) -> tuple[int, str, Path]:
        """A fresh server: its pid, base URL (ending in /v1) and log file."""
        assert self.popen.stdin is not None
        self._count += 1
        log = self._logs / f"serve-{self._count}.log"
        self.popen.stdin.write(f"serve {log}\n")
        self.popen.stdin.flush()
        pid = int(self._line().split()[1])
        deadline = time.monotonic() + 120
        while True:
            text = log.read_text() if log.exists() else ""
            if match := re.search(r'"port":\s*(\d+).*"event":\s*"server.started"', text):
                return pid, f"http://127.0.0.1:{match.group(1)}/v1", log
            assert alive(pid), f"server died:\n{text[-3000:]}"
            assert time.monotonic() < deadline, f"server did not start:\n{text[-3000:]}"
            await asyncio.sleep(0.05)

    def close(self) -> None:
        """Stop the zygote (its servers must be stopped first)."""
        assert self.popen.stdin is not None
        assert self.popen.stdout is not None
        self.popen.stdin.close()
        self.popen.wait(30)
        self.popen.stdout.close()


def _memproxy_env(upstream: str, data: Path) -> dict[str, str]:
    return {
        "MEMPROXY_UPSTREAM__BASE_URL": upstream,
        "MEMPROXY_UPSTREAM__API_KEY": "sk-upstream",  # the load's clients send none
        "MEMPROXY_STORAGE__PATH": str(data),
        "MEMPROXY_JOBS__POLL_INTERVAL_S": "0.1",
        "MEMPROXY_JOBS__BACKOFF_BASE_S": "0.1",
        "MEMPROXY_JOBS__BACKOFF_MAX_S": "1",
        "MEMPROXY_MEMORY__RETRIEVAL_TIMEOUT_MS": "2000",
        # no server lives the default 300 s, and an uncompacted table makes every batch slower
        "MEMPROXY_STORE__OPTIMIZE_INTERVAL_S": "2",
        "MEMPROXY_WRITER__INSIGHTS_DEBOUNCE_S": "3600",
        "MEMPROXY_WRITER__SUMMARY_IDLE_S": "3600",
        "MEMPROXY_WRITER__SUMMARY_MAX_NEW_TURNS": "100000",
        "MEMPROXY_INSIGHTS__MODEL": "fake-echo",
    }


async def _gauge(session: aiohttp.ClientSession, base: str, name: str) -> float:
    async with session.get(base.removesuffix("/v1") + "/metrics") as response:
        text = await response.text()
    match = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else float("nan")


async def wait_for_drain(base: str, within_s: float = 120.0) -> float:
    """Wait until no job is due or running (twice in a row); returns the dead-letter count."""
    deadline = time.monotonic() + within_s
    quiet = 0
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            ready = await _gauge(session, base, "memproxy_jobs_ready")
            running = await _gauge(session, base, "memproxy_jobs_running")
            quiet = quiet + 1 if ready == 0 and running == 0 else 0
            if quiet >= 2:
                return await _gauge(session, base, "memproxy_jobs_dead_letters")
            await asyncio.sleep(0.3)
    raise AssertionError("the write path did not drain")


async def stored_turn_tokens(data: Path) -> Counter[tuple[str, str]]:
    """(token, role) of every stored turn, counted."""
    counts: Counter[tuple[str, str]] = Counter()
    async with (
        build_embedder(EmbedderSettings(threads=1)) as embedder,
        MemoryStore(StoreSettings(path=data), embedder) as store,
    ):
        for user in USERS:
            page = await store.list(user, [Kind.TURN], limit=1_000_000, include_invalid=True)
            for record in page.data:
                for token in TOKEN.findall(record.text):
                    counts[(token, record.role or "")] += 1
    return counts


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_every_answered_exchange_is_stored_exactly_once_across_kill_9(tmp_path: Path) -> None:
    """20 SIGKILLs under stream/non-stream load with hanging-up clients: each complete answer is stored once."""
    rng = random.Random(15)
    data = tmp_path / "data"
    answered: set[str] = set()
    sent = 0
    with fake_upstream_process() as (_, upstream):
        zygote = Zygote(_memproxy_env(upstream, data), tmp_path)
        pid = 0
        try:
            for cycle in range(CYCLES):
                pid, url, _ = await zygote.serve()
                load = Load(url, cycle, rng)
                await load.run_until_killed(pid, rng.uniform(0.3, 1.5))
                answered |= load.answered
                sent += load.sent
            pid, url, log = await zygote.serve()
            dead = await wait_for_drain(url)
            os.kill(pid, signal.SIGTERM)
            await gone(pid)
        finally:
            if pid and alive(pid):  # a failed check must not leave a server behind
                os.kill(pid, signal.SIGKILL)
            zygote.close()
    assert '"server.stopped"' in log.read_text()
    counts = await stored_turn_tokens(data)
    print(f"{len(answered)} answered of {sent} sent over {CYCLES} kills")  # shown with -s
    assert len(answered) > CYCLES * 5, f"too little load: {len(answered)} answered of {sent}"
    missing = sorted(t for t in answered if counts[(t, "user")] == 0 or counts[(t, "assistant")] == 0)
    doubled = sorted(t for t in answered if counts[(t, "user")] > 1 or counts[(t, "assistant")] > 1)
    assert not missing, f"{len(missing)} of {len(answered)} lost: {missing[:10]}: {_jobs_of(data, missing[:5])}"
    assert not doubled, f"stored more than once: {doubled[:10]}"
    async with JobQueue(JobQueueSettings(path=data / "jobs.sqlite3")) as queue:
        letters = await queue.dead_letters()
    assert dead == 0, [(d["kind"], d["attempts"], d["last_error"]) for d in letters]


def _jobs_of(data: Path, tokens: list[str]) -> list[Any]:
    """The queue's rows that still mention ``tokens`` (for a failure message)."""
    with contextlib.closing(sqlite3.connect(data / "jobs.sqlite3" / "jobs.sqlite3")) as db:
        return [
            db.execute(
                "SELECT kind, state, attempts, deferrals, last_error FROM jobs WHERE payload LIKE ?", (f"%<{token}>%",)
            ).fetchall()
            for token in tokens
        ]


class SlowRecordMemory(NullMemory):
    """A memory seam whose commit takes 0.5 s (a slow disk), counting what it records (the rest: ``NullMemory``'s)."""

    ready = True

    def __init__(self) -> None:
        self.recorded: list[Exchange] = []

    async def inject(self, request: ReadRequest) -> Injection:
        return Injection()

    def carried(self, request: ReadRequest) -> Injection:
        return Injection()

    async def record(self, exchange: Exchange) -> None:
        await asyncio.sleep(0.5)
        self.recorded.append(exchange)


@pytest.mark.parametrize("stream", [False, True])
async def test_client_hanging_up_during_the_commit_cannot_cancel_it(make_proxy: ProxyFactory, stream: bool) -> None:
    """A client that gives up while its exchange is being committed gets nothing, and the commit still lands once."""
    memory = SlowRecordMemory()
    proxy = await make_proxy(memory_factory=_factory(memory))  # type: ignore[arg-type]  # any seam will do
    body = {"model": "fake-echo", "messages": [{"role": "user", "content": "hang up on me"}], "stream": stream}

    async def ask() -> str:
        response = await proxy.post("/v1/chat/completions", json=body, headers={"X-Memory-User": "al"})
        return await response.text()

    with pytest.raises(TimeoutError):  # the end of the answer is held until the commit is done
        await asyncio.wait_for(ask(), timeout=0.2)
    await asyncio.sleep(1.0)
    assert len(memory.recorded) == 1
    assert memory.recorded[0].assistant_text == "echo: hang up on me"
    assert memory.recorded[0].partial is False
