"""Every other ``/v1`` path relayed as it is (``proxy.passthrough``): the same access rules as the chat path,
the body limit while streaming, and never the management API."""

from __future__ import annotations

from collections.abc import AsyncIterator

from proxy.access import key_hash
from tests.conftest import ProxyFactory
from tests.fake_upstream import FakeUpstream

KEY = "sk-client-passthrough-01"
CLIENTS = [{"namespace": "app", "key_sha256": key_hash(KEY)}]
EMBED = {"model": "e", "input": ["a"]}


async def test_client_keys_guard_relayed_paths(make_proxy: ProxyFactory, fake: FakeUpstream) -> None:
    """With client keys, a relayed path needs one, and the upstream gets the configured key instead."""
    proxy = await make_proxy(clients=CLIENTS, upstream={"api_key": "sk-upstream-01"})
    refused = await proxy.post("/v1/embeddings", json=EMBED)
    assert refused.status == 401
    answer = await proxy.post("/v1/embeddings", json=EMBED, headers={"Authorization": f"Bearer {KEY}"})
    assert answer.status == 200
    assert fake.requests[-1]["headers"]["Authorization"] == "Bearer sk-upstream-01"


async def test_a_body_over_the_limit_is_cut_off(make_proxy: ProxyFactory) -> None:
    """A relayed body past ``server.max_body_bytes`` is a 413, declared or streamed."""
    proxy = await make_proxy(server={"max_body_bytes": 1000})
    answer = await proxy.post("/v1/embeddings", data=b"x" * 5000, headers={"Authorization": "Bearer k"})
    assert answer.status == 413

    async def chunked() -> AsyncIterator[bytes]:
        for _ in range(10):
            yield b"x" * 500

    streamed = await proxy.post("/v1/embeddings", data=chunked(), headers={"Authorization": "Bearer k"})
    assert streamed.status == 413


async def test_the_query_and_method_go_through(make_proxy: ProxyFactory, fake: FakeUpstream) -> None:
    """A ``GET`` with a query string reaches the same path under the upstream's base URL."""
    proxy = await make_proxy()
    created = await proxy.post(
        "/v1/responses", json={"model": "m", "input": "hi"}, headers={"Authorization": "Bearer k"}
    )
    response_id = (await created.json())["id"]
    fetched = await proxy.get(f"/v1/responses/{response_id}?include=x", headers={"Authorization": "Bearer k"})
    assert fetched.status == 200
    assert (await fetched.json())["id"] == response_id


async def test_management_paths_are_never_relayed(make_proxy: ProxyFactory, fake: FakeUpstream) -> None:
    """A method the management API does not serve is a 405, not a request to the upstream."""
    proxy = await make_proxy(admin={"api_key": "admin-key-01"})
    before = len(fake.requests)
    answer = await proxy.request("PUT", "/v1/memory/users", headers={"Authorization": "Bearer admin-key-01"})
    assert answer.status == 405
    assert len(fake.requests) == before
