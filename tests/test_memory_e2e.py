"""Memory end to end in-process: the real engine (ONNX embedder, LanceDB, Tantivy, job queue) behind the proxy."""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp.test_utils import TestClient

from proxy.state import STATE
from tests.conftest import ProxyFactory
from tests.fake_upstream import FakeUpstream

CHAT = "/v1/chat/completions"


def _chat(text: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": "fake-echo",
        "messages": [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": text}],
        **extra,
    }


async def _settled(proxy: TestClient[Any, Any], wait_s: float = 20.0) -> None:
    """Wait until the write path has no job due now (scheduled summaries/insights may stay pending)."""
    engine = proxy.app[STATE].memory
    deadline = asyncio.get_running_loop().time() + wait_s
    while asyncio.get_running_loop().time() < deadline:
        metrics = await engine.jobs.metrics()  # type: ignore[attr-defined]
        if metrics.ready == 0 and metrics.running == 0:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("write path did not settle")


def _system_of(fake: FakeUpstream) -> str:
    chats = [r for r in fake.requests if "response_format" not in r["json"]]
    return str(chats[-1]["json"]["messages"][0]["content"])


async def test_fact_crosses_conversations_not_users(make_proxy: ProxyFactory, fake: FakeUpstream) -> None:
    """Told in one conversation, a fact is injected in another conversation of the same user, never another's."""
    proxy = await make_proxy()
    told = await proxy.post(
        CHAT,
        json=_chat("Remember that my sister Priya moved to Lisbon last spring."),
        headers={"X-Memory-User": "alice", "X-Memory-Conversation": "c1"},
    )
    assert told.status == 200
    await _settled(proxy)
    asked = await proxy.post(
        CHAT,
        json=_chat("Where does my sister Priya live now?"),
        headers={"X-Memory-User": "alice", "X-Memory-Conversation": "c2"},
    )
    assert int(asked.headers["X-Memory-Injected"]) >= 1
    assert "dense" in asked.headers["X-Memory-Arms"]
    system = _system_of(fake)
    assert system.startswith("You are a helpful assistant.")
    assert "Lisbon" in system
    other = await proxy.post(
        CHAT,
        json=_chat("Where does my sister Priya live now?"),
        headers={"X-Memory-User": "bob", "X-Memory-Conversation": "c9"},
    )
    assert other.headers["X-Memory-Injected"] == "0"
    assert "Lisbon" not in str(fake.requests[-1]["json"])


async def test_remember_yields_a_fact(make_proxy: ProxyFactory, fake: FakeUpstream) -> None:
    """'Remember that ...' is stored as a fact even when the memory-side model finds nothing."""
    proxy = await make_proxy()
    await proxy.post(CHAT, json=_chat("Remember that I am allergic to peanuts."), headers={"X-Memory-User": "carol"})
    await _settled(proxy)
    engine = proxy.app[STATE].memory
    page = await engine.store.list("carol", ["fact"])  # type: ignore[attr-defined]
    assert any("peanut" in record.text.lower() for record in page.data)


async def test_mode_off_stores_nothing(make_proxy: ProxyFactory) -> None:
    """A temporary chat (mode off) leaves no trace in the store."""
    proxy = await make_proxy()
    await proxy.post(
        CHAT, json=_chat("My bank PIN is 1234."), headers={"X-Memory-User": "dave", "X-Memory-Mode": "off"}
    )
    await _settled(proxy)
    engine = proxy.app[STATE].memory
    assert await engine.store.count("dave") == 0  # type: ignore[attr-defined]


async def test_jobs_in_metrics(make_proxy: ProxyFactory) -> None:
    """Queue depth and step latency appear in /metrics."""
    proxy = await make_proxy()
    await proxy.post(CHAT, json=_chat("I like hiking."), headers={"X-Memory-User": "erin"})
    await _settled(proxy)
    text = await (await proxy.get("/metrics")).text()
    assert "memproxy_jobs_depth" in text
    assert 'memproxy_job_step_seconds_count{step="turns"}' in text


async def test_memory_parts_count_the_caches_a_read_fills(make_proxy: ProxyFactory) -> None:
    """``memproxy_memory_bytes{part}`` counts what a read fills: the user's vectors and the read path's per-text
    caches (up to 74 MiB, once outside every part), and they go back to nothing when the idle user is released."""
    proxy = await make_proxy()
    engine = proxy.app[STATE].memory
    await proxy.post(CHAT, json=_chat("I like hiking in the Alps with my sister."), headers={"X-Memory-User": "fay"})
    await _settled(proxy)
    asked = await proxy.post(CHAT, json=_chat("Where do I like hiking?"), headers={"X-Memory-User": "fay"})
    assert asked.status == 200
    parts = engine.memory_parts()
    assert parts["vector_cache"] > 0
    assert parts["text_caches"] > 0
    text = await (await proxy.get("/metrics")).text()
    assert 'memproxy_memory_bytes{part="text_caches"}' in text
    assert 'memproxy_vector_cache_lookups_total{result="miss"} 1.0' in text  # the question loaded fay's vectors
    cache = engine.store._cache
    clock = cache._clock
    cache._clock = lambda: clock() + 3600.0  # an hour without a read
    assert engine.release_idle() >= 1
    assert engine.memory_parts()["vector_cache"] == engine.memory_parts()["text_caches"] == 0


async def test_a_user_released_while_idle_leaves_the_read_cache_too(make_proxy: ProxyFactory) -> None:
    """Once idle, a user's name index, insights and newest turns go with their vectors: the read cache is not
    left holding what the vector cache handed back (up to 1,024 users' records)."""
    proxy = await make_proxy()
    engine = proxy.app[STATE].memory
    for user in ("alice", "bob"):
        asked = await proxy.post(CHAT, json=_chat("What do I like to eat?"), headers={"X-Memory-User": user})
        assert asked.status == 200
    await _settled(proxy)
    assert all(engine.names.cached_names(user) is not None for user in ("alice", "bob"))
    assert engine.release_idle() == 0  # read just now: nothing goes
    cache = engine.store._cache
    clock = cache._clock
    cache._clock = lambda: clock() + 3600.0  # an hour without a read
    assert engine.release_idle() == 2
    assert all(engine.names.cached_names(user) is None for user in ("alice", "bob"))
