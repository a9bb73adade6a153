"""Bounded work per request: deep JSON, duplicate identity headers, slow bodies, huge turns, secrets in logs."""

from __future__ import annotations

import asyncio
import io
import socket
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp import ClientSession
from hypothesis import given
from hypothesis import strategies as st
from multidict import CIMultiDict

from proxy.bounds import json_depth
from proxy.memory.text_cap import cap_text
from tests.conftest import ProxyFactory
from tests.fake_upstream import FakeUpstream
from tests.support.processes import fake_upstream_process, memproxy_process
from tests.test_proxy import RecordingMemory, _factory

CHAT = "/v1/chat/completions"


def _nested(depth: int) -> Any:
    value: Any = "deep"
    for i in range(depth):
        value = [value] if i % 2 else {"k": value}
    return value


def _nested_json(depth: int) -> str:
    """JSON text nested ``depth`` deep, arrays and objects alternating (orjson itself stops near 255)."""
    opening = "".join('{"k":' if i % 2 else "[" for i in range(depth))
    closing = "".join("}" if i % 2 else "]" for i in reversed(range(depth)))
    return f'{opening}"deep"{closing}'


@pytest.mark.parametrize("where", ["content", "tools"])
async def test_depth_1000_json_is_400_before_the_upstream(
    make_proxy: ProxyFactory, fake: FakeUpstream, where: str
) -> None:
    """JSON nested 1000 deep in a message or in tools is a 400 naming the limit; the upstream never sees it."""
    proxy = await make_proxy()
    deep = _nested_json(1000)
    if where == "content":
        raw = '{"model":"fake-echo","messages":[{"role":"user","content":[{"type":"text","text":"hi","x":%s}]}]}'
    else:
        raw = (
            '{"model":"fake-echo","messages":[{"role":"user","content":"hi"}],'
            '"tools":[{"type":"function","function":{"name":"f","parameters":%s}}]}'
        )
    response = await proxy.post(
        CHAT, data=(raw % deep).encode(), headers={"Content-Type": "application/json", "X-Memory-User": "alice"}
    )
    assert response.status == 400
    error = (await response.json())["error"]
    assert error["code"] == "json_too_deep"
    assert "limit is 64" in error["message"]
    assert fake.requests == []


async def test_ordinary_nesting_passes(make_proxy: ProxyFactory) -> None:
    """A tool schema nested a dozen levels deep, with brackets inside strings, is served normally."""
    proxy = await make_proxy()
    body = {
        "model": "fake-echo",
        "messages": [{"role": "user", "content": '[[[{{{ not json " ]]]'}],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": _nested(12)}}],
    }
    response = await proxy.post(CHAT, json=body)
    assert response.status == 200


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-1000, 1000) | st.text(alphabet='[]{}"\\ab', max_size=6),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(alphabet='[]{}"\\', max_size=3), children, max_size=3)
    ),
    max_leaves=30,
)


def _true_depth(value: Any) -> int:
    if isinstance(value, list):
        return 1 + max((_true_depth(v) for v in value), default=0)
    if isinstance(value, dict):
        return 1 + max((_true_depth(v) for v in value.values()), default=0)
    return 0


@given(json_values)
def test_json_depth_matches_the_parsed_structure(value: Any) -> None:
    """The byte scan finds the same depth as the parsed value, whatever brackets and escapes the strings hold."""
    assert json_depth(orjson.dumps(value)) == _true_depth(value)


@pytest.mark.parametrize("header", ["X-Memory-User", "X-Memory-Conversation", "X-Memory-Mode"])
async def test_duplicate_identity_headers_are_400(make_proxy: ProxyFactory, fake: FakeUpstream, header: str) -> None:
    """Two copies of an identity header are a 400 (not "the first one wins"), and nothing is forwarded."""
    proxy = await make_proxy()
    values = {
        "X-Memory-User": ("alice", "bob"),
        "X-Memory-Conversation": ("c1", "c2"),
        "X-Memory-Mode": ("full", "off"),
    }[header]
    headers = CIMultiDict(
        [("X-Memory-User", "alice"), (header, values[0]), (header, values[1])]
        if header != "X-Memory-User"
        else [(header, values[0]), (header, values[1])]
    )
    response = await proxy.post(
        CHAT, json={"model": "fake-echo", "messages": [{"role": "user", "content": "hi"}]}, headers=headers
    )
    assert response.status == 400
    error = (await response.json())["error"]
    assert (error["code"], error["param"]) == ("duplicate_header", header)
    assert fake.requests == []


async def test_one_byte_per_second_body_is_cut_off(make_proxy: ProxyFactory, fake: FakeUpstream) -> None:
    """A body trickling in at 1 byte/s gets a 408 once server.body_timeout_s is over, and the connection closes."""
    proxy = await make_proxy(server={"body_timeout_s": 1.5})
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: 500\r\n\r\n"
    )
    started = time.monotonic()

    async def trickle() -> None:
        for byte in b'{"model": "fake-echo", "messages": []}' * 20:
            writer.write(bytes([byte]))
            await writer.drain()
            await asyncio.sleep(1.0)

    sender = asyncio.create_task(trickle())
    try:
        status_line = await asyncio.wait_for(reader.readline(), timeout=10)
        answered_after = time.monotonic() - started
        rest = await asyncio.wait_for(reader.read(), timeout=15)  # returns at EOF: the server closed
    finally:
        sender.cancel()
        writer.close()
    assert status_line.startswith(b"HTTP/1.1 408")
    assert b"request_timeout" in rest
    assert 1.4 < answered_after < 4.0
    assert fake.requests == []


async def test_long_turn_is_stored_truncated_with_a_marker(make_proxy: ProxyFactory) -> None:
    """A 200k-character message reaches the upstream whole but is stored as head + marker + tail, capped."""
    memory = RecordingMemory()
    proxy = await make_proxy(memory_factory=_factory(memory), memory={"max_turn_chars": 2000})
    text = "START " + "filler words " * 16_000 + " what is the capital of Peru?"
    response = await proxy.post(
        CHAT,
        json={"model": "fake-echo", "messages": [{"role": "user", "content": text}]},
        headers={"X-Memory-User": "alice"},
    )
    assert response.status == 200
    assert len((await response.json())["choices"][0]["message"]["content"]) > len(text)
    stored = memory.exchanges[-1].user_messages[0]
    assert len(stored) == 2000
    assert stored.startswith("START filler")
    assert stored.endswith("what is the capital of Peru?")
    assert f"[... {len(text) - 2000:,} characters not stored ...]" in stored
    assert len(memory.exchanges[-1].assistant_text) == 2000


def test_cap_text_is_idempotent_and_exact() -> None:
    """Capping keeps short texts as they are and makes long ones exactly the cap, however often applied."""
    assert cap_text("short", 10) == "short"
    once = cap_text("x" * 10_000, 500)
    assert len(once) == 500
    assert cap_text(once, 500) == once


@pytest.mark.e2e
def test_malformed_request_is_a_json_400_that_echoes_and_logs_no_secret(tmp_path: Any) -> None:
    """Requests aiohttp rejects before the app (malformed header lines, a request line over 8 KiB) get an
    OpenAI-style JSON 400 that does not echo the bytes; the key in them is in neither the answer nor the log."""
    canary = "sk-canary-9f8e7d6c5b4a"
    env = {
        "MEMPROXY_MEMORY__ENABLED": "false",
        "MEMPROXY_STORAGE__PATH": str(tmp_path),
        "MEMPROXY_UPSTREAM__BASE_URL": "http://127.0.0.1:9/v1",
    }
    with memproxy_process(env) as (proc, url):
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        for raw in (
            f"GET /healthz HTTP/1.1\r\nAuthorization: Bearer {canary}\x01\r\n\r\n",
            f"POST /v1/chat/completions HTTP/1.1\r\nAuthorization: Bearer {canary}\rX: y\r\n\r\n",
            f"GET /healthz HTTP/1.1\r\nAuthorization : Basic {canary}\r\n\r\n",
            f"GET /healthz HTTP/1.1\r\nX: a\r\n  Authorization: Bearer {canary}\r\n\r\n",
            f"GET /v1/memory/users/u/insights?k={canary}{'x' * 9000} HTTP/1.1\r\nHost: a\r\n\r\n",
        ):
            with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                sock.sendall(raw.encode("latin-1"))
                answer = b""
                while chunk := sock.recv(65536):
                    answer += chunk
            head, _, body = answer.partition(b"\r\n\r\n")
            assert b" 400 " in head.split(b"\r\n")[0]
            assert b"application/json" in head
            error = orjson.loads(body)["error"]
            assert error["type"] == "invalid_request_error"
            assert error["code"] == "malformed_request"
            assert canary.encode() not in answer
        proc.wait_for("http.malformed_request")
        output = proc.output
    assert canary not in output


def _rss_mb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) // 1024
    raise AssertionError("no VmRSS")


async def _post_big(url: str, text: str) -> int:
    body = {"model": "fake-echo", "messages": [{"role": "user", "content": text}]}
    headers = {"X-Memory-User": "big", "Content-Type": "application/json"}
    async with (
        ClientSession() as session,
        session.post(f"{url}/chat/completions", data=io.BytesIO(orjson.dumps(body)), headers=headers) as response,
    ):
        await response.read()
        return response.status


async def _peak_rss_while(pid: int, work: Any) -> int:
    task = asyncio.ensure_future(work)
    peak = _rss_mb(pid)
    while not task.done():
        peak = max(peak, _rss_mb(pid))
        await asyncio.sleep(0.02)
    await task
    return peak


@pytest.mark.e2e
@pytest.mark.slow
async def test_two_8mb_messages_keep_rss_bounded(tmp_path: Path) -> None:
    """Two concurrent 7.9 MB messages (with the real model and store) raise memproxy's RSS by under 300 MB."""
    big = ("lorem ipsum dolor sit amet " * 400_000)[: int(7.9 * 2**20)]
    with fake_upstream_process() as (_, upstream):
        env = {
            "MEMPROXY_UPSTREAM__BASE_URL": upstream,
            "MEMPROXY_UPSTREAM__API_KEY": "sk-upstream",  # the test's client sends none
            "MEMPROXY_STORAGE__PATH": str(tmp_path),
            "MEMPROXY_MEMORY__RETRIEVAL_TIMEOUT_MS": "20000",
        }
        with memproxy_process(env) as (proc, url):
            pid = proc.popen.pid
            for i in range(3):  # warm up: model, tables and caches loaded
                assert await _post_big(url, f"warm up {i}: I like green tea") == 200
            await asyncio.sleep(2)
            base = _rss_mb(pid)
            statuses = asyncio.gather(_post_big(url, big + "a"), _post_big(url, big + "b"))
            peak = await _peak_rss_while(pid, statuses)
            assert (await statuses) == [200, 200]
            for _ in range(50):  # and while the write path stores the two capped turns
                peak = max(peak, _rss_mb(pid))
                await asyncio.sleep(0.1)
    assert peak - base < 300, f"RSS {base} MB -> peak {peak} MB"
