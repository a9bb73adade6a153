"""Bad bytes in headers and bodies are answered (4xx), never a 500, on every route; request heads have a deadline."""

from __future__ import annotations

import contextlib
import gzip
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.access import key_hash
from proxy.header_bytes import undecodable
from proxy.logs import escaped
from tests.support.live_app import admin_settings, live_app
from tests.support.processes import fake_upstream_process, memproxy_process

CLIENT_KEY, ADMIN = "client-key-0123456789abcdef", "admin-key-for-header-tests"
CHAT = b'{"model": "fake-echo", "messages": [{"role": "user", "content": "I like green tea."}]}'
CLIENT = (b"Authorization", b"Bearer " + CLIENT_KEY.encode())
ADMIN_AUTH = (b"Authorization", b"Bearer " + ADMIN.encode())
JSON = (b"Content-Type", b"application/json")
USER = "/v1/memory/users/fuzz-user"
# (method, path, headers, body): every route memproxy serves, with what a valid request to it carries.
ROUTES: list[tuple[str, str, list[tuple[bytes, bytes]], bytes]] = [
    ("POST", "/v1/chat/completions", [CLIENT, JSON, (b"X-Memory-User", b"fuzz-user")], CHAT),
    ("POST", "/chat/completions", [CLIENT, JSON], CHAT),
    ("OPTIONS", "/v1/chat/completions", [(b"Origin", b"http://app.example")], b""),
    ("GET", "/v1/models", [CLIENT], b""),
    ("GET", "/healthz", [], b""),
    ("GET", "/readyz", [], b""),
    ("GET", "/metrics", [], b""),
    ("GET", "/ui/", [], b""),
    ("GET", "/v1/memory/openapi.json", [ADMIN_AUTH], b""),
    ("GET", "/v1/memory/users", [ADMIN_AUTH], b""),
    ("POST", USER + "/memories", [ADMIN_AUTH, JSON], b'{"text": "likes green tea"}'),
    ("GET", USER + "/memories", [ADMIN_AUTH], b""),
    ("POST", USER + "/search", [ADMIN_AUTH, JSON], b'{"query": "tea"}'),
    ("GET", USER + "/export", [ADMIN_AUTH], b""),
    ("GET", USER + "/insights", [ADMIN_AUTH], b""),
    ("DELETE", USER, [ADMIN_AUTH], b""),
    ("POST", "/v1/responses", [CLIENT, JSON, (b"X-Memory-User", b"fuzz-user")], b'{"model": "m", "input": "hi"}'),
    (
        "POST",
        "/v1/messages",
        [(b"X-Api-Key", CLIENT_KEY.encode()), JSON, (b"Anthropic-Version", b"2023-06-01")],
        b'{"model": "c", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}',
    ),
    ("POST", "/v1/embeddings", [CLIENT, JSON], b'{"model": "e", "input": "hi"}'),
]
FUZZED_NAMES = ["Authorization", "X-Memory-User", "X-Memory-Conversation", "X-Memory-Mode", "X-Request-Id",
                "Origin", "Content-Type", "User-Agent", "Traceparent", "X-Anything", "Cookie", "X-Api-Key",
                "Anthropic-Version"]  # fmt: skip


def raw_request(method: str, path: str, headers: list[tuple[bytes, bytes]], body: bytes) -> bytes:
    """One HTTP/1.1 request as bytes (the connection closes after it)."""
    lines = [f"{method} {path} HTTP/1.1".encode(), b"Host: 127.0.0.1", b"Connection: close"]
    lines += [name + b": " + value for name, value in headers]
    lines.append(b"Content-Length: %d" % len(body))
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def exchange(port: int, data: bytes, timeout: float = 30.0) -> tuple[int, bytes]:
    """Send ``data``, read until the server closes; the status and the body."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(data)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """The real app with client keys, an admin key and memory on, served in a thread against the fake upstream."""
    with fake_upstream_process() as (_, upstream):
        app_settings = admin_settings(
            admin={"api_key": ADMIN},
            clients=[{"namespace": "app", "key_sha256": key_hash(CLIENT_KEY)}],
            upstream={
                "base_url": upstream,
                "anthropic_base_url": upstream.removesuffix("/v1"),
                "api_key": "sk-upstream",
            },
            server={"allowed_origins": ["http://app.example"]},
            storage={"path": str(tmp_path_factory.mktemp("header-bytes"))},
        )
        with live_app(app_settings) as url:
            yield int(url.rsplit(":", 1)[1])


def test_escaped_and_undecodable() -> None:
    """A value that is not UTF-8 is named, and shown with its bad bytes as ``\\xNN``."""
    assert undecodable(((b"X-A", b"ok"), (b"X-B", b"caf\xc3\xa9"), (b"X-C", b"a\xffb"))) == ["x-c"]
    assert escaped(b"a\xffb".decode("utf-8", "surrogateescape")) == "a\\xffb"
    assert escaped("lone \ud800") == "lone \\ud800"


@pytest.mark.slow
def test_no_header_bytes_give_a_5xx_on_any_route(served: int) -> None:
    """Any bytes in any header, on every route (chat, models, management, health, page): never a 5xx."""

    @settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(
        name=st.sampled_from(FUZZED_NAMES),
        value=st.binary(min_size=1, max_size=24).filter(lambda v: b"\r" not in v and b"\n" not in v),
    )
    def check(name: str, value: bytes) -> None:
        for method, path, headers, body in ROUTES:
            kept = [(n, v) for n, v in headers if n.lower() != name.lower().encode()]
            status, answer = exchange(served, raw_request(method, path, [*kept, (name.encode(), value)], body))
            assert status < 500, (method, path, name, value, answer[:300])

    check()


@pytest.mark.parametrize(("method", "path", "headers", "body"), ROUTES[:4] + ROUTES[9:11])
def test_bad_byte_in_a_read_header_is_a_400_naming_it(
    served: int, method: str, path: str, headers: list[tuple[bytes, bytes]], body: bytes
) -> None:
    """A non-UTF-8 ``Authorization`` (client key or admin key) is a 400 in OpenAI's shape naming the header."""
    bad = [(n, b"Bearer \xff\xfe") if n == b"Authorization" else (n, v) for n, v in headers]
    bad = bad if any(n == b"Authorization" for n, _ in headers) else [*bad, (b"Authorization", b"Bearer \xff")]
    status, answer = exchange(served, raw_request(method, path, bad, body))
    assert status == 400
    error = orjson.loads(answer)["error"]
    assert (error["code"], error["param"]) == ("invalid_header", "Authorization")


def test_bad_byte_in_an_unread_header_is_ignored(served: int) -> None:
    """With client keys, a non-UTF-8 header memproxy does not read leaves the chat and /v1/models answered."""
    for method, path, headers, body in (ROUTES[0], ROUTES[3]):
        status, _ = exchange(served, raw_request(method, path, [*headers, (b"X-Trace-Note", b"caf\xe9")], body))
        assert status == 200


@pytest.mark.parametrize("encoding", [b"gzip", b"deflate", b"br"])
def test_body_that_does_not_decompress_is_a_400(served: int, encoding: bytes) -> None:
    """A body whose Content-Encoding does not decode is a 400 ``malformed_request``; a real gzip body is served."""
    method, path, headers, _ = ROUTES[0]
    status, answer = exchange(served, raw_request(method, path, [*headers, (b"Content-Encoding", encoding)], CHAT))
    assert status == 400
    assert orjson.loads(answer)["error"]["code"] == "malformed_request"
    good = [*headers, (b"Content-Encoding", b"gzip")]
    assert exchange(served, raw_request(method, path, good, gzip.compress(CHAT)))[0] == 200


@pytest.mark.e2e
def test_bad_bytes_log_json_lines_only_and_keep_the_request_line(tmp_path: Path) -> None:
    """Against ``memproxy serve``: a bad gzip body, bad header bytes and a non-UTF-8 ``X-Request-Id`` leave only
    JSON lines in the log (no plain-text traceback), and the chat with the bad id keeps its ``request.completed``."""
    config = tmp_path / "memproxy.toml"
    config.write_text(f'[[clients]]\nnamespace = "app"\nkey_sha256 = "{key_hash(CLIENT_KEY)}"\n')
    with fake_upstream_process() as (_, upstream):
        env = {"MEMPROXY_STORAGE__PATH": str(tmp_path / "data"), "MEMPROXY_UPSTREAM__BASE_URL": upstream,
               "MEMPROXY_UPSTREAM__API_KEY": "sk-upstream", "MEMPROXY_ADMIN__API_KEY": ADMIN}  # fmt: skip
        with memproxy_process(env, ["--config", str(config)]) as (proc, url):
            port = int(url.rsplit(":", 1)[1].split("/")[0])
            method, path, headers, _ = ROUTES[0]
            for extra, body in (((b"Content-Encoding", b"gzip"), CHAT), ((b"Content-Encoding", b"deflate"), b"x")):
                assert exchange(port, raw_request(method, path, [*headers, extra], body))[0] == 400
            assert exchange(port, raw_request("GET", "/v1/memory/users", [(b"Authorization", b"\xff")], b""))[0] == 400
            status, _ = exchange(port, raw_request(method, path, [*headers, (b"X-Request-Id", b"req-\xff-1")], CHAT))
            assert status == 200
            line = proc.wait_for(r'"event":"request.completed".*req-\\\\xff-1').string
            proc.wait_for("request.completed")
            lines = proc.lines
    assert json.loads(line)["request_id"] == "req-\\xff-1"
    for text in lines:
        assert isinstance(json.loads(text), dict), text  # every line a JSON object: no plain-text traceback


def _slow_head(port: int, first: bytes, step_s: float, steps: int) -> tuple[bytes, float]:
    """Send ``first``, then a header one byte every ``step_s``; what the server answered and after how long."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(first)
        started = time.monotonic()
        with contextlib.suppress(OSError):  # the server closes the connection meanwhile
            for byte in b"X-Slow: " + b"a" * steps:
                sock.sendall(bytes([byte]))
                time.sleep(step_s)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
        return answer, time.monotonic() - started


@pytest.mark.e2e
def test_trickled_request_head_is_cut_off(tmp_path: Path) -> None:
    """A head sent a byte at a time gets a 408 after ``server.head_timeout_s`` and the connection closes, also as
    the second request of a kept-alive connection; a connection idle between requests is not cut."""
    env = {"MEMPROXY_STORAGE__PATH": str(tmp_path), "MEMPROXY_MEMORY__ENABLED": "false",
           "MEMPROXY_UPSTREAM__BASE_URL": "http://127.0.0.1:9/v1",
           "MEMPROXY_SERVER__HEAD_TIMEOUT_S": "1.5"}  # fmt: skip
    with memproxy_process(env) as (proc, url):
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        answer, after = _slow_head(port, b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n", 0.2, 60)
        assert answer.startswith(b"HTTP/1.1 408")
        assert orjson.loads(answer.partition(b"\r\n\r\n")[2])["error"]["code"] == "request_timeout"
        assert 1.3 < after < 6.0
        kept_alive = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
            sock.sendall(kept_alive)
            assert sock.recv(65536).startswith(b"HTTP/1.1 200")
            time.sleep(2.5)  # idle longer than the head timeout: kept open
            sock.sendall(kept_alive)
            assert sock.recv(65536).startswith(b"HTTP/1.1 200")
            sock.sendall(b"GET /healthz HTTP/1.1\r\n")  # a second head, trickled, that never ends
            with contextlib.suppress(OSError):  # the server closes the connection meanwhile
                for byte in b"X-Slow: abc":
                    sock.sendall(bytes([byte]))
                    time.sleep(0.3)
            assert b"HTTP/1.1 408" in sock.recv(65536)
        proc.wait_for("http.head_timeout")
