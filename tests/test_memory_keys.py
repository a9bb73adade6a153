"""Memory-side calls with the user's own chat model, route and key; jobs that wait visibly for a usable key."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient
from pydantic import SecretStr

from proxy.engine import MemoryEngine
from proxy.memory.store.records import Kind
from proxy.memory.write.latest_chat import CURRENT_USER, LatestChats
from proxy.state import STATE
from tests.conftest import ProxyFactory
from tests.support.hosted_upstream import HostedUpstream
from tests.test_jobs import eventually

CHAT = "/v1/chat/completions"


@pytest.fixture
async def fake() -> AsyncIterator[HostedUpstream]:
    """A fake hosted API that wants a key (overrides conftest's ``fake``, so ``make_proxy`` points at it)."""
    async with HostedUpstream() as upstream:
        yield upstream


def _engine(proxy: TestClient[Any, Any]) -> MemoryEngine:
    memory = proxy.app[STATE].memory
    assert isinstance(memory, MemoryEngine)
    return memory


async def _chat(proxy: TestClient[Any, Any], text: str, key: str | None, user: str = "ann") -> int:
    headers = {"X-Memory-User": user, **({"Authorization": f"Bearer {key}"} if key else {})}
    body = {"model": "fake-echo", "messages": [{"role": "user", "content": text}]}
    return (await proxy.post(CHAT, json=body, headers=headers)).status


async def _facts(proxy: TestClient[Any, Any], user: str = "ann") -> list[str]:
    page = await _engine(proxy).store.list(user, [Kind.FACT], limit=50)
    return [record.text for record in page.data]


async def _metrics(proxy: TestClient[Any, Any]) -> str:
    return await (await proxy.get("/metrics")).text()


async def test_the_clients_key_makes_facts_and_is_never_written(
    make_proxy: ProxyFactory, fake: HostedUpstream, tmp_path: Path
) -> None:
    """No key configured: the facts call carries the user's own key, a fact is stored, the key is on no disk."""
    proxy = await make_proxy()
    assert await _chat(proxy, "Remember that I'm vegetarian.", "sk-ann-secret-0001") == 200

    await eventually(lambda: _has(proxy, "vegetarian"), within_s=60)
    assert fake.memory_keys("memory_facts") == ["sk-ann-secret-0001"]
    await proxy.close()
    assert _files_holding(tmp_path, b"sk-ann-secret") == []


async def test_jobs_wait_for_a_key_across_a_restart_and_run_when_it_comes(
    make_proxy: ProxyFactory, fake: HostedUpstream
) -> None:
    """Without a usable key the facts job waits (counted, not dead); after a restart the next chat's key runs it."""
    first = await make_proxy(memory_llm={"hold_client_keys": False})
    assert await _chat(first, "My sister lives in Porto.", "sk-ann-1") == 200

    async def waiting() -> bool:
        return 'memproxy_jobs_waiting{reason="no_key"} 1.0' in await _metrics(first)

    await eventually(waiting, within_s=60)
    ready = await (await first.get("/readyz")).json()
    assert ready["status"] == "ready"
    assert ready["features"]["facts"]["live"] is False
    assert "no key" in ready["features"]["facts"]["reason"]
    assert ready["features"]["turns"]["live"] is True
    assert "memproxy_jobs_dead_letters 0.0" in await _metrics(first)
    await first.close()

    second = await make_proxy()
    assert await _facts(second) == []
    assert await _chat(second, "Hello again.", "sk-ann-1") == 200

    async def ran() -> bool:
        return "My sister lives in Porto" in await _facts(second)

    await eventually(ran, within_s=60)
    assert (await (await second.get("/readyz")).json())["features"]["facts"]["live"] is True


async def test_a_rejected_key_waits_until_a_different_key_comes(make_proxy: ProxyFactory, fake: HostedUpstream) -> None:
    """Memory-side calls reject the user's key: the job waits, the same key does not wake it, a new key runs it."""
    proxy = await make_proxy()
    fake.memory_keys_accepted = {"sk-new"}
    assert await _chat(proxy, "My cat is called Miso.", "sk-old") == 200

    async def waiting() -> bool:
        return 'memproxy_jobs_waiting{reason="key_rejected"} 1.0' in await _metrics(proxy)

    await eventually(waiting, within_s=60)
    ready = await (await proxy.get("/readyz")).json()
    assert "rejects the key" in ready["features"]["facts"]["reason"]
    assert await _chat(proxy, "Still here.", "sk-old") == 200
    assert fake.memory_keys("memory_facts") == ["sk-old"]  # the same rejected key is not tried again
    assert await _chat(proxy, "Another message.", "sk-new") == 200
    await eventually(lambda: _has(proxy, "Miso"), within_s=60)
    assert "memproxy_jobs_dead_letters 0.0" in await _metrics(proxy)


def _files_holding(root: Path, needle: bytes) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and needle in p.read_bytes()]


async def _has(proxy: TestClient[Any, Any], word: str, user: str = "ann") -> bool:
    return any(word in text for text in await _facts(proxy, user))


def test_a_held_key_expires_and_goes_only_to_its_own_route() -> None:
    """A key is served to its user's jobs on its route only, until it expires."""
    now = [0.0]
    latest = LatestChats({"default"}, key_ttl_s=60, clock=lambda: now[0])
    assert latest.remember("ann", "gpt-4o-mini", "default", SecretStr("sk-a"))
    assert not latest.remember("ann", "gpt-4o-mini", "default", SecretStr("sk-a"))
    token = CURRENT_USER.set("ann")
    try:
        assert latest.key("default") == "sk-a"
        assert latest.key("openai:other/") is None
        now[0] = 61.0
        assert latest.key("default") is None
    finally:
        CURRENT_USER.reset(token)
    token = CURRENT_USER.set("ben")
    try:
        assert latest.key("default") is None
    finally:
        CURRENT_USER.reset(token)
    assert latest.model("ann") == "gpt-4o-mini"


async def test_each_routes_key_goes_only_to_that_route(make_proxy: ProxyFactory, fake: HostedUpstream) -> None:
    """A user's key for the default upstream never reaches a route's server, and the reverse."""
    async with HostedUpstream() as team:
        proxy = await make_proxy(routes=[{"prefix": "team/", "provider": "openai", "base_url": team.base_url}])
        headers = {"X-Memory-User": "ann", "Authorization": "Bearer sk-default"}
        body = {"model": "fake-echo", "messages": [{"role": "user", "content": "My bike is red."}]}
        assert (await proxy.post(CHAT, json=body, headers=headers)).status == 200
        # another user, so that each user's window of exchanges is extracted on its own route
        headers = {"X-Memory-User": "ben", "Authorization": "Bearer sk-team"}
        body = {"model": "team/echo", "messages": [{"role": "user", "content": "My car is blue."}]}
        assert (await proxy.post(CHAT, json=body, headers=headers)).status == 200
        await eventually(lambda: _has(proxy, "blue", "ben"), within_s=60)
        await eventually(lambda: _has(proxy, "red"), within_s=60)

        async def both_extracted() -> bool:
            return bool(fake.memory_keys("memory_facts")) and bool(team.memory_keys("memory_facts"))

        await eventually(both_extracted, within_s=60)
        assert set(fake.memory_keys("memory_facts")) == {"sk-default"}
        assert set(team.memory_keys("memory_facts")) == {"sk-team"}
