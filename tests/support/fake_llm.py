"""A scripted fake of an OpenAI-compatible LLM for memory-side calls: aiohttp on 127.0.0.1, port 0.

Answers ``POST /v1/chat/completions`` with scripted replies, taken in order per ``response_format`` schema
name (so interleaved calls of different kinds stay predictable), else from ``responder``, else a harmless
default.
A reply is a dict (sent as the JSON content), a str (sent as raw content, e.g. invalid JSON), ``Refusal``,
``Status`` (an HTTP error), or a callable of the request body returning one of those. Every request body is
recorded. ``stop_listening``/``listen_again`` make the server unreachable and back, on the same port.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections import defaultdict, deque
from collections.abc import Callable
from types import TracebackType
from typing import Any

from aiohttp import web

DEFAULTS: dict[str, dict[str, Any]] = {
    "memory_facts": {"facts": []},
    "memory_reconcile": {"decision": "ADD", "target": 0, "text": ""},
    "memory_reconcile_many": {"decisions": []},
    "memory_summary": {"summary": "The user and the assistant talked.", "topics": []},
}


@dataclasses.dataclass(frozen=True)
class Refusal:
    """The model refuses (``message.refusal`` set, no content)."""

    text: str = "I can't help with that."


@dataclasses.dataclass(frozen=True)
class Status:
    """An HTTP error answer."""

    code: int
    message: str = "upstream error"


def fact(text: str, **fields: Any) -> dict[str, Any]:
    """One extracted fact in the memory_facts schema, with defaults for the fields not given."""
    values: dict[str, Any] = {
        "text": text,
        "category": "other",
        "importance": 5,
        "entities": [],
        "sensitive": False,
        "sensitive_category": "none",
        "explicit_request": False,
    }
    values.update(fields)
    return values


def facts(*items: dict[str, Any]) -> dict[str, Any]:
    """A memory_facts answer."""
    return {"facts": list(items)}


def decision(kind: str, target: int = 0, text: str = "") -> dict[str, Any]:
    """A memory_reconcile answer."""
    return {"decision": kind, "target": target, "text": text}


Responder = Callable[[str, dict[str, Any]], Any]


class FakeLLM:
    """The fake server; ``base_url`` ends in ``/v1``."""

    def __init__(self, responder: Responder | None = None, *, delay_s: float = 0.0) -> None:
        self.requests: list[dict[str, Any]] = []
        self.delay_s = delay_s
        self._responder = responder
        self._scripts: dict[str, deque[Any]] = defaultdict(deque)
        self._runner: web.AppRunner | None = None
        self.port = 0

    @property
    def base_url(self) -> str:
        """Where the fake listens."""
        return f"http://127.0.0.1:{self.port}/v1"

    def script(self, schema_name: str, *replies: Any) -> None:
        """Queue replies for calls with this schema name."""
        self._scripts[schema_name].extend(replies)

    def calls(self, schema_name: str) -> list[dict[str, Any]]:
        """The recorded request bodies of calls with this schema name."""
        return [body for body in self.requests if schema_of(body) == schema_name]

    async def __aenter__(self) -> FakeLLM:
        await self.listen_again()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop_listening()

    async def stop_listening(self) -> None:
        """Close the server and its open connections: clients now get connection refused."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def listen_again(self) -> None:
        """Listen (again) on the same port (a free one the first time)."""
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port)
        await site.start()
        self.port = self._runner.addresses[0][1]

    def _next_reply(self, name: str, body: dict[str, Any]) -> Any:
        if self._scripts[name]:
            reply = self._scripts[name].popleft()
        elif self._responder is not None:
            reply = self._responder(name, body)
        else:
            reply = DEFAULTS.get(name, {})
        return reply(body) if callable(reply) else reply

    async def _handle(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append(body)
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        reply = self._next_reply(schema_of(body), body)
        if isinstance(reply, Status):
            error = {"error": {"message": reply.message, "type": "fake", "param": None, "code": None}}
            return web.json_response(error, status=reply.code)
        message: dict[str, Any] = {"role": "assistant", "content": None, "refusal": None}
        if isinstance(reply, Refusal):
            message["refusal"] = reply.text
        else:
            message["content"] = reply if isinstance(reply, str) else json.dumps(reply)
        return web.json_response(completion(body.get("model", "fake"), message))


def schema_of(body: dict[str, Any]) -> str:
    """The response_format schema name of a request body ("" when none)."""
    return str(body.get("response_format", {}).get("json_schema", {}).get("name", ""))


def completion(model: str, message: dict[str, Any]) -> dict[str, Any]:
    """A chat.completion body around ``message``."""
    return {
        "id": "chatcmpl-fake",
        "object": "chat.completion",
        "created": 0,
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": "stop", "logprobs": None}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }


def user_payload(body: dict[str, Any]) -> dict[str, Any]:
    """The JSON data a memory-side call sent in its user message."""
    return json.loads(body["messages"][1]["content"])  # type: ignore[no-any-return]


def window_user_messages(body: dict[str, Any]) -> list[tuple[int, str]]:
    """The user messages of a window extraction call, each with the number of its exchange."""
    return [(item["n"], text) for item in user_payload(body)["exchanges"] for text in item["user"]]
