"""``memproxy serve``'s process model (``proxy.supervisor``): chat processes and a memory writer, killed at will.

The real CLI with ``MEMPROXY_SERVER__WORKERS=2``: a supervisor, two chat processes and one memory writer. Under a
burst of chats, SIGKILL to the writer and then to a chat process: the supervisor starts each again, the chat
keeps answering (a request in flight on the killed chat process may fail), and every answered exchange is
stored exactly once. A writer started again gets the users' latest chats and keys from the chat processes.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from tests.support.processes import fake_upstream_process, memproxy_process, process_tree

pytestmark = pytest.mark.e2e

ADMIN = "admin-key-processes"
BURST = 80


@pytest.fixture(scope="module")
def upstream() -> Iterator[str]:
    with fake_upstream_process(record=True) as (_, url):
        yield url


def _env(upstream: str, data: Path, **extra: str) -> dict[str, str]:
    return {
        "MEMPROXY_UPSTREAM__BASE_URL": upstream,
        "MEMPROXY_STORAGE__PATH": str(data),
        "MEMPROXY_ADMIN__API_KEY": ADMIN,
        "MEMPROXY_SERVER__WORKERS": "2",
        "MEMPROXY_MEMORY__RETRIEVAL_TIMEOUT_MS": "20000",  # behaviour, not speed, is under test
        "MEMPROXY_RETRIEVAL__ARM_TIMEOUT_MS": "20000",
        **extra,
    }


def _roles(pid: int) -> dict[str, int]:
    return {role: child for child, role in process_tree(pid).items()}


def _eventually(check: Callable[[], bool], timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except urllib.error.HTTPError as error:  # 503 while the writer (which serves management) restarts
            if error.code != 503:
                raise
        time.sleep(0.3)
    raise AssertionError("condition not met in time")


def _get(url: str) -> Any:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {ADMIN}"})  # noqa: S310 (loopback)
    with urllib.request.urlopen(request, timeout=30) as answer:  # noqa: S310
        return orjson.loads(answer.read())


def _user_turns(root: str, user: str) -> list[str]:
    page = _get(f"{root}/v1/memory/users/{user}/memories?kind=turn&limit=100")
    return [m["text"] for m in page["data"] if m.get("role") == "user"]


async def _burst(base: str, kill: Callable[[int], None]) -> tuple[set[int], int]:
    """``BURST`` chats, two at a time, each its own user and words; ``kill(i)`` before chat ``i``. Returns the
    chats answered and the errors."""
    answered: set[int] = set()
    errors = 0
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(BURST):
        queue.put_nowait(i)

    async def client(session: aiohttp.ClientSession) -> None:
        nonlocal errors
        while not queue.empty():
            i = queue.get_nowait()
            kill(i)
            body = {"model": "fake-echo", "messages": [{"role": "user", "content": f"burst note number {i} kiwi"}]}
            headers = {"Authorization": "Bearer sk-client", "X-Memory-User": f"burst-{i}"}
            try:
                async with session.post(f"{base}/chat/completions", json=body, headers=headers) as response:
                    await response.read()
                    if response.status == 200:
                        answered.add(i)
                    else:
                        errors += 1
            except aiohttp.ClientError:
                errors += 1
            await asyncio.sleep(0.05)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        await asyncio.gather(client(session), client(session))
    return answered, errors


def test_workers_kill_9_costs_at_most_two_chats_and_loses_no_exchange(upstream: str, tmp_path: Path) -> None:
    """Two chat processes and a writer; SIGKILL to the writer, then to a chat process, mid-burst: at most two
    chats fail, both come back, and every answered exchange is stored exactly once."""
    with memproxy_process(_env(upstream, tmp_path)) as (proc, base):
        root = base.removesuffix("/v1")
        roles = _roles(proc.popen.pid)
        assert {"writer-0", "chat-0", "chat-1"} <= set(roles), roles
        killed: dict[str, int] = {}

        def kill(i: int) -> None:
            victim = {20: "writer-0", 45: "chat-0"}.get(i)
            if victim is not None and victim not in killed:
                killed[victim] = roles[victim]
                os.kill(roles[victim], signal.SIGKILL)

        answered, errors = asyncio.run(_burst(base, kill))
        assert errors <= 2, (errors, sorted(answered))
        assert len(answered) >= BURST - 2

        def restarted() -> bool:
            now = _roles(proc.popen.pid)
            return all(now.get(role) not in (None, pid) for role, pid in killed.items())

        _eventually(restarted)
        for i in sorted(answered):  # stored exactly once, whichever process answered and whatever was killed
            _eventually(lambda i=i: len(_user_turns(root, f"burst-{i}")) >= 1)
            assert _user_turns(root, f"burst-{i}") == [f"burst note number {i} kiwi"]
        with urllib.request.urlopen(f"{root}/readyz", timeout=10) as ready:  # noqa: S310
            assert ready.status == 200
        assert "supervisor.child_exited" in proc.output


def test_restarted_writer_gets_the_chat_processes_keys(upstream: str, tmp_path: Path) -> None:
    """No upstream key configured: memory-side calls use the client's key, held in memory only. A chat answered
    while the writer is down (killed) still gets its facts extracted with that key by the next writer."""
    env = _env(upstream, tmp_path, MEMPROXY_WRITER__FACTS_WINDOW_WAIT_S="0.5")
    with memproxy_process(env) as (proc, base):
        roles = _roles(proc.popen.pid)
        os.kill(roles["writer-0"], signal.SIGKILL)
        body = {"model": "fake-echo", "messages": [{"role": "user", "content": "My name is Ada and I love hiking."}]}
        request = urllib.request.Request(  # noqa: S310 (loopback)
            f"{base}/chat/completions", data=orjson.dumps(body), method="POST",
            headers={"Authorization": "Bearer sk-client-handover", "X-Memory-User": "ada",
                     "Content-Type": "application/json"},
        )  # fmt: skip
        with urllib.request.urlopen(request, timeout=30) as answer:  # noqa: S310
            assert answer.status == 200

        def extracted_with_client_key() -> bool:
            root = upstream.removesuffix("/v1")
            with urllib.request.urlopen(f"{root}/_fake/requests", timeout=10) as seen:  # noqa: S310
                requests = orjson.loads(seen.read())
            return any(
                r["json"].get("response_format", {}).get("type") == "json_schema"
                and r["headers"].get("Authorization") == "Bearer sk-client-handover"
                for r in requests
            )

        _eventually(extracted_with_client_key)
        assert _roles(proc.popen.pid)["writer-0"] != roles["writer-0"]
