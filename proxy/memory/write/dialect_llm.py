"""Memory-side calls in the dialect of the user's latest chat: Anthropic's Messages API, OpenAI's Responses API.

A user whose latest chat came through ``/v1/messages`` (route ``anthropic``) has their facts, summaries and
insights asked of Anthropic's API with that chat's model and key; one whose latest chat came through
``/v1/responses`` (route ``responses:<route>``) of the same upstream's Responses API. ``DialectRouter`` picks the
client by the running job's user (``CURRENT_USER``) and falls back to the chat-completions router for everyone
else, and for a model other than the latest chat's (a configured memory model).

Structured output: Anthropic through one forced tool whose input schema is the wanted schema (its input is the
object); Responses through ``text.format`` of type ``json_schema``.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import TracebackType
from typing import Any

import aiohttp
from pydantic import SecretStr

from proxy.memory.write.latest_chat import CURRENT_USER, LatestChats
from proxy.memory.write.llm import (
    JSON,
    KeySource,
    LLMBadOutput,
    LLMClient,
    LLMUnavailable,
    UsageObserver,
    parse_json_object,
    pick_key,
    post_for_json,
    rejecting,
    report_usage,
)

ANTHROPIC_VERSION = "2023-06-01"
ANTHROPIC_ROUTE = "anthropic"
RESPONSES_PREFIX = "responses:"


def anthropic_request(model: str, messages: list[dict[str, Any]], schema: JSON, name: str, temperature: float) -> JSON:
    """A Messages request that must answer by calling the one tool ``name`` with an object of ``schema``."""
    system = "\n\n".join(str(m["content"]) for m in messages if m.get("role") == "system")
    turns = [{"role": m["role"], "content": str(m["content"])} for m in messages if m.get("role") != "system"]
    tool = {"name": name, "description": "Record the answer.", "input_schema": dict(schema)}
    return {"model": model, "max_tokens": 4096, "temperature": temperature, "system": system, "messages": turns,
            "tools": [tool], "tool_choice": {"type": "tool", "name": name}}  # fmt: skip


def anthropic_answer(body: Any, name: str) -> JSON:
    """The tool input of a Messages answer (the structured object), or ``LLMBadOutput``."""
    content = body.get("content") if isinstance(body, Mapping) else None
    for block in content if isinstance(content, list) else []:
        if isinstance(block, Mapping) and block.get("type") == "tool_use" and isinstance(block.get("input"), dict):
            return dict(block["input"])
    texts = [b.get("text") for b in content or [] if isinstance(b, Mapping) and b.get("type") == "text"]
    if texts:  # a model that answered in text: take the JSON object it wrote
        return parse_json_object("".join(t for t in texts if isinstance(t, str)))
    raise LLMBadOutput(f"the model did not call {name}")


def responses_request(model: str, messages: list[dict[str, Any]], schema: JSON, name: str, temperature: float) -> JSON:
    """A Responses request for one object of ``schema``."""
    instructions = "\n\n".join(str(m["content"]) for m in messages if m.get("role") == "system")
    items = [{"role": m["role"], "content": str(m["content"])} for m in messages if m.get("role") != "system"]
    text = {"format": {"type": "json_schema", "name": name, "schema": dict(schema), "strict": True}}
    return {"model": model, "instructions": instructions, "input": items, "text": text, "temperature": temperature,
            "store": False}  # fmt: skip


def responses_answer(body: Any) -> JSON:
    """The JSON object in a Responses answer's output text, or ``LLMBadOutput``."""
    output = body.get("output") if isinstance(body, Mapping) else None
    texts: list[str] = []
    for item in output if isinstance(output, list) else []:
        if isinstance(item, Mapping) and item.get("type") == "message":
            content = item.get("content")
            parts: list[Any] = content if isinstance(content, list) else []
            texts += [
                str(p.get("text", "")) for p in parts if isinstance(p, Mapping) and p.get("type") == "output_text"
            ]
    return parse_json_object("".join(texts))


class DialectLLM:
    """``LLMClient`` over Anthropic's Messages API or a Responses API; owns one pooled session."""

    def __init__(
        self,
        dialect: str,
        url: str,
        api_key: SecretStr,
        *,
        route: str,
        keys: KeySource | None,
        timeout_s: float = 60.0,
        temperature: float = 0.0,
        on_usage: UsageObserver | None = None,
    ) -> None:
        self._dialect = dialect  # "messages" or "responses"
        self._url = url
        self._api_key = api_key
        self._route = route
        self._keys = keys
        self._timeout_s = timeout_s
        self._temperature = temperature
        self._on_usage = on_usage
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> DialectLLM:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self._timeout_s))
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _headers(self, key: str) -> dict[str, str]:
        if self._dialect == "messages":
            return {"anthropic-version": ANTHROPIC_VERSION, **({"x-api-key": key} if key else {})}
        return {"Authorization": f"Bearer {key}"} if key else {}

    async def complete_json(
        self, model: str, messages: list[dict[str, Any]], schema: dict[str, Any], schema_name: str
    ) -> dict[str, Any]:
        """POST the request and parse the structured answer."""
        if self._session is None:
            raise LLMUnavailable("the memory LLM client is not open")
        build = anthropic_request if self._dialect == "messages" else responses_request
        key, held = pick_key(self._api_key, self._keys, self._route)
        body = build(model, messages, schema, schema_name, self._temperature)
        rejected = rejecting(self._keys, self._route, key, held)
        data = await post_for_json(
            self._session, self._url, body, self._headers(key), sent_key=bool(key), on_rejected=rejected
        )
        report_usage(self._on_usage, schema_name, model, data)
        return anthropic_answer(data, schema_name) if self._dialect == "messages" else responses_answer(data)


class DialectRouter:
    """Sends a memory-side call in the dialect of the running job's user's latest chat (see the module doc)."""

    def __init__(self, fallback: LLMClient, by_route: Mapping[str, LLMClient], latest: LatestChats) -> None:
        self._fallback = fallback
        self._by_route = dict(by_route)
        self._latest = latest

    def pick(self, model: str) -> LLMClient:
        """The client for ``model`` and the running job's user."""
        user = CURRENT_USER.get()
        chat = self._latest.latest(user) if user is not None else None
        if chat is not None and chat.model == model and chat.route in self._by_route:
            return self._by_route[chat.route]
        return self._fallback

    async def complete_json(
        self, model: str, messages: list[dict[str, Any]], schema: dict[str, Any], schema_name: str
    ) -> dict[str, Any]:
        """Delegate to the picked client."""
        return await self.pick(model).complete_json(model, messages, schema, schema_name)
