"""The fake upstream's other APIs: OpenAI's Responses API and embeddings, Anthropic's Messages API.

Like every hosted API, each of these refuses a request without a key (``Authorization: Bearer ...`` for
OpenAI's, ``x-api-key`` or a bearer token for Anthropic's) with a 401 in the API's own error shape.

- Responses (``POST /v1/responses``): ``echo: <last user text>``; a request declaring function tools calls the
  first with ``{"city": "Paris"}`` unless the input already holds a ``function_call_output``, then answers
  ``tool said: <output>``. Streams the API's events when ``stream`` is true; answers are kept for
  ``GET``/``DELETE /v1/responses/{id}`` and ``.../input_items``.
- Messages (``POST /v1/messages``): the same replies in Anthropic's shapes (``tool_use`` / ``tool_result``),
  streamed as Anthropic's events; ``POST /v1/messages/count_tokens`` answers ``{"input_tokens": 42}``.
- Embeddings (``POST /v1/embeddings``): a 3-dimension vector per input.
Every request is recorded in the fake's ``requests`` with its ``path``.
"""

from __future__ import annotations

import asyncio
import itertools
import re
import time
from collections.abc import Mapping
from typing import Any

import orjson
from aiohttp import web

_ids = itertools.count(1)
MEMORY_PART = re.compile(r"\n\n<memory>\n.*?\n</memory>", re.DOTALL)  # a part memproxy attached to a message


def _dumps(obj: Any) -> str:
    return orjson.dumps(obj).decode()


def _text(content: Any) -> str:
    """The app's own text of a message (memory parts memproxy attached left out)."""
    if isinstance(content, str):
        return MEMORY_PART.sub("", content)
    if isinstance(content, list):
        texts = [str(p.get("text", "")) for p in content if isinstance(p, Mapping) and "text" in p]
        return " ".join(t for t in texts if not t.startswith("<memory>"))
    return ""


def minimal_instance(schema: dict[str, Any]) -> Any:
    """The smallest value a JSON schema accepts: empty arrays, first enum values, zero-ish scalars."""
    if "enum" in schema:
        return schema["enum"][0]
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind == "object":
        props = schema.get("properties", {})
        return {name: minimal_instance(props[name]) for name in schema.get("required", props)}
    defaults: dict[Any, Any] = {
        "array": [],
        "string": "",
        "integer": schema.get("minimum", 0),
        "number": schema.get("minimum", 0),
        "boolean": False,
        "null": None,
    }
    return defaults.get(kind)


def scripted_reply(body: Mapping[str, Any]) -> str | None:
    """The reply a benchmark scripted in ``metadata.fake_reply``, if any."""
    metadata = body.get("metadata")
    reply = metadata.get("fake_reply") if isinstance(metadata, Mapping) else None
    return reply if isinstance(reply, str) else None


def last_user_input(body: Mapping[str, Any]) -> str:
    """The text of the last user message of a Responses ``input``."""
    items = body.get("input")
    if isinstance(items, str):
        return items
    for item in reversed(items if isinstance(items, list) else []):
        if item.get("role") == "user":
            return _text(item.get("content"))
    return ""


def _tool_output(items: Any) -> str | None:
    for item in reversed(items if isinstance(items, list) else []):
        if item.get("type") == "function_call_output":
            return str(item.get("output"))
    return None


def openai_key_missing(request: web.Request) -> web.Response | None:
    """A 401 in OpenAI's shape when the request carries no bearer key."""
    scheme, _, key = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() == "bearer" and key.strip():
        return None
    error = {"message": "You didn't provide an API key.", "type": "invalid_request_error", "param": None,
             "code": "missing_api_key"}  # fmt: skip
    return web.json_response({"error": error}, status=401)


def anthropic_key_missing(request: web.Request) -> web.Response | None:
    """A 401 in Anthropic's shape when the request carries no key."""
    if request.headers.get("x-api-key") or request.headers.get("Authorization", "").lower().startswith("bearer "):
        return None
    error = {"type": "authentication_error", "message": "x-api-key header is required"}
    return web.json_response({"type": "error", "error": error}, status=401)


def _usage() -> dict[str, Any]:
    return {"input_tokens": 10, "output_tokens": 5, "total_tokens": 15,
            "input_tokens_details": {"cached_tokens": 0}, "output_tokens_details": {"reasoning_tokens": 0}}  # fmt: skip


def response_object(body: Mapping[str, Any]) -> dict[str, Any]:
    """The Responses API answer for ``body``."""
    model = str(body.get("model", ""))
    tools = [t for t in body.get("tools") or [] if t.get("type") == "function"]
    output_of_tool = _tool_output(body.get("input"))
    rid = f"resp_fake{next(_ids):06d}"
    if tools and output_of_tool is None:
        item: dict[str, Any] = {"type": "function_call", "id": f"fc_{rid}", "call_id": f"call_{rid}",
                                "name": tools[0]["name"], "arguments": '{"city": "Paris"}',
                                "status": "completed"}  # fmt: skip
    else:
        text = f"tool said: {output_of_tool}" if output_of_tool is not None else f"echo: {last_user_input(body)}"
        text_format = (body.get("text") or {}).get("format") or {}
        if text_format.get("type") == "json_schema":  # a memory-side call: the smallest valid object
            text = orjson.dumps(minimal_instance(text_format["schema"])).decode()
        item = {"type": "message", "id": f"msg_{rid}", "role": "assistant", "status": "completed",
                "content": [{"type": "output_text", "text": text, "annotations": []}]}  # fmt: skip
    return {"id": rid, "object": "response", "created_at": int(time.time()), "status": "completed", "model": model,
            "output": [item], "parallel_tool_calls": True, "tool_choice": body.get("tool_choice", "auto"),
            "tools": body.get("tools") or [], "usage": _usage(), "error": None, "incomplete_details": None,
            "instructions": body.get("instructions"),
            "previous_response_id": body.get("previous_response_id")}  # fmt: skip


def _event(kind: str, sequence: int, **fields: Any) -> bytes:
    data = {"type": kind, "sequence_number": sequence, **fields}
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


def response_events(response: dict[str, Any]) -> list[bytes]:
    """The Responses API's stream for an answer."""
    seq = itertools.count()
    started = {**response, "status": "in_progress", "output": []}
    events = [_event("response.created", next(seq), response=started),
              _event("response.in_progress", next(seq), response=started)]  # fmt: skip
    for index, item in enumerate(response["output"]):
        if item["type"] == "message":
            text = item["content"][0]["text"]
            empty = {**item, "status": "in_progress", "content": []}
            events.append(_event("response.output_item.added", next(seq), output_index=index, item=empty))
            part = {"type": "output_text", "text": "", "annotations": []}
            events.append(_event("response.content_part.added", next(seq), item_id=item["id"], output_index=index,
                                 content_index=0, part=part))  # fmt: skip
            for word in text.split(" "):
                events.append(_event("response.output_text.delta", next(seq), item_id=item["id"], output_index=index,
                                     content_index=0, delta=word + " ", logprobs=[]))  # fmt: skip
            events.append(_event("response.output_text.done", next(seq), item_id=item["id"], output_index=index,
                                 content_index=0, text=text, logprobs=[]))  # fmt: skip
            events.append(_event("response.content_part.done", next(seq), item_id=item["id"], output_index=index,
                                 content_index=0, part={**part, "text": text}))  # fmt: skip
        else:
            events.append(_event("response.output_item.added", next(seq), output_index=index, item=item))
        events.append(_event("response.output_item.done", next(seq), output_index=index, item=item))
    events.append(_event("response.completed", next(seq), response=response))
    return events


def message_object(body: Mapping[str, Any]) -> dict[str, Any]:
    """The Messages API answer for ``body``."""
    model = str(body.get("model", ""))
    last = body["messages"][-1]
    results = [b for b in last.get("content") or [] if isinstance(b, dict) and b.get("type") == "tool_result"]
    tools = body.get("tools") or []
    forced = body.get("tool_choice") or {}
    if forced.get("type") == "tool":  # a memory-side call: the forced tool with the smallest valid input
        tool = next(t for t in tools if t["name"] == forced["name"])
        content: list[dict[str, Any]] = [{"type": "tool_use", "id": "toolu_fake0", "name": tool["name"],
                                          "input": minimal_instance(tool["input_schema"])}]  # fmt: skip
        stop = "tool_use"
    elif tools and not results:
        content = [{"type": "tool_use", "id": "toolu_fake1", "name": tools[0]["name"],
                                          "input": {"city": "Paris"}}]  # fmt: skip
        stop = "tool_use"
    else:
        if results:
            text = f"tool said: {_text(results[0].get('content'))}"
        else:
            user = [m for m in body["messages"] if m.get("role") == "user"][-1]
            text = scripted_reply(body) or f"echo: {_text(user.get('content'))}"
        content, stop = [{"type": "text", "text": text}], "end_turn"
    return {"id": f"msg_fake{next(_ids):06d}", "type": "message", "role": "assistant", "model": model,
            "content": content, "stop_reason": stop, "stop_sequence": None,
            "usage": {"input_tokens": 10, "output_tokens": 5}}  # fmt: skip


def _anthropic_event(kind: str, **fields: Any) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **fields}) + b"\n\n"


def message_events(message: dict[str, Any]) -> list[bytes]:
    """Anthropic's stream for an answer."""
    start = {**message, "content": [], "stop_reason": None, "usage": {"input_tokens": 10, "output_tokens": 0}}
    events = [_anthropic_event("message_start", message=start)]
    for index, block in enumerate(message["content"]):
        if block["type"] == "text":
            events.append(
                _anthropic_event("content_block_start", index=index, content_block={"type": "text", "text": ""})
            )
            for word in block["text"].split(" "):
                delta = {"type": "text_delta", "text": word + " "}
                events.append(_anthropic_event("content_block_delta", index=index, delta=delta))
        else:
            events.append(_anthropic_event("content_block_start", index=index, content_block={**block, "input": {}}))
            delta = {"type": "input_json_delta", "partial_json": _dumps(block["input"])}
            events.append(_anthropic_event("content_block_delta", index=index, delta=delta))
        events.append(_anthropic_event("content_block_stop", index=index))
    delta = {"stop_reason": message["stop_reason"], "stop_sequence": None}
    events.append(_anthropic_event("message_delta", delta=delta, usage={"output_tokens": 5}))
    events.append(_anthropic_event("message_stop"))
    return events


class DialectRoutes:
    """The handlers; ``record`` appends each request (path, headers, JSON) to the fake's list."""

    def __init__(self, requests: list[dict[str, Any]], latency_s: float = 0.0, *, record: bool = True) -> None:
        self.requests = requests
        self.record = record
        self.latency_s = latency_s
        self.responses: dict[str, dict[str, Any]] = {}

    def add(self, app: web.Application) -> None:
        """Register the routes."""
        app.router.add_post("/v1/responses", self._responses)
        app.router.add_get("/v1/responses/{id}", self._get_response)
        app.router.add_delete("/v1/responses/{id}", self._delete_response)
        app.router.add_get("/v1/responses/{id}/input_items", self._input_items)
        app.router.add_post("/v1/messages", self._messages)
        app.router.add_post("/v1/messages/count_tokens", self._count_tokens)
        app.router.add_post("/v1/embeddings", self._embeddings)
        app.router.add_post("/v1/files", self._files)

    async def _json(self, request: web.Request) -> dict[str, Any]:
        body: dict[str, Any] = await request.json(loads=orjson.loads)
        if self.record:
            self.requests.append({"path": request.path, "headers": dict(request.headers), "json": body})
        if self.latency_s:
            await asyncio.sleep(self.latency_s)
        return body

    async def _stream(self, request: web.Request, events: list[bytes]) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for event in events:
            await response.write(event)
        await response.write_eof()
        return response

    async def _responses(self, request: web.Request) -> web.StreamResponse:
        if (refused := openai_key_missing(request)) is not None:
            return refused
        body = await self._json(request)
        response = response_object(body)
        self.responses[response["id"]] = {"response": response, "input": body.get("input")}
        if body.get("stream"):
            return await self._stream(request, response_events(response))
        return web.json_response(response, dumps=_dumps)

    async def _get_response(self, request: web.Request) -> web.Response:
        if (refused := openai_key_missing(request)) is not None:
            return refused
        kept = self.responses.get(request.match_info["id"])
        if kept is None:
            return web.json_response({"error": {"message": "not found", "type": "invalid_request_error"}}, status=404)
        return web.json_response(kept["response"], dumps=_dumps)

    async def _delete_response(self, request: web.Request) -> web.Response:
        if (refused := openai_key_missing(request)) is not None:
            return refused
        self.responses.pop(request.match_info["id"], None)
        return web.json_response({"id": request.match_info["id"], "object": "response", "deleted": True})

    async def _input_items(self, request: web.Request) -> web.Response:
        if (refused := openai_key_missing(request)) is not None:
            return refused
        kept = self.responses.get(request.match_info["id"], {})
        items = kept.get("input")
        data = (
            [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": items}]}]
            if isinstance(items, str)
            else list(items or [])
        )
        return web.json_response({"object": "list", "data": data, "has_more": False}, dumps=_dumps)

    async def _messages(self, request: web.Request) -> web.StreamResponse:
        if (refused := anthropic_key_missing(request)) is not None:
            return refused
        body = await self._json(request)
        if str(body.get("model", "")).startswith("fake-error-"):
            status = int(str(body["model"]).rsplit("-", 1)[1])
            error = {"type": "error", "error": {"type": "invalid_request_error", "message": f"scripted {status}"}}
            return web.json_response(error, status=status)
        message = message_object(body)
        if body.get("stream"):
            return await self._stream(request, message_events(message))
        return web.json_response(message, dumps=_dumps)

    async def _count_tokens(self, request: web.Request) -> web.Response:
        if (refused := anthropic_key_missing(request)) is not None:
            return refused
        await self._json(request)
        return web.json_response({"input_tokens": 42})

    async def _files(self, request: web.Request) -> web.Response:
        """A multipart upload: its parts' names and sizes, and the query it came with."""
        if (refused := openai_key_missing(request)) is not None:
            return refused
        parts = {}
        async for part in await request.multipart():
            parts[str(part.name)] = len(await part.read())  # type: ignore[union-attr]
        return web.json_response({"object": "file", "id": "file-fake", "parts": parts, "query": dict(request.query)})

    async def _embeddings(self, request: web.Request) -> web.Response:
        if (refused := openai_key_missing(request)) is not None:
            return refused
        body = await self._json(request)
        inputs = body.get("input")
        texts = inputs if isinstance(inputs, list) else [inputs]
        data = [{"object": "embedding", "index": i, "embedding": [0.1, 0.2, 0.3]} for i in range(len(texts))]
        usage = {"prompt_tokens": len(texts), "total_tokens": len(texts)}
        return web.json_response({"object": "list", "data": data, "model": body.get("model"), "usage": usage})
