"""Nothing in a request chooses where, or with which key, a litellm route's call goes: every steering field is
sent pointing at a canary server on 127.0.0.1, which must receive nothing, while the route's own upstream
(the fake) gets the call with the route's key, or the request is refused with a 400 naming the field."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web

from proxy.config import ConfigError, load_settings
from proxy.memory.write.llm import LiteLLMClient, LiteLLMSettings
from tests.conftest import ProxyFactory
from tests.fake_upstream import FakeUpstream

CHAT = "/v1/chat/completions"
ROUTE_KEY = "sk-route-key"


class Canary:
    """An HTTP server that records every request it gets (it must get none)."""

    def __init__(self) -> None:
        self.hits: list[str] = []
        self.base_url = ""
        self._runner: web.AppRunner | None = None

    async def _any(self, request: web.Request) -> web.Response:
        self.hits.append(f"{request.method} {request.path} {request.headers.get('Authorization')}")
        return web.json_response({"error": {"message": "canary"}}, status=500)

    async def __aenter__(self) -> Canary:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._any)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.base_url = f"http://127.0.0.1:{self._runner.addresses[0][1]}/v1"
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


@pytest.fixture
async def canary() -> AsyncIterator[Canary]:
    """A canary server on 127.0.0.1."""
    async with Canary() as server:
        yield server


def _route(fake: FakeUpstream) -> dict[str, object]:
    return {"prefix": "r/", "provider": "litellm", "base_url": fake.base_url, "api_key": ROUTE_KEY,
            "strip_prefix": True, "litellm_provider": "openai"}  # fmt: skip


def _body(**extra: Any) -> dict[str, Any]:
    return {"model": "r/fake-echo", "messages": [{"role": "user", "content": "hello"}], **extra}


# Each steering field, pointed at the canary where it takes an address.
REJECTED = {
    "api_base": lambda url: url,
    "base_url": lambda url: url,
    "api_key": lambda url: "sk-attacker",
    "api_version": lambda url: "2099-01-01",
    "custom_llm_provider": lambda url: "ollama",
    "extra_headers": lambda url: {"Authorization": "Bearer sk-attacker"},
    "headers": lambda url: {"Authorization": "Bearer sk-attacker"},
    "mock_response": lambda url: "mocked",
    "model_list": lambda url: [{"model_name": "r/fake-echo", "litellm_params": {"model": "openai/x", "api_base": url}}],
    "deployment_id": lambda url: "other",
    "litellm_params": lambda url: {"api_base": url},
    "extra_body": lambda url: {"api_base": url},
}


@pytest.mark.parametrize("field", sorted(REJECTED))
async def test_steering_field_is_refused(field: str, make_proxy: ProxyFactory, fake: FakeUpstream,
                                         canary: Canary) -> None:  # fmt: skip
    """A steering field on a litellm route is a 400 naming it; neither the canary nor the upstream is called."""
    proxy = await make_proxy(routes=[_route(fake)])
    before = len(fake.requests)
    response = await proxy.post(CHAT, json=_body(**{field: REJECTED[field](canary.base_url)}))
    assert response.status == 400
    error = (await response.json())["error"]
    assert error["param"] == field
    assert canary.hits == []
    assert len(fake.requests) == before


DROPPED = {
    "metadata": lambda url: {"api_base": url, "model_group": "x"},
    "aws_bedrock_runtime_endpoint": lambda url: url,
    "ollama_api_base": lambda url: url,
    "proxy_server_request": lambda url: {"url": url},
    "base_model": lambda url: "ollama/llama3",
    "input_cost_per_token": lambda url: 1.0,
    "fallbacks": lambda url: [{"model": "ollama/llama3", "api_base": url}],
    "num_retries": lambda url: 0,
}


@pytest.mark.parametrize("field", sorted(DROPPED))
async def test_other_litellm_kwargs_are_dropped(field: str, make_proxy: ProxyFactory, fake: FakeUpstream,
                                                canary: Canary) -> None:  # fmt: skip
    """A litellm keyword outside the allow-list is dropped: the call reaches the route's own server with its key."""
    proxy = await make_proxy(routes=[_route(fake)])
    response = await proxy.post(CHAT, json=_body(**{field: DROPPED[field](canary.base_url)}))
    assert response.status == 200
    assert canary.hits == []
    sent = fake.requests[-1]
    assert sent["headers"]["Authorization"] == f"Bearer {ROUTE_KEY}"
    assert field not in sent["json"]


@pytest.mark.parametrize("model", ["r/ollama/llama3", "r/anthropic/claude-3", "r/openai/fake-echo"])
async def test_provider_prefix_in_model_cannot_change_provider(
    model: str, make_proxy: ProxyFactory, fake: FakeUpstream, canary: Canary
) -> None:
    """A provider prefix in the model name stays part of the name: the route's own server answers, its key used."""
    proxy = await make_proxy(routes=[_route(fake)])
    response = await proxy.post(CHAT, json=_body(model=model))
    assert response.status == 200
    assert canary.hits == []
    assert fake.requests[-1]["headers"]["Authorization"] == f"Bearer {ROUTE_KEY}"


async def test_provider_named_by_prefix_is_fixed(make_proxy: ProxyFactory, fake: FakeUpstream) -> None:
    """On an ``openai/`` route without strip_prefix, ``openai/ollama/llama3`` still goes to the route's server."""
    route = {"prefix": "openai/", "provider": "litellm", "base_url": fake.base_url, "api_key": ROUTE_KEY}
    proxy = await make_proxy(routes=[route])
    response = await proxy.post(CHAT, json=_body(model="openai/ollama/llama3"))
    assert response.status == 200
    assert fake.requests[-1]["json"]["model"] == "ollama/llama3"
    assert fake.requests[-1]["headers"]["Authorization"] == f"Bearer {ROUTE_KEY}"


def test_route_whose_provider_a_model_could_choose_is_a_config_error() -> None:
    """A litellm route with strip_prefix and no litellm_provider does not load, and the message names the fix."""
    route = {"prefix": "nobase/", "provider": "litellm", "api_key": "k", "strip_prefix": True}
    with pytest.raises(ConfigError, match="litellm_provider"):
        load_settings(None, environ={}, overrides={"routes": [route]})


async def test_memory_side_litellm_calls_keep_the_route_provider(fake: FakeUpstream) -> None:
    """A memory-side call for ``ollama/llama3`` on an openai-pinned litellm route reaches the route's server."""
    settings = LiteLLMSettings(api_base=fake.base_url, api_key=ROUTE_KEY, timeout_s=10, provider="openai")
    schema = {"type": "object", "properties": {"facts": {"type": "array", "items": {"type": "string"}}},
              "required": ["facts"], "additionalProperties": False}  # fmt: skip
    answer = await LiteLLMClient(settings).complete_json("ollama/llama3", [{"role": "user", "content": "x"}],
                                                         schema, "memory_facts")  # fmt: skip
    assert answer == {"facts": []}
    assert fake.requests[-1]["json"]["model"] == "ollama/llama3"
    assert fake.requests[-1]["headers"]["Authorization"] == f"Bearer {ROUTE_KEY}"
