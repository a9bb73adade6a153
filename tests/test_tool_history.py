"""Tool calls are history: the assistant's tool calls and the tools' results are stored turns, found by search."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient

from proxy.tool_history import MAX_TOOL_CHARS, ToolReplyAssembler, new_tool_results, reply_tool_calls
from tests.conftest import ProxyFactory
from tests.fake_upstream import APP_KEY, FakeUpstream, chunk, completion, minimal_instance
from tests.test_jobs import eventually

CHAT = "/v1/chat/completions"
ADMIN = "admin-tools"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
QUESTION = "I fly to Paris tonight: what's the weather there?"  # about the user: it passes the pre-filter
RESULT = '{"temp_c": 18, "sky": "sunny with a light breeze"}'


class StreamingToolsUpstream(FakeUpstream):
    """``FakeUpstream`` whose ``fake-tools`` model can also stream its tool call, in argument fragments."""

    async def _tools(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        if "tools" not in body:  # a memory-side call on the chat's model
            self.structured_calls.append(body)
            content = json.dumps(minimal_instance(body["response_format"]["json_schema"]["schema"]))
            return web.json_response(completion(body["model"], content))
        if not body.get("stream"):
            return await super()._tools(request, body)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        name = body["tools"][0]["function"]["name"]
        first = {"index": 0, "id": "call_1", "type": "function", "function": {"name": name, "arguments": ""}}
        await response.write(chunk("fake-tools", {"role": "assistant", "tool_calls": [first]}))
        for part in ('{"city"', ': "Paris"}'):
            await response.write(chunk("fake-tools", {"tool_calls": [{"index": 0, "function": {"arguments": part}}]}))
        await response.write(chunk("fake-tools", {}, "tool_calls"))
        await response.write(b"data: [DONE]\n\n")
        return response


@pytest.fixture
async def fake() -> AsyncIterator[FakeUpstream]:
    """The fake upstream, able to stream tool calls (overrides conftest's ``fake``)."""
    async with StreamingToolsUpstream() as upstream:
        yield upstream


async def _exchange(proxy: TestClient[Any, Any], user: str, *, stream: bool) -> None:
    headers = {"X-Memory-User": user, "X-Memory-Conversation": "trip"}
    asked = [{"role": "user", "content": QUESTION}]
    response = await proxy.post(
        CHAT, json={"model": "fake-tools", "messages": asked, "tools": TOOLS, "stream": stream}, headers=headers
    )
    assert response.status == 200
    await response.read()
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    answered = [
        *asked,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": RESULT},
    ]
    response = await proxy.post(
        CHAT, json={"model": "fake-echo", "messages": answered, "tools": TOOLS}, headers=headers
    )
    assert response.status == 200


async def _turns(proxy: TestClient[Any, Any], user: str) -> list[tuple[str, str]]:
    response = await proxy.get(
        f"/v1/memory/users/{user}/memories?kind=turn&limit=50", headers={"Authorization": f"Bearer {ADMIN}"}
    )
    return [(item["role"], item["text"]) for item in (await response.json())["data"]]


@pytest.mark.parametrize("stream", [False, True])
async def test_tool_call_and_result_are_stored_and_searchable(
    make_proxy: ProxyFactory, fake: FakeUpstream, stream: bool
) -> None:
    """The tool call and its result become turns of the conversation, search finds the result, and the facts
    call sees only the user's own words."""
    proxy = await make_proxy(admin={"api_key": ADMIN})
    await _exchange(proxy, "ann", stream=stream)
    call_turn = ("assistant", 'tool call get_weather({"city": "Paris"})')
    result_turn = ("tool", f"tool result get_weather: {RESULT}")

    async def stored() -> bool:
        turns = await _turns(proxy, "ann")
        return call_turn in turns and result_turn in turns

    await eventually(stored, within_s=60)
    assert ("user", QUESTION) in await _turns(proxy, "ann")
    found = await proxy.post(
        "/v1/memory/users/ann/search",
        json={"query": "was it sunny in Paris?"},
        headers={"Authorization": f"Bearer {ADMIN}"},
    )
    texts = [row["text"] for row in (await found.json())["results"]]
    assert result_turn[1] in texts

    def facts_calls() -> list[Any]:
        return [
            json.loads(b["messages"][-1]["content"])
            for b in fake.structured_calls
            if b["response_format"]["json_schema"]["name"] == "memory_facts"
        ]

    async def extracted() -> bool:
        return bool(facts_calls())

    await eventually(extracted, within_s=60)
    said = [text for call in facts_calls() for item in call["exchanges"] for text in item["user"]]
    assert said == [QUESTION]  # the tool's result never reaches fact extraction


def test_tool_texts_are_bounded() -> None:
    """A huge tool result or argument list is clipped; calls and results keep their names."""
    huge = "x" * 50_000
    messages = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "tool_calls": [{"id": "a", "function": {"name": "fetch", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "a", "content": huge},
    ]
    [result] = new_tool_results(messages)
    assert result.startswith("tool result fetch: xxx")
    assert len(result) == MAX_TOOL_CHARS
    completion = {"choices": [{"message": {"tool_calls": [{"function": {"name": "f", "arguments": huge}}]}}]}
    [call] = reply_tool_calls(completion)
    assert len(call) == MAX_TOOL_CHARS
    assembler = ToolReplyAssembler()
    for _ in range(100):
        assembler.feed(chunk("m", {"tool_calls": [{"index": 0, "function": {"arguments": "y" * 1000}}]}))
    assert len(assembler.tool_texts[0]) == MAX_TOOL_CHARS


async def test_a_client_that_hangs_up_after_the_body_loses_nothing(make_proxy: ProxyFactory) -> None:
    """Clients that close the connection as soon as they have the answer (curl, urllib) still get it stored."""
    proxy = await make_proxy(admin={"api_key": ADMIN})
    port = proxy.server.port
    for n in range(5):
        body = json.dumps({"model": "fake-echo", "messages": [{"role": "user", "content": f"note number {n}"}]})
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(
            (
                f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nX-Memory-User: hal\r\n"
                f"Authorization: Bearer {APP_KEY}\r\n"
                f"Connection: close\r\nContent-Length: {len(body)}\r\n\r\n{body}"
            ).encode()
        )
        await writer.drain()
        head = await reader.readuntil(b"\r\n\r\n")
        lengths = [line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")]
        length = int(lengths[0])
        assert b"note number" in await reader.readexactly(length)
        writer.close()  # at once, like urllib

    async def all_stored() -> bool:
        return sum(role == "user" for role, _ in await _turns(proxy, "hal")) == 5

    await eventually(all_stored, within_s=60)
