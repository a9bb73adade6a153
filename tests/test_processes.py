"""``memproxy serve``'s process model (``proxy.supervisor``): chat processes and a memory writer, killed at will.

The real CLI with ``MEMPROXY_SERVER__WORKERS=2``: a supervisor, two chat processes and one memory writer. Under a
burst of chats, SIGKILL to the writer and then to a chat process: the supervisor starts each again, the chat
keeps answering (a request in flight on the killed chat process may fail), and every answered exchange is
stored exactly once. A writer started again gets the users' latest chats and keys from the chat processes.
"""

from __future__ import annotations

import asyncio
import gzip
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
from aiohttp import web
from aiohttp.test_utils import make_mocked_request
from multidict import CIMultiDict

from proxy.access import key_hash
from proxy.as_sent import AS_SENT
from proxy.chat_handoff import request_bytes
from proxy.chat_routing import ROUTED_HEADER, ChatRouter, owner_of
from tests.support.processes import fake_upstream_process, memproxy_process, process_tree

pytestmark = pytest.mark.e2e

ADMIN = "admin-key-processes"
BURST = 80


@pytest.fixture(scope="module")
def upstream() -> Iterator[str]:
    with fake_upstream_process(record=True) as (_, url):  # as any hosted API
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
    # The next writer may run the chat's facts job before the chat processes hand it the key: the call without a
    # key gets a 401 (as from any hosted API), the job waits, and the key's arrival wakes it (no recheck here).
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

        def memory_calls() -> list[tuple[str | None, str | None]]:  # (response format, Authorization) of each
            root = upstream.removesuffix("/v1")
            with urllib.request.urlopen(f"{root}/_fake/requests", timeout=10) as seen:  # noqa: S310
                requests = orjson.loads(seen.read())
            return [(r["json"].get("response_format", {}).get("type"), r["headers"].get("Authorization"))
                    for r in requests]  # fmt: skip

        try:
            _eventually(lambda: ("json_schema", "Bearer sk-client-handover") in memory_calls())
        except AssertionError:  # what the upstream saw, and what memproxy said
            raise AssertionError(f"upstream saw {memory_calls()[-20:]}; memproxy:\n" + proc.output[-20_000:]) from None
        assert _roles(proc.popen.pid)["writer-0"] != roles["writer-0"]


def test_each_users_chats_are_served_by_that_users_chat_process(upstream: str, tmp_path: Path) -> None:
    """Chats of many users on fresh connections, which the kernel spreads over both chat processes: each is
    served (stored, logged) by its user's own chat process (``chat_routing.owner_of``), the other relaying it.
    So a conversation's later requests carry the very memory block its first one got (the prompt cache's
    prefix), whichever process took the connection."""
    with memproxy_process(_env(upstream, tmp_path)) as (proc, base):
        users = [f"route-{i}" for i in range(24)]

        async def one(user: str, text: str, history: list[dict[str, str]] | None = None) -> dict[str, Any]:
            messages = [*(history or []), {"role": "user", "content": text}]
            body = {"model": "fake-echo", "messages": messages}
            headers = {"Authorization": "Bearer sk-client", "X-Memory-User": user, "X-Request-Id": f"{user}-{text}"}
            connector = aiohttp.TCPConnector(force_close=True)  # a fresh connection each time
            async with (
                aiohttp.ClientSession(connector=connector) as session,
                session.post(f"{base}/chat/completions", json=body, headers=headers) as response,
            ):
                assert response.status == 200, await response.text()
                return dict(await response.json())

        async def everyone() -> None:
            await asyncio.gather(*(one(user, "I keep bees on the roof") for user in users))

        asyncio.run(everyone())
        _eventually(lambda: len(_served_by(proc.lines)) >= len(users), timeout=10)  # logged after the answer
        served = _served_by(proc.lines)
        assert {served[f"{user}-I keep bees on the roof"] for user in users} == {"chat-0", "chat-1"}
        for user in users:
            assert served[f"{user}-I keep bees on the roof"] == f"chat-{owner_of(user, 2)}"

        # The connections handed over are counted over both chat processes: any scrape (either process answers
        # it) says the same.
        counts = {_scraped(base, "memproxy_routing_handed_off_total") for _ in range(8)}
        assert len(counts) == 1, counts
        assert counts.pop() >= 1

        # A conversation of a user with memories: the same system prompt upstream at every request.
        root = upstream.removesuffix("/v1")

        def upstream_saw(marker: str) -> list[list[dict[str, Any]]]:
            with urllib.request.urlopen(f"{root}/_fake/requests", timeout=10) as seen:  # noqa: S310 (loopback)
                bodies = [r["json"] for r in orjson.loads(seen.read())]
            return [body["messages"] for body in bodies if marker in str(body.get("messages"))]

        probes = iter(range(100))

        def bees_remembered() -> bool:  # a new conversation each time, until the block holds the bees
            marker = f"anything new {next(probes)}"
            asyncio.run(one("route-0", marker))
            return "bees" in str(upstream_saw(marker)[-1][0])

        _eventually(bees_remembered, timeout=60)

        async def conversation() -> None:
            history: list[dict[str, str]] = []
            for step in range(6):
                answer = await one("route-0", f"what about bees step {step}", history)
                history += [{"role": "user", "content": f"what about bees step {step}"},
                            {"role": "assistant", "content": answer["choices"][0]["message"]["content"]}]  # fmt: skip

        asyncio.run(conversation())
        sent = upstream_saw("what about bees step")
        assert len(sent) == 6
        systems = {orjson.dumps(messages[0]) for messages in sent}
        assert len(systems) == 1
        assert b"bees" in systems.pop()


def _scraped(base: str, name: str) -> float:
    """A counter's value as ``/metrics`` shows it."""
    with urllib.request.urlopen(f"{base.removesuffix('/v1')}/metrics", timeout=10) as scraped:  # noqa: S310
        lines = scraped.read().decode().splitlines()
    return sum(float(line.split()[-1]) for line in lines if line.startswith(name))


def test_one_connection_of_many_users_is_handed_to_each_users_chat_process(upstream: str, tmp_path: Path) -> None:
    """One kept-alive connection carries chats of users of both chat processes, as an app's pooled connection
    does, with a large body, a compressed one and a streamed answer among them: each chat is served by its
    user's own chat process, which the connection is handed to (``chat_handoff``) rather than each request
    relayed, and the client never opens another connection. The app authenticates with a client key
    (``[[clients]]``), which the owner checks again: the handler's copy of the request lacks it."""
    config = tmp_path / "memproxy.toml"
    config.write_text(f'[[clients]]\nnamespace = "appA"\nkey_sha256 = "{key_hash("ck-pool")}"\n')
    env = _env(upstream, tmp_path / "data", MEMPROXY_SERVER__MAX_BODY_BYTES=str(4 * 2**20),
               MEMPROXY_CONFIG=str(config), MEMPROXY_UPSTREAM__API_KEY="sk-upstream")  # fmt: skip
    with memproxy_process(env) as (proc, base):
        users = [f"pool-{i}" for i in range(12)]
        assert {owner_of(f"appA:{user}", 2) for user in users} == {0, 1}
        opened: list[object] = []
        trace = aiohttp.TraceConfig()

        async def on_open(*_: object) -> None:
            opened.append(object())

        trace.on_connection_create_end.append(on_open)
        answers: dict[str, str] = {}

        async def chats() -> None:
            connector = aiohttp.TCPConnector(limit=1)
            async with aiohttp.ClientSession(connector=connector, trace_configs=[trace]) as session:
                for round_ in range(2):
                    for i, user in enumerate(users):
                        text = f"my note {round_} {i} " + ("lots " * 60_000 if i == 3 else "")
                        body = {"model": "fake-echo", "messages": [{"role": "user", "content": text}]}
                        stream = i == 5
                        if stream:
                            body["stream"] = True
                        headers = {"Authorization": "Bearer ck-pool", "X-Memory-User": user,
                                   "X-Request-Id": f"{user}-{round_}"}  # fmt: skip
                        data = orjson.dumps(body)
                        if i == 7:
                            data, headers["Content-Encoding"] = gzip.compress(data), "gzip"
                        headers["Content-Type"] = "application/json"
                        async with session.post(f"{base}/chat/completions", data=data, headers=headers) as response:
                            got = await response.read()
                            assert response.status == 200, got[:300]
                            answers[f"{user}-{round_}"] = got.decode()

        asyncio.run(chats())
        assert len(opened) == 1  # one connection, handed from process to process
        whole = {k: "data: [DONE]" in v if k.startswith("pool-5-") else "my note" in v for k, v in answers.items()}
        assert all(whole.values()), whole
        _eventually(lambda: len(_served_by(proc.lines)) >= 2 * len(users), timeout=10)
        served = _served_by(proc.lines)
        for user in users:
            for round_ in range(2):
                assert served[f"{user}-{round_}"] == f"chat-{owner_of(f'appA:{user}', 2)}"
        assert _scraped(base, "memproxy_routing_handed_off_total") >= 2
        assert _scraped(base, "memproxy_routing_relayed_total") == 0


def test_a_handed_request_reaches_the_owner_as_read_here() -> None:
    """The request the owner's parser reads (``request_bytes``): its line and headers as the client sent them,
    but the body's framing (it comes as read: decompressed, whole, with its length) and a 100-continue already
    answered."""
    headers = CIMultiDict(
        [("Host", "memproxy.local"), ("Transfer-Encoding", "chunked"), ("Content-Encoding", "gzip"),
         ("Expect", "100-continue"), ("X-Memory-User", "ana"), ("X-Memory-User", "twice")]
    )  # fmt: skip
    request = make_mocked_request("POST", "/v1/chat/completions?x=1", headers=headers)
    assert request_bytes(request, b'{"a": 1}') == (
        b"POST /v1/chat/completions?x=1 HTTP/1.1\r\nHost: memproxy.local\r\nX-Memory-User: ana\r\n"
        b'X-Memory-User: twice\r\nContent-Length: 8\r\n\r\n{"a": 1}'
    )


def _served_by(lines: list[str]) -> dict[str, str]:
    """Request id -> the chat process that logged it as completed."""
    out = {}
    for line in lines:
        if '"request.completed"' in line:
            record = orjson.loads(line)
            out[record["request_id"]] = record["process"]
    return out


def test_a_request_whose_chat_process_is_not_there_is_served_where_it_arrived(tmp_path: Path) -> None:
    """Nothing listens on the owner's socket (it is restarting): ``relay`` says so (None) and the request is
    served by the process it reached; the routing header from a client (not the private socket) is ignored."""
    router = ChatRouter(tmp_path, index=0, processes=2)
    told: list[str] = []
    router.observe = told.append
    user = next(f"u{i}" for i in range(100) if owner_of(f"u{i}", 2) == 1)
    request = make_mocked_request("POST", "/v1/chat/completions", headers={ROUTED_HEADER: "1"})
    assert router.owner(request, user) == 1  # a client's header does not stop the routing
    assert router.owner(request, None) is None

    async def relay() -> web.StreamResponse | None:
        try:
            return await router.relay(request, b"{}", 1)
        finally:
            await router.aclose()

    assert asyncio.run(relay()) is None
    assert told == ["owner_unreachable"]


def test_a_relay_passes_the_owners_answer_as_sent_and_reaches_a_restarted_owner(tmp_path: Path) -> None:
    """The owner's answer comes back as it was sent (its ``Content-Length``, compressed bytes untouched), to a
    request that carries no header aiohttp would add, nor the Content-Encoding of a body aiohttp decoded; after
    the owner's process is gone and another listens on its socket, the next relay reaches the new one."""
    router = ChatRouter(tmp_path, index=0, processes=2)
    told: list[str] = []
    router.observe = told.append
    connections: list[str] = []
    gzipped = b"\x1f\x8b\x08\x00not-really-gzip"

    async def owner_app(name: str) -> web.AppRunner:
        async def answer(request: web.Request) -> web.Response:
            assert request.headers[ROUTED_HEADER] == "0"
            assert request.headers["Authorization"] == "Bearer ck-sent"  # as the client sent it (checked again)
            assert "Accept-Encoding" not in request.headers  # the client sent none; the relay adds none
            assert "Content-Encoding" not in request.headers  # the body is passed on as aiohttp decoded it
            body = await request.read()
            if body == b"gzip":
                return web.Response(body=gzipped, headers={"Content-Encoding": "gzip"})
            return web.Response(body=name.encode() + b":" + body, content_type="application/json")

        def seen(protocol: Any) -> None:
            connections.append(name)

        app = web.Application()
        app.router.add_post("/v1/chat/completions", answer)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.UnixSite(runner, str(tmp_path / "chat-1.sock"))
        await site.start()
        server = runner.server
        assert server is not None
        original = server.connection_made
        server.connection_made = lambda handler, transport: (seen(handler), original(handler, transport))[1]  # type: ignore[method-assign]
        return runner

    async def through(payload: bytes) -> tuple[bytes, dict[str, str]]:
        headers = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
        original = make_mocked_request(
            "POST", "/v1/chat/completions", headers={**headers, "Authorization": "Bearer ck-sent"}
        )
        request = original.clone(headers=CIMultiDict(headers))  # the handlers' copy, without the key
        request[AS_SENT] = original
        sent: list[bytes] = []

        async def write(data: bytes) -> None:
            sent.append(bytes(data))

        request._payload_writer.write = write  # type: ignore[attr-defined]
        response = await router.relay(request, payload, 1)
        assert response is not None
        return b"".join(sent), dict(response.headers)

    async def scenario() -> None:
        first = await owner_app("first")
        try:
            body_a, headers_a = await through(b"a")
            body_b, _ = await through(b"b")
            assert (body_a, body_b) == (b"first:a", b"first:b")
            assert headers_a["Content-Length"] == str(len(b"first:a"))
            assert "Transfer-Encoding" not in headers_a
            body_z, headers_z = await through(b"gzip")
            assert body_z == gzipped
            assert headers_z["Content-Encoding"] == "gzip"
            assert connections == ["first"] * 3  # a connection each (none kept to a process that may die)
        finally:
            await first.cleanup()  # the owner's process gone: its connections closed
        second = await owner_app("second")
        try:
            body_c, _ = await through(b"c")
            assert body_c == b"second:c"
            assert told == ["relayed"] * 4
        finally:
            await router.aclose()
            await second.cleanup()

    asyncio.run(scenario())
