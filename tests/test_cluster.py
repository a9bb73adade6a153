"""The cluster on this machine: moto S3, real nginx with deploy/nginx/memproxy.conf, 3 memproxy replicas.

Run by ``make test-cluster`` (which installs nginx and sets MEMPROXY_TEST_CLUSTER=1); skipped elsewhere.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.support.processes import MEMPROXY, Process, child_env, fake_upstream_process
from tests.support.router import check, free_port, nginx, render
from tests.support.s3 import bucket_uri, moto_server, s3_environ

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.skipif(os.environ.get("MEMPROXY_TEST_CLUSTER") != "1", reason="make test-cluster runs these"),
    pytest.mark.timeout(900),
]

ADMIN = "admin-key-cluster"
ADMIN_HEADERS = {"Authorization": f"Bearer {ADMIN}"}


@dataclass
class Replica:
    """One memproxy process on a fixed port (nginx's config names it), with its own local disk."""

    port: int
    env: dict[str, str]
    data: Path
    proc: Process | None = None
    disks: list[Path] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, *, fresh_disk: bool = False) -> None:
        """Start it (on an empty local directory when ``fresh_disk``)."""
        if fresh_disk:
            self.data = Path(tempfile.mkdtemp(prefix="memproxy-replica-"))
            self.disks.append(self.data)
        env = {**self.env, "MEMPROXY_STORAGE__PATH": str(self.data)}
        self.proc = Process([str(MEMPROXY), "serve", "--port", str(self.port)], child_env(**env))

    def wait_ready(self, timeout: float = 240.0) -> None:
        """Until /readyz answers 200."""
        assert self.proc is not None
        self.proc.wait_for(r'"event":\s*"server.started"', timeout=timeout)

    def kill(self) -> None:
        """kill -9: no shutdown, no flush, nothing."""
        assert self.proc is not None
        os.kill(self.proc.popen.pid, signal.SIGKILL)
        self.proc.popen.wait(30)
        self.proc.cleanup()
        self.proc = None

    def stop(self) -> None:
        """SIGTERM (end of the module)."""
        if self.proc is not None:
            self.proc.stop()
            self.proc.cleanup()
            self.proc = None


@dataclass
class Cluster:
    """The router's URL and the replicas behind it."""

    router: str
    replicas: list[Replica]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """moto, the fake upstream, 3 replicas on one bucket and nginx in front, all on 127.0.0.1."""
    with moto_server() as endpoint, fake_upstream_process() as (_, upstream):
        env = {
            **s3_environ(endpoint),
            "MEMPROXY_STORAGE__URI": bucket_uri("store"),
            "MEMPROXY_STORAGE__SYNC_INTERVAL_S": "0.5",
            "MEMPROXY_STORAGE__LEASE_S": "3",
            "MEMPROXY_STORAGE__DEAD_AFTER_S": "4",
            "MEMPROXY_STORE__OPTIMIZE_INTERVAL_S": "5",
            "MEMPROXY_UPSTREAM__BASE_URL": upstream,
            "MEMPROXY_UPSTREAM__API_KEY": "sk-upstream-cluster",
            "MEMPROXY_ADMIN__API_KEY": ADMIN,
            # behaviour, not speed, is under test (2 shared cores, 3 replicas)
            "MEMPROXY_MEMORY__RETRIEVAL_TIMEOUT_MS": "30000",
            "MEMPROXY_RETRIEVAL__ARM_TIMEOUT_MS": "30000",
            "MEMPROXY_MEMORY__READ_QUEUE_MS": "30000",
        }
        replicas = [Replica(free_port(), env, tmp_path_factory.mktemp(f"replica{i}")) for i in range(3)]
        try:
            for replica in replicas:
                replica.start()
            for replica in replicas:
                replica.wait_ready()
            with nginx(tmp_path_factory.mktemp("nginx"), [f"127.0.0.1:{r.port}" for r in replicas]) as router:
                yield Cluster(router, replicas)
        finally:
            for replica in replicas:
                replica.stop()
                for disk in replica.disks:
                    shutil.rmtree(disk, ignore_errors=True)


# --- client helpers ------------------------------------------------------------------------------------


async def tell(session: aiohttp.ClientSession, base: str, user: str, text: str, *, mode: str = "full") -> int:
    """A streamed chat turn; the status once the whole stream (its last chunk) has arrived."""
    body = {"model": "fake-echo", "stream": True, "messages": [{"role": "user", "content": text}]}
    headers = {"X-Memory-User": user, "X-Memory-Conversation": f"c-{uuid.uuid4().hex[:8]}", "X-Memory-Mode": mode}
    async with session.post(f"{base}/v1/chat/completions", json=body, headers=headers) as response:
        await response.read()
        return response.status


async def injectable(session: aiohttp.ClientSession, base: str, user: str, query: str) -> str:
    """The memory block a chat asking ``query`` would get (management search)."""
    async with session.post(
        f"{base}/v1/memory/users/{user}/search", json={"query": query, "k": 10}, headers=ADMIN_HEADERS
    ) as response:
        assert response.status == 200, await response.text()
        return str((await response.json())["injected_block"])


async def exported(session: aiohttp.ClientSession, base: str, user: str) -> list[dict[str, Any]]:
    """The user's stored records (export)."""
    async with session.get(f"{base}/v1/memory/users/{user}/export", headers=ADMIN_HEADERS) as response:
        assert response.status == 200, await response.text()
        return [json.loads(line) for line in (await response.text()).splitlines() if line.strip()]


async def turns(session: aiohttp.ClientSession, base: str, user: str) -> list[str]:
    """Texts of the user's stored turns (export)."""
    return [row["text"] for row in await exported(session, base, user) if row["kind"] == "turn"]


async def eventually(check: Callable[[], Awaitable[bool]], within_s: float = 60.0) -> float:
    """Seconds until ``check`` holds (errors count as not yet); fails after ``within_s``."""
    started = time.monotonic()
    while True:
        try:
            if await check():
                return time.monotonic() - started
        except (aiohttp.ClientError, AssertionError, TimeoutError):
            pass
        assert time.monotonic() - started < within_s, "condition not met in time"
        await asyncio.sleep(0.25)


def _session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60))


def _code(user: str) -> str:
    return f"locker-{uuid.uuid5(uuid.NAMESPACE_DNS, user).hex[:6]}"


async def _tell_codes(session: aiohttp.ClientSession, base: str, users: list[str]) -> None:
    for user in users:
        assert await tell(session, base, user, f"Remember that my locker code is {_code(user)}.") == 200
    for user in users:
        await eventually(lambda u=user: _has_code(session, base, u))


async def _has_code(session: aiohttp.ClientSession, base: str, user: str) -> bool:
    return _code(user) in await injectable(session, base, user, "What is my locker code?")


async def _stored_once_each(
    session: aiohttp.ClientSession, base: str, acknowledged: dict[str, list[str]], within_s: float
) -> dict[str, int]:
    """Tokens whose exchange is not stored exactly once (user turn + echo = 2 turns), once that settles."""
    deadline = time.monotonic() + within_s
    while True:
        wrong: dict[str, int] = {}
        for user, tokens in acknowledged.items():
            texts = await turns(session, base, user)
            wrong.update({t: n for t in tokens if (n := sum(t in text for text in texts)) != 2})
        if not wrong or time.monotonic() > deadline:
            return wrong
        await asyncio.sleep(1.0)


# --- the tests -----------------------------------------------------------------------------------------


async def test_background_work_runs_on_exactly_one_replica(cluster: Cluster) -> None:
    """Exactly one replica holds the maintenance lease (compaction, purges, insight schedule), per /metrics."""

    async def one_holder() -> bool:
        held = []
        async with _session() as session:
            for replica in cluster.replicas:
                async with session.get(f"{replica.url}/metrics") as response:
                    text = await response.text()
                held += [
                    float(line.split()[-1])
                    for line in text.splitlines()
                    if line.startswith("memproxy_cluster_lease_held")
                ]
        return sorted(held) == [0.0, 0.0, 1.0]

    await eventually(one_holder, within_s=30)


def test_shipped_nginx_config_passes_nginx_t(tmp_path: Path) -> None:
    """``nginx -t`` accepts deploy/nginx/memproxy.conf (ports and addresses swapped in)."""
    result = check(render(tmp_path, free_port(), ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"]))
    assert result.returncode == 0, result.stderr


async def test_facts_told_through_the_router_are_recalled_through_every_replica(cluster: Cluster) -> None:
    """Codes told through nginx are injectable through nginx and through each replica directly."""
    users = [f"rec-{i}" for i in range(6)]
    async with _session() as session:
        await _tell_codes(session, cluster.router, users)
        for replica in cluster.replicas:
            for user in users:
                await eventually(lambda u=user, r=replica: _has_code(session, r.url, u), within_s=20)


async def test_kill_9_under_write_load_loses_nothing_acknowledged(cluster: Cluster) -> None:
    """A replica killed with kill -9 mid-load: every acknowledged exchange is stored exactly once, all users served."""
    users = [f"load-{i}" for i in range(12)]
    acknowledged: dict[str, list[str]] = {user: [] for user in users}
    errors = 0
    stop = asyncio.Event()
    async with _session() as session:
        await _tell_codes(session, cluster.router, users)

        async def writer(worker: int) -> None:
            nonlocal errors
            n = 0
            while not stop.is_set():
                user = users[(worker + n) % len(users)]
                token = f"tok{uuid.uuid4().hex[:10]}"
                n += 1
                try:
                    status = await tell(session, cluster.router, user, f"Note {token} for later.")
                except (aiohttp.ClientError, TimeoutError):
                    status = 0
                if status == 200:
                    acknowledged[user].append(token)
                else:
                    errors += 1

        workers = [asyncio.create_task(writer(w)) for w in range(6)]
        await asyncio.sleep(6)
        victim = cluster.replicas[1]
        victim.kill()
        before_kill = sum(map(len, acknowledged.values()))
        await asyncio.sleep(8)
        stop.set()
        await asyncio.gather(*workers)
        total = sum(map(len, acknowledged.values()))
        assert before_kill > 0, errors
        assert total > before_kill, (before_kill, total, errors)  # the survivors took the killed one's users

        wrong = await _stored_once_each(session, cluster.router, acknowledged, within_s=180)
        assert wrong == {}, f"acknowledged exchanges not stored exactly once (token: turns found): {wrong}"
        for user in users:  # served by the survivors, with their memories
            assert await _has_code(session, cluster.router, user)
        victim.start(fresh_disk=True)
        victim.wait_ready()


async def test_a_replica_restarted_on_an_empty_disk_serves_its_users(cluster: Cluster) -> None:
    """kill -9, then a restart on an empty local directory: the replica serves every user's memories again."""
    users = [f"disk-{i}" for i in range(6)]
    replica = cluster.replicas[2]
    async with _session() as session:
        await _tell_codes(session, cluster.router, users)
        old_disk = replica.data
        replica.kill()
        replica.start(fresh_disk=True)  # a new, empty directory: no keyword index, no queue, no cache
        assert replica.data != old_disk
        replica.wait_ready()
        for user in users:
            assert await _has_code(session, replica.url, user)
            assert await tell(session, replica.url, user, "What is my locker code?", mode="read") == 200


async def test_forget_user_through_one_replica_leaves_nothing_injectable_through_any(cluster: Cluster) -> None:
    """DELETE /v1/memory/users/{id} on replica 0 while the user's jobs may still run on the replica that served
    them: within seconds no replica can inject or export anything of theirs."""
    user, other = "forget-me", "keep-me"
    async with _session() as session:
        await _tell_codes(session, cluster.router, [user, other])
        for replica in cluster.replicas:  # every replica has the user warm in its caches
            await eventually(lambda r=replica: _has_code(session, r.url, user), within_s=20)
        async with session.delete(
            f"{cluster.replicas[0].url}/v1/memory/users/{user}", headers=ADMIN_HEADERS
        ) as response:
            assert response.status == 200, await response.text()

        left: dict[int, tuple[bool, list[str]]] = {}

        async def forgotten_everywhere() -> bool:
            for i, replica in enumerate(cluster.replicas):
                block = await injectable(session, replica.url, user, "What is my locker code?")
                left[i] = (_code(user) in block, [row["kind"] for row in await exported(session, replica.url, user)])
            return all(state == (False, []) for state in left.values())

        try:
            delay = await eventually(forgotten_everywhere, within_s=20)
        except AssertionError:
            raise AssertionError(f"(injectable, kinds exported) left by replica: {left}") from None
        print(f"forget reached every replica in {delay:.2f} s")
        for replica in cluster.replicas:
            assert await _has_code(session, replica.url, other)
