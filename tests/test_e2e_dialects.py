"""End to end: the real ``openai``, ``anthropic`` and ``openai-agents`` SDKs through ``memproxy serve`` against one
fake upstream that speaks chat completions, the Responses API and Anthropic's Messages API (and refuses requests
without a key). A fact told in one dialect is injected into the others'; other ``/v1`` paths are relayed."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import anthropic
import openai
import pytest

from tests.support.processes import Process, fake_upstream_process, memproxy_process

pytestmark = pytest.mark.e2e

OPENAI_KEY = "sk-client-openai-5151"
ANTHROPIC_KEY = "sk-ant-client-7373"
ADMIN_KEY = "admin-key-dialects-0001"


def _root(base_url: str) -> str:
    return base_url.removesuffix("/v1")


def received(upstream: str) -> list[dict[str, Any]]:
    """Every request the fake upstream has received, oldest first."""
    with urllib.request.urlopen(f"{_root(upstream)}/_fake/requests", timeout=10) as answer:  # noqa: S310 (loopback)
        return list(json.loads(answer.read()))


def eventually(check: Callable[[], bool], timeout: float = 60.0) -> None:
    """Wait until ``check()`` holds (the write path stores turns after the answer)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.3)
    raise AssertionError("condition not met in time")


@pytest.fixture(scope="module")
def upstream() -> Iterator[str]:
    """The fake upstream (recording) for the module; its OpenAI-style base URL."""
    with fake_upstream_process(record=True) as (_, url):
        yield url


@pytest.fixture(scope="module")
def proxy(upstream: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Process, str]]:
    """memproxy with memory on, chat/Responses to the fake, Anthropic's API on the same fake."""
    env = {
        "MEMPROXY_UPSTREAM__BASE_URL": upstream,
        "MEMPROXY_UPSTREAM__ANTHROPIC_BASE_URL": _root(upstream),
        "MEMPROXY_STORAGE__PATH": str(tmp_path_factory.mktemp("data")),
        "MEMPROXY_WRITER__FACTS_WINDOW_WAIT_S": "0.2",
        "MEMPROXY_ADMIN__API_KEY": ADMIN_KEY,
    }
    with memproxy_process(env) as started:
        yield started


@pytest.fixture(scope="module")
def translating(upstream: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Process, str]]:
    """memproxy with ``anthropic_base_url = ""``: Messages translated to chat completions."""
    env = {
        "MEMPROXY_UPSTREAM__BASE_URL": upstream,
        "MEMPROXY_UPSTREAM__ANTHROPIC_BASE_URL": "",
        "MEMPROXY_STORAGE__PATH": str(tmp_path_factory.mktemp("data")),
    }
    with memproxy_process(env) as started:
        yield started


OPENED: list[openai.OpenAI | anthropic.Anthropic] = []


@pytest.fixture(autouse=True)
def _close_clients() -> Iterator[None]:
    """Every SDK client a test opened is closed after it (no socket left to the garbage collector)."""
    yield
    while OPENED:
        OPENED.pop().close()


def openai_client(url: str, user: str | None = None) -> openai.OpenAI:
    """The OpenAI SDK pointed at memproxy (``user``: as ``X-Memory-User``)."""
    headers = {"X-Memory-User": user} if user else None
    client = openai.OpenAI(base_url=url, api_key=OPENAI_KEY, max_retries=0, default_headers=headers)
    OPENED.append(client)
    return client


def anthropic_client(url: str, user: str | None = None) -> anthropic.Anthropic:
    """The Anthropic SDK pointed at memproxy (its base URL has no ``/v1``)."""
    headers = {"X-Memory-User": user} if user else None
    client = anthropic.Anthropic(base_url=_root(url), api_key=ANTHROPIC_KEY, max_retries=0, default_headers=headers)
    OPENED.append(client)
    return client


def last(upstream: str, path: str) -> dict[str, Any]:
    """The latest request the fake received on ``path``."""
    return [r for r in received(upstream) if r.get("path") == path][-1]


def test_responses_create_and_stream(proxy: tuple[Process, str]) -> None:
    """``responses.create`` and ``responses.stream`` are answered through memproxy."""
    client = openai_client(proxy[1])
    reply = client.responses.create(model="gpt-test", input="hello there")
    assert reply.output_text == "echo: hello there"
    with client.responses.stream(model="gpt-test", input="one two") as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert text.strip() == "echo: one two"
    assert final.output_text == "echo: one two"


def test_responses_get_and_delete_are_relayed(proxy: tuple[Process, str]) -> None:
    """``GET``/``DELETE /v1/responses/{id}`` and ``input_items`` reach the upstream unchanged."""
    client = openai_client(proxy[1])
    reply = client.responses.create(model="gpt-test", input="keep me")
    assert client.responses.retrieve(reply.id).output_text == "echo: keep me"
    items = client.responses.input_items.list(reply.id)
    assert items.data
    client.responses.delete(reply.id)


def test_embeddings_are_relayed(proxy: tuple[Process, str], upstream: str) -> None:
    """``embeddings.create`` through the same client works, with the client's key upstream."""
    result = openai_client(proxy[1]).embeddings.create(model="text-embedding-3-small", input=["a", "b"])
    assert [len(d.embedding) for d in result.data] == [3, 3]
    assert last(upstream, "/v1/embeddings")["headers"]["Authorization"] == f"Bearer {OPENAI_KEY}"


def test_anthropic_messages_create_stream_and_tools(proxy: tuple[Process, str], upstream: str) -> None:
    """``messages.create``, ``messages.stream`` and a tool round trip; ``x-api-key`` and ``cache_control``
    reach the upstream as the app sent them."""
    client = anthropic_client(proxy[1])
    system = [{"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}}]
    reply = client.messages.create(
        model="claude-test", max_tokens=50, system=system, messages=[{"role": "user", "content": "hi"}]
    )
    assert reply.content[0].text == "echo: hi"
    sent = last(upstream, "/v1/messages")
    headers = {k.lower(): v for k, v in sent["headers"].items()}  # this SDK sends its key as a bearer token
    assert headers.get("x-api-key") == ANTHROPIC_KEY or headers.get("authorization") == f"Bearer {ANTHROPIC_KEY}"
    assert "anthropic-version" in headers
    assert sent["json"]["system"][0] == system[0]
    with client.messages.stream(model="claude-test", max_tokens=50, messages=[{"role": "user", "content": "a b"}]) as s:
        assert s.get_final_text().strip() == "echo: a b"
    tools = [{"name": "get_weather", "description": "weather", "input_schema": {"type": "object", "properties": {}}}]
    first = client.messages.create(
        model="claude-test", max_tokens=50, tools=tools, messages=[{"role": "user", "content": "weather?"}]
    )
    call = next(b for b in first.content if b.type == "tool_use")
    second = client.messages.create(
        model="claude-test",
        max_tokens=50,
        tools=tools,
        messages=[
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": [b.model_dump() for b in first.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "18C"}]},
        ],
    )
    assert second.content[0].text == "tool said: 18C"


def test_anthropic_errors_have_anthropics_shape(proxy: tuple[Process, str]) -> None:
    """memproxy's own 400 on ``/v1/messages`` is ``{"type": "error", "error": {...}}``; upstream errors relayed."""
    client = anthropic_client(proxy[1])
    with pytest.raises(anthropic.BadRequestError) as raised:
        client.messages.create(model="claude-test", max_tokens=5, messages=[])
    assert raised.value.body["type"] == "error"  # type: ignore[index]
    assert raised.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    with pytest.raises(anthropic.APIStatusError) as relayed:
        client.messages.create(model="fake-error-429", max_tokens=5, messages=[{"role": "user", "content": "x"}])
    assert relayed.value.status_code == 429
    assert relayed.value.body["error"]["message"] == "scripted 429"  # type: ignore[index]


def test_count_tokens_is_relayed(proxy: tuple[Process, str]) -> None:
    """``/v1/messages/count_tokens`` reaches Anthropic's API."""
    count = anthropic_client(proxy[1]).messages.count_tokens(
        model="claude-test", messages=[{"role": "user", "content": "hi"}]
    )
    assert count.input_tokens == 42


def _told(upstream: str, path: str, marker: str) -> Callable[[], bool]:
    def check() -> bool:
        return marker in json.dumps(last(upstream, path)["json"])

    return check


def test_a_fact_told_in_each_dialect_reaches_the_others(proxy: tuple[Process, str], upstream: str) -> None:
    """What a user tells through chat completions, Responses or Messages is injected in the other dialects,
    streamed and not."""
    url = proxy[1]
    chat, responses, messages = openai_client(url, "dana"), openai_client(url, "dana"), anthropic_client(url, "dana")
    chat.chat.completions.create(model="gpt-test", messages=[{"role": "user", "content": "My dog is called Biscuit"}])
    responses.responses.create(model="gpt-test", input="I play the theremin every Sunday")
    messages.messages.create(
        model="claude-test", max_tokens=20, messages=[{"role": "user", "content": "I live in Tromsø with Ingrid"}]
    )

    def ask_responses() -> bool:
        responses.responses.create(model="gpt-test", input="What is my dog called and where do I live?")
        return _told(upstream, "/v1/responses", "Biscuit")() and _told(upstream, "/v1/responses", "Troms")()

    def ask_messages() -> bool:
        with messages.messages.stream(
            model="claude-test", max_tokens=20, messages=[{"role": "user", "content": "Which instrument do I play?"}]
        ) as stream:
            stream.get_final_text()
        return _told(upstream, "/v1/messages", "theremin")()

    def ask_chat() -> bool:
        stream = chat.chat.completions.create(
            model="gpt-test", stream=True, messages=[{"role": "user", "content": "Who do I live with in Tromsø?"}]
        )
        list(stream)
        return _told(upstream, "/v1/chat/completions", "Ingrid")()

    eventually(ask_responses)
    eventually(ask_messages)
    eventually(ask_chat)


async def test_agents_sdk_runner_with_a_tool(proxy: tuple[Process, str], upstream: str) -> None:
    """The Agents SDK's ``Runner`` on its default model (the Responses API) runs a tool call through memproxy,
    with the user's memory in the first request."""
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    told = [{"role": "user", "content": "My dog is called Biscuit"}]
    openai_client(proxy[1], "dana").chat.completions.create(model="gpt-test", messages=told)
    client = openai.AsyncOpenAI(base_url=proxy[1], api_key=OPENAI_KEY, max_retries=0,
                                default_headers={"X-Memory-User": "dana"})  # fmt: skip
    agents.set_default_openai_client(client, use_for_tracing=False)

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return f"sunny in {city}"

    agent = agents.Agent(name="helper", instructions="Be brief.", tools=[get_weather])
    deadline = time.monotonic() + 60
    try:
        while True:  # until the fact told above is stored and carried in the first request's instructions
            result = await agents.Runner.run(agent, "What is the weather where my dog Biscuit and I are?")
            assert result.final_output == "tool said: sunny in Paris"
            first = [r for r in received(upstream) if r.get("path") == "/v1/responses"][-2]
            if "Biscuit" in json.dumps(first["json"].get("instructions")) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.3)
    finally:
        await client.close()
    assert "Biscuit" in json.dumps(first["json"].get("instructions"))


def test_translation_answers_the_anthropic_sdk_through_chat_completions(
    translating: tuple[Process, str], upstream: str
) -> None:
    """With ``anthropic_base_url = ""`` the Anthropic SDK is answered by the chat-completions upstream, in
    Anthropic's shape, streamed and not, with memory."""
    client = anthropic_client(translating[1], "erin")
    reply = client.messages.create(
        model="gpt-test", max_tokens=20, messages=[{"role": "user", "content": "My cat is named Pixel"}]
    )
    assert reply.content[0].text == "echo: My cat is named Pixel"
    assert reply.stop_reason == "end_turn"
    assert last(upstream, "/v1/chat/completions")["json"]["messages"][-1]["role"] == "user"
    with client.messages.stream(
        model="gpt-test", max_tokens=20, messages=[{"role": "user", "content": "x y"}]
    ) as stream:
        assert stream.get_final_text() == "echo: x y"

    def injected() -> bool:
        client.messages.create(model="gpt-test", max_tokens=20, messages=[{"role": "user", "content": "My cat?"}])
        return "Pixel" in json.dumps(last(upstream, "/v1/chat/completions")["json"]["messages"][0])

    eventually(injected)
    assert client.messages.count_tokens(model="gpt-test", messages=[{"role": "user", "content": "hi"}]).input_tokens


def test_x_api_key_reaches_anthropic(proxy: tuple[Process, str], upstream: str) -> None:
    """A client that sends ``x-api-key`` (older SDKs, curl) has it passed on to Anthropic as sent."""
    body = json.dumps({"model": "claude-test", "max_tokens": 5, "messages": [{"role": "user", "content": "k"}]})
    request = urllib.request.Request(  # noqa: S310 (loopback)
        f"{_root(proxy[1])}/v1/messages",
        data=body.encode(),
        headers={"x-api-key": ANTHROPIC_KEY, "anthropic-version": "2023-06-01", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as answer:  # noqa: S310 (loopback)
        assert json.loads(answer.read())["content"][0]["text"] == "echo: k"
    headers = {k.lower(): v for k, v in last(upstream, "/v1/messages")["headers"].items()}
    assert headers["x-api-key"] == ANTHROPIC_KEY
    assert headers["anthropic-version"] == "2023-06-01"


def test_memory_side_calls_follow_the_latest_chats_dialect(proxy: tuple[Process, str], upstream: str) -> None:
    """A user whose latest chat came through Messages has their facts asked of Anthropic's API (a forced tool,
    the chat's model and key); one on the Responses API, of the Responses API (``text.format``)."""
    anthropic_client(proxy[1], "fern").messages.create(
        model="claude-side", max_tokens=20, messages=[{"role": "user", "content": "I am allergic to peanuts"}]
    )
    openai_client(proxy[1], "gale").responses.create(model="gpt-side", input="I am allergic to shellfish")

    def side_calls() -> bool:
        seen = received(upstream)
        anthropic_side = [r for r in seen if r.get("path") == "/v1/messages" and r["json"].get("tool_choice")]
        responses_side = [r for r in seen if r.get("path") == "/v1/responses" and r["json"].get("text")]
        return any(r["json"]["model"] == "claude-side" for r in anthropic_side) and any(
            r["json"]["model"] == "gpt-side" for r in responses_side
        )

    eventually(side_calls)
    side = next(r for r in received(upstream) if r.get("path") == "/v1/messages" and r["json"].get("tool_choice"))
    headers = {k.lower(): v for k, v in side["headers"].items()}
    assert headers.get("x-api-key") == ANTHROPIC_KEY


def stored_turns(url: str, user: str) -> list[dict[str, Any]]:
    """The user's stored turns (management API)."""
    request = urllib.request.Request(  # noqa: S310 (loopback)
        f"{_root(url)}/v1/memory/users/{user}/memories?kind=turn&limit=500",
        headers={"Authorization": f"Bearer {ADMIN_KEY}"},
    )
    with urllib.request.urlopen(request, timeout=30) as answer:  # noqa: S310
        return list(json.loads(answer.read())["data"])


def test_a_previous_response_id_chain_is_one_conversation(proxy: tuple[Process, str]) -> None:
    """Requests continuing ``previous_response_id`` are stored in the conversation of the chain's first."""
    client = openai_client(proxy[1], "hank")
    first = client.responses.create(model="gpt-test", input="My bike is a green Brompton")
    second = client.responses.create(model="gpt-test", input="I ride it to work", previous_response_id=first.id)
    client.responses.create(model="gpt-test", input="On Fridays I take the train", previous_response_id=second.id)
    client.responses.create(model="gpt-test", input="A different chat altogether")

    def stored() -> bool:
        return len(stored_turns(proxy[1], "hank")) >= 8

    eventually(stored)
    by_text = {t["text"]: t["conversation_id"] for t in stored_turns(proxy[1], "hank") if t.get("role") == "user"}
    chain = {by_text[t] for t in ("My bike is a green Brompton", "I ride it to work", "On Fridays I take the train")}
    assert len(chain) == 1
    assert by_text["A different chat altogether"] not in chain


def test_a_file_upload_streams_through(proxy: tuple[Process, str]) -> None:
    """``files.create`` (multipart, a few MB) reaches the upstream whole, with the client's key."""
    content = bytes(range(256)) * 8192  # 2 MiB
    answer = openai_client(proxy[1]).files.create(file=("data.jsonl", content), purpose="batch")
    assert answer.id == "file-fake"
    assert answer.model_extra is not None
    assert answer.model_extra["parts"]["file"] == len(content)
