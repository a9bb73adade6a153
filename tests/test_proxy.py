"""The proxy shell against the fake upstream: faithful forwarding, streaming, errors, headers, metrics."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
from aiohttp import ClientSession

from proxy.config import Settings
from proxy.memory.read.placement import BlockPlan
from proxy.memory.service import Exchange, Injection, MemoryService, NullMemory, ReadRequest
from proxy.metrics import Metrics
from tests.conftest import ProxyFactory
from tests.fake_upstream import APP_KEY, FakeUpstream

CHAT = "/v1/chat/completions"


def _body(**extra: Any) -> dict[str, Any]:
    return {"model": "fake-echo", "messages": [{"role": "user", "content": "hello there"}], **extra}


async def test_non_stream_forwards_every_field_unchanged(make_proxy: ProxyFactory, fake: FakeUpstream) -> None:
    """Unknown and advanced fields reach the upstream exactly as the client sent them."""
    proxy = await make_proxy()
    body = _body(
        tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
        tool_choice="auto",
        response_format={"type": "text"},
        n=1,
        logprobs=False,
        seed=7,
        stream_options=None,
        x_vendor_field={"a": [1, 2.5, None]},
        temperature=0.25,
    )
    raw = orjson.dumps(body)
    response = await proxy.post(CHAT, data=raw, headers={"Content-Type": "application/json"})
    assert response.status == 200
    assert (await response.json())["choices"][0]["message"]["content"] == "echo: hello there"
    assert fake.requests[-1]["json"] == body


async def test_stream_relays_every_event(make_proxy: ProxyFactory) -> None:
    """A streamed answer arrives as the same SSE events, ending in [DONE]."""
    proxy = await make_proxy()
    response = await proxy.post(CHAT, json=_body(stream=True, messages=[{"role": "user", "content": "a b c"}]))
    assert response.status == 200
    assert response.headers["Content-Type"].startswith("text/event-stream")
    text = (await response.read()).decode()
    events = [e for e in text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    contents = [orjson.loads(e[6:])["choices"][0]["delta"].get("content", "") for e in events[:-1]]
    assert "".join(contents) == "echo: a b c"


async def test_request_id_is_memproxys_and_the_upstreams_is_relayed_apart(make_proxy: ProxyFactory) -> None:
    """One ``X-Request-Id`` on the answer, the client's (the id in memproxy's log lines); the upstream's id for
    the same exchange comes as ``X-Upstream-Request-Id``."""
    proxy = await make_proxy()
    response = await proxy.post(CHAT, json=_body(stream=True), headers={"X-Request-Id": "client-7"})
    await response.read()
    assert response.headers.getall("X-Request-Id") == ["client-7"]
    assert response.headers["X-Upstream-Request-Id"] == "fake-req"


async def test_stream_is_not_buffered(make_proxy: ProxyFactory) -> None:
    """The first chunk of a slow stream reaches the client long before the stream ends."""
    proxy = await make_proxy()
    loop = asyncio.get_running_loop()
    started = loop.time()
    async with proxy.post(CHAT, json=_body(model="fake-drip", stream=True)) as response:
        first = await response.content.readany()
        first_at = loop.time() - started
    assert first.startswith(b"data: ")
    assert first_at < 1.0  # the whole drip takes 10 s


@pytest.mark.parametrize("status", [400, 401, 404, 429, 500, 503])
async def test_upstream_errors_are_relayed(make_proxy: ProxyFactory, status: int) -> None:
    """An upstream error keeps its status and OpenAI error body."""
    proxy = await make_proxy()
    response = await proxy.post(CHAT, json=_body(model=f"fake-error-{status}"))
    assert response.status == status
    assert (await response.json())["error"]["code"] == f"fake_{status}"


async def test_unreachable_upstream_is_502(make_proxy: ProxyFactory) -> None:
    """A refused connection becomes a 502 in OpenAI error format."""
    proxy = await make_proxy(upstream={"base_url": "http://127.0.0.1:9/v1"})
    response = await proxy.post(CHAT, json=_body())
    assert response.status == 502
    assert (await response.json())["error"]["code"] == "upstream_unreachable"


async def test_upstream_timeout_is_504(make_proxy: ProxyFactory, fake: FakeUpstream) -> None:
    """An upstream slower than the configured timeout becomes a 504."""
    proxy = await make_proxy(upstream={"timeout_s": 0.2})
    response = await proxy.post(CHAT, json=_body(model="fake-slow"))
    assert response.status == 504
    assert (await response.json())["error"]["type"] == "upstream_error"


@pytest.mark.parametrize(
    ("payload", "param"),
    [
        (b"{not json", None),
        (b"[1, 2]", None),
        (orjson.dumps({"messages": [{"role": "user", "content": "x"}]}), "model"),
        (orjson.dumps({"model": 5, "messages": [{"role": "user", "content": "x"}]}), "model"),
        (orjson.dumps({"model": "m"}), "messages"),
        (orjson.dumps({"model": "m", "messages": "hi"}), "messages"),
        (orjson.dumps({"model": "m", "messages": [{"content": "x"}]}), "messages[0]"),
    ],
)
async def test_malformed_requests_are_400(
    make_proxy: ProxyFactory, fake: FakeUpstream, payload: bytes, param: str | None
) -> None:
    """Malformed bodies get a 400 naming the field, and never reach the upstream."""
    proxy = await make_proxy()
    response = await proxy.post(CHAT, data=payload, headers={"Content-Type": "application/json"})
    assert response.status == 400
    error = (await response.json())["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert fake.requests == []


async def test_oversized_body_is_413(make_proxy: ProxyFactory) -> None:
    """A body over server.max_body_bytes is refused with 413."""
    proxy = await make_proxy(server={"max_body_bytes": 1000})
    response = await proxy.post(CHAT, json=_body(messages=[{"role": "user", "content": "x" * 5000}]))
    assert response.status == 413
    assert (await response.json())["error"]["code"] == "request_too_large"


async def test_midstream_failure_ends_with_error_event(make_proxy: ProxyFactory) -> None:
    """When the upstream dies mid-stream the client gets the chunks so far, then an error event."""
    proxy = await make_proxy()
    response = await proxy.post(
        CHAT,
        json=_body(model="fake-midstream-fail", stream=True, messages=[{"role": "user", "content": "one two three"}]),
    )
    assert response.status == 200
    events = [e for e in (await response.read()).decode().split("\n\n") if e]
    last = orjson.loads(events[-1][6:])
    assert last["error"]["type"] == "upstream_error"
    assert len(events) >= 2


async def test_client_disconnect_cancels_upstream(make_proxy: ProxyFactory, fake: FakeUpstream) -> None:
    """Closing the client mid-stream closes the upstream request promptly."""
    proxy = await make_proxy()
    async with ClientSession() as session:
        url = str(proxy.make_url(CHAT))
        response = await session.post(
            url, json=_body(model="fake-drip", stream=True), headers={"Authorization": f"Bearer {APP_KEY}"}
        )
        await response.content.readany()
        response.close()
    await asyncio.wait_for(fake.disconnected.wait(), timeout=2.0)
    assert fake.disconnects == 1


async def test_configured_key_replaces_client_key(make_proxy: ProxyFactory, fake: FakeUpstream) -> None:
    """With upstream.api_key set, the upstream sees that key and never the client's."""
    proxy = await make_proxy(upstream={"api_key": "sk-configured-0000"})
    await proxy.post(CHAT, json=_body(), headers={"Authorization": "Bearer sk-client-1111"})
    assert fake.requests[-1]["headers"]["Authorization"] == "Bearer sk-configured-0000"


async def test_client_key_passes_through_without_configured_key(make_proxy: ProxyFactory, fake: FakeUpstream) -> None:
    """With no configured key, the client's Authorization header is forwarded."""
    proxy = await make_proxy()
    await proxy.post(CHAT, json=_body(), headers={"Authorization": "Bearer sk-client-1111", "X-Memory-User": "alice"})
    headers = fake.requests[-1]["headers"]
    assert headers["Authorization"] == "Bearer sk-client-1111"
    assert not any(name.lower().startswith("x-memory") for name in headers)


async def test_request_cannot_choose_upstream(make_proxy: ProxyFactory, fake: FakeUpstream) -> None:
    """An ``api_base`` in the body does not redirect the request; it reaches the configured upstream."""
    proxy = await make_proxy()
    response = await proxy.post(CHAT, json=_body(api_base="http://127.0.0.1:9/v1"))
    assert response.status == 200
    assert len(fake.requests) == 1


async def test_memory_headers_without_user(make_proxy: ProxyFactory) -> None:
    """A request with no user is a pure passthrough and says so."""
    proxy = await make_proxy()
    response = await proxy.post(CHAT, json=_body())
    assert response.headers["X-Memory-Mode"] == "off"
    assert response.headers["X-Memory-Injected"] == "0"


async def test_invalid_mode_is_400(make_proxy: ProxyFactory) -> None:
    """An unknown X-Memory-Mode is refused with a message naming the header."""
    proxy = await make_proxy()
    response = await proxy.post(CHAT, json=_body(), headers={"X-Memory-Mode": "sometimes"})
    assert response.status == 400
    assert (await response.json())["error"]["param"] == "X-Memory-Mode"


async def test_hostile_user_id_is_400(make_proxy: ProxyFactory, fake: FakeUpstream) -> None:
    """A user id with quotes or spaces is refused before anything touches memory or the upstream."""
    proxy = await make_proxy()
    response = await proxy.post(CHAT, json=_body(user="x' OR '1'='1"))
    assert response.status == 400
    assert (await response.json())["error"]["param"] == "user"
    assert fake.requests == []


class RecordingMemory(NullMemory):
    """A memory seam that injects one system message and records exchanges (tests the shell only); the rest of
    the protocol is ``NullMemory``'s."""

    ready = True

    def __init__(self) -> None:
        self.exchanges: list[Exchange] = []
        self.fail_inject = False

    async def inject(self, request: ReadRequest) -> Injection:
        if self.fail_inject:
            raise RuntimeError("store is down")
        plan = BlockPlan(system=f"memory for {request.user_id}")
        return Injection(plan=plan, injected_ids=("m1", "m2"), arms=("dense", "bm25"), retrieval_ms=1.5)

    def carried(self, request: ReadRequest) -> Injection:
        return Injection()

    async def record(self, exchange: Exchange) -> None:
        self.exchanges.append(exchange)


def _factory(memory: RecordingMemory) -> Any:
    @contextlib.asynccontextmanager
    async def factory(settings: Settings, metrics: Metrics) -> AsyncIterator[MemoryService]:
        yield memory

    return factory


async def test_memory_seam_injects_and_records(make_proxy: ProxyFactory, fake: FakeUpstream) -> None:
    """Injected messages reach the upstream; the finished exchange reaches the write path."""
    memory = RecordingMemory()
    proxy = await make_proxy(memory_factory=_factory(memory))
    response = await proxy.post(CHAT, json=_body(), headers={"X-Memory-User": "alice"})
    assert response.headers["X-Memory-Injected"] == "2"
    assert response.headers["X-Memory-Ids"] == "m1,m2"
    assert response.headers["X-Memory-Arms"] == "dense,bm25"
    assert fake.requests[-1]["json"]["messages"][0] == {"role": "system", "content": "memory for alice"}
    assert memory.exchanges[-1].user_messages == ("hello there",)
    assert memory.exchanges[-1].assistant_text == "echo: hello there"


async def test_exchange_carries_the_turns_before_it(make_proxy: ProxyFactory) -> None:
    """The write path gets the user and assistant messages just before the new ones (never the system prompt)."""
    memory = RecordingMemory()
    proxy = await make_proxy(memory_factory=_factory(memory))
    messages = [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "Any tips for Kyoto?"},
        {"role": "assistant", "content": "Visit Fushimi Inari early."},
        {"role": "user", "content": "Which day is quietest?"},
        {"role": "user", "content": [{"type": "text", "text": "And the cheapest?"}]},
    ]
    response = await proxy.post(CHAT, json={"model": "m", "messages": messages}, headers={"X-Memory-User": "al"})
    assert response.status == 200
    exchange = memory.exchanges[-1]
    assert exchange.user_messages == ("Which day is quietest?", "And the cheapest?")
    assert exchange.context == (("user", "Any tips for Kyoto?"), ("assistant", "Visit Fushimi Inari early."))


async def test_stream_exchange_is_assembled(make_proxy: ProxyFactory) -> None:
    """The write path receives the full reply of a streamed answer, not marked partial."""
    memory = RecordingMemory()
    proxy = await make_proxy(memory_factory=_factory(memory))
    response = await proxy.post(CHAT, json=_body(stream=True, user="bob"))
    await response.read()
    assert memory.exchanges[-1].assistant_text == "echo: hello there"
    assert memory.exchanges[-1].partial is False


async def test_mode_off_neither_reads_nor_writes(make_proxy: ProxyFactory, fake: FakeUpstream) -> None:
    """X-Memory-Mode: off sends the request untouched and stores nothing."""
    memory = RecordingMemory()
    proxy = await make_proxy(memory_factory=_factory(memory))
    response = await proxy.post(CHAT, json=_body(), headers={"X-Memory-User": "alice", "X-Memory-Mode": "off"})
    assert response.headers["X-Memory-Mode"] == "off"
    assert fake.requests[-1]["json"] == _body()
    assert memory.exchanges == []


async def test_read_mode_does_not_write(make_proxy: ProxyFactory) -> None:
    """X-Memory-Mode: read injects but stores nothing."""
    memory = RecordingMemory()
    proxy = await make_proxy(memory_factory=_factory(memory))
    response = await proxy.post(CHAT, json=_body(), headers={"X-Memory-User": "a", "X-Memory-Mode": "read"})
    assert response.headers["X-Memory-Injected"] == "2"
    assert memory.exchanges == []


async def test_failing_memory_degrades_not_fails(make_proxy: ProxyFactory, fake: FakeUpstream) -> None:
    """If retrieval raises, the chat is served without memory and the headers say degraded."""
    memory = RecordingMemory()
    memory.fail_inject = True
    proxy = await make_proxy(memory_factory=_factory(memory))
    response = await proxy.post(CHAT, json=_body(), headers={"X-Memory-User": "alice"})
    assert response.status == 200
    assert "degraded=memory:RuntimeError" in response.headers["X-Memory-Arms"]
    assert fake.requests[-1]["json"] == _body()


class SlowMemory(RecordingMemory):
    """A memory seam whose read path takes half a second."""

    async def inject(self, request: ReadRequest) -> Injection:
        await asyncio.sleep(0.5)
        return await super().inject(request)


async def test_reads_beyond_capacity_go_on_at_once_without_memory(make_proxy: ProxyFactory) -> None:
    """With every read slot busy, a request waits at most read_queue_ms, then is served without memory."""
    proxy = await make_proxy(
        memory_factory=_factory(SlowMemory()), memory={"max_concurrent_reads": 1, "read_queue_ms": 50}
    )

    async def ask() -> tuple[float, str]:
        started = time.perf_counter()
        response = await proxy.post(CHAT, json=_body(), headers={"X-Memory-User": "alice"})
        assert response.status == 200
        return time.perf_counter() - started, response.headers["X-Memory-Arms"]

    first = asyncio.create_task(ask())
    await asyncio.sleep(0.1)  # the first request holds the only slot
    waited, arms = await ask()
    served, first_arms = await first
    assert first_arms == "dense,bm25"
    assert arms == "degraded=memory:busy"
    assert waited < 0.4 < served


async def test_health_ready_and_metrics(make_proxy: ProxyFactory) -> None:
    """Liveness, readiness and Prometheus metrics answer, and metrics count requests per stage."""
    proxy = await make_proxy()
    assert (await proxy.get("/healthz")).status == 200
    assert (await proxy.get("/readyz")).status == 200
    await proxy.post(CHAT, json=_body())
    text = await (await proxy.get("/metrics")).text()
    assert 'memproxy_requests_total{endpoint="chat",status="200"} 1.0' in text
    for stage in ("parse", "upstream_ttfb", "total"):
        assert f'memproxy_stage_seconds_count{{stage="{stage}"}} 1.0' in text


async def test_models_are_relayed(make_proxy: ProxyFactory) -> None:
    """GET /v1/models answers with the upstream's list."""
    proxy = await make_proxy()
    response = await proxy.get("/v1/models")
    assert (await response.json())["data"][0]["id"] == "fake-echo"
