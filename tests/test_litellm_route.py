"""Routes configured as ``litellm`` translate through litellm and come back in OpenAI wire format."""

from __future__ import annotations

import orjson

from tests.conftest import ProxyFactory
from tests.fake_upstream import FakeUpstream

CHAT = "/v1/chat/completions"


def _route(fake: FakeUpstream) -> dict[str, object]:
    return {"prefix": "openai/", "provider": "litellm", "base_url": fake.base_url, "api_key": "sk-route-key"}


async def test_litellm_route_non_stream(make_proxy: ProxyFactory, fake: FakeUpstream) -> None:
    """A litellm route answers a chat completion with the upstream's text."""
    proxy = await make_proxy(routes=[_route(fake)])
    response = await proxy.post(
        CHAT, json={"model": "openai/fake-echo", "messages": [{"role": "user", "content": "via litellm"}]}
    )
    assert response.status == 200
    body = await response.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["content"] == "echo: via litellm"
    assert fake.requests[-1]["json"]["model"] == "fake-echo"
    assert fake.requests[-1]["headers"]["Authorization"] == "Bearer sk-route-key"


async def test_litellm_route_stream(make_proxy: ProxyFactory, fake: FakeUpstream) -> None:
    """A streamed litellm route is re-emitted as chat.completion.chunk events ending in [DONE]."""
    proxy = await make_proxy(routes=[_route(fake)])
    response = await proxy.post(
        CHAT, json={"model": "openai/fake-echo", "stream": True, "messages": [{"role": "user", "content": "s t"}]}
    )
    events = [e for e in (await response.read()).decode().split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    chunks = [orjson.loads(e[6:]) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == "echo: s t"


async def test_litellm_route_error_keeps_status(make_proxy: ProxyFactory, fake: FakeUpstream) -> None:
    """An upstream 429 behind a litellm route is still a 429 in OpenAI error format."""
    proxy = await make_proxy(routes=[_route(fake)])
    response = await proxy.post(
        CHAT, json={"model": "openai/fake-error-429", "messages": [{"role": "user", "content": "x"}]}
    )
    assert response.status == 429
    assert "error" in await response.json()


async def test_unrouted_model_goes_to_default(make_proxy: ProxyFactory, fake: FakeUpstream) -> None:
    """A model matching no route reaches the default upstream with its name unchanged."""
    proxy = await make_proxy(routes=[_route(fake)])
    await proxy.post(CHAT, json={"model": "fake-echo", "messages": [{"role": "user", "content": "x"}]})
    assert fake.requests[-1]["json"]["model"] == "fake-echo"
