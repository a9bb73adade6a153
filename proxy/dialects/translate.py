"""Anthropic's Messages API answered through a chat-completions upstream (``upstream.anthropic_base_url = ""``).

``to_chat`` turns a Messages request into a chat completion request (system, text and image blocks, tool use
and tool results, tools and tool choice, sampling fields); ``TranslatedReply`` wraps the chat upstream's answer
and gives it back in Anthropic's shape: a ``message`` object, or the ``message_start`` / ``content_block_*`` /
``message_delta`` / ``message_stop`` event stream, built chunk by chunk as the chat stream arrives.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Mapping
from types import MappingProxyType
from typing import Any

import orjson

from proxy.dialects.base import EventStream, loads_or_none
from proxy.memory.read import content_text
from proxy.upstream import UpstreamReply

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "function_call": "tool_use"}
_SAMPLING = {"temperature": "temperature", "top_p": "top_p", "stop_sequences": "stop", "max_tokens": "max_tokens"}


def _image(block: Mapping[str, Any]) -> dict[str, Any] | None:
    source = block.get("source")
    if not isinstance(source, Mapping):
        return None
    if source.get("type") == "base64":
        url = f"data:{source.get('media_type', 'image/png')};base64,{source.get('data', '')}"
    elif source.get("type") == "url":
        url = str(source.get("url", ""))
    else:
        return None
    return {"type": "image_url", "image_url": {"url": url}}


def _user_messages(content: Any) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    out: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for block in content if isinstance(content, list) else []:
        kind = block.get("type") if isinstance(block, Mapping) else None
        if kind == "tool_result":
            text = content_text(block.get("content")) or ("error" if block.get("is_error") else "")
            out.append({"role": "tool", "tool_call_id": str(block.get("tool_use_id", "")), "content": text})
        elif kind == "text":
            parts.append({"type": "text", "text": str(block.get("text", ""))})
        elif kind == "image" and (image := _image(block)) is not None:
            parts.append(image)
    if parts:
        out.append({"role": "user", "content": parts})
    return out


def _assistant_message(content: Any) -> dict[str, Any]:
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    message: dict[str, Any] = {"role": "assistant", "content": content_text(content) or None}
    calls = [
        {
            "id": str(b.get("id", "")),
            "type": "function",
            "function": {"name": str(b.get("name", "")), "arguments": orjson.dumps(b.get("input") or {}).decode()},
        }
        for b in content if isinstance(b, Mapping) and b.get("type") == "tool_use"
    ]  # fmt: skip
    if calls:
        message["tool_calls"] = calls
    return message


def _tools(tools: Any) -> list[dict[str, Any]]:
    return [
        {
            "type": "function",
            "function": {
                "name": str(t.get("name", "")),
                "description": str(t.get("description", "")),
                "parameters": t.get("input_schema") or {"type": "object", "properties": {}},
            },
        }
        for t in tools if isinstance(t, Mapping) and "name" in t
    ]  # fmt: skip


def _tool_choice(choice: Any) -> Any:
    if not isinstance(choice, Mapping):
        return None
    kind = choice.get("type")
    if kind == "tool":
        return {"type": "function", "function": {"name": str(choice.get("name", ""))}}
    return {"auto": "auto", "any": "required", "none": "none"}.get(str(kind))


def to_chat(body: Mapping[str, Any]) -> dict[str, Any]:
    """The chat completion request for a Messages request."""
    messages: list[dict[str, Any]] = []
    system = content_text(body.get("system"))
    if system:
        messages.append({"role": "system", "content": system})
    for message in body.get("messages") or []:
        if message.get("role") == "assistant":
            messages.append(_assistant_message(message.get("content")))
        else:
            messages.extend(_user_messages(message.get("content")))
    chat: dict[str, Any] = {"model": body["model"], "messages": messages}
    chat.update({ours: body[theirs] for theirs, ours in _SAMPLING.items() if body.get(theirs) is not None})
    if body.get("tools"):
        chat["tools"] = _tools(body["tools"])
        if (choice := _tool_choice(body.get("tool_choice"))) is not None:
            chat["tool_choice"] = choice
    metadata = body.get("metadata")
    if isinstance(metadata, Mapping) and isinstance(metadata.get("user_id"), str):
        chat["user"] = metadata["user_id"]
    if body.get("stream"):
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    return chat


def _usage(usage: Any) -> dict[str, int]:
    usage = usage if isinstance(usage, Mapping) else {}
    return {
        "input_tokens": int(usage.get("prompt_tokens") or 0),
        "output_tokens": int(usage.get("completion_tokens") or 0),
    }


def to_message(completion: Any, model: str) -> dict[str, Any]:
    """The Messages response for a chat completion."""
    choice = (completion.get("choices") or [{}])[0] if isinstance(completion, Mapping) else {}
    message = choice.get("message") or {}
    content: list[dict[str, Any]] = []
    if isinstance(message.get("content"), str) and message["content"]:
        content.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        arguments = loads_or_none(str(function.get("arguments") or "{}").encode())
        content.append(
            {
                "type": "tool_use",
                "id": str(call.get("id") or f"toolu_{uuid.uuid4().hex[:24]}"),
                "name": str(function.get("name", "")),
                "input": arguments if isinstance(arguments, dict) else {},
            }
        )
    return {
        "id": f"msg_{uuid.uuid4().hex[:24]}",
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": STOP_REASONS.get(str(choice.get("finish_reason")), "end_turn"),
        "stop_sequence": None,
        "usage": _usage(completion.get("usage") if isinstance(completion, Mapping) else None),
    }


def event(name: str, data: Mapping[str, Any]) -> bytes:
    """One Anthropic SSE event."""
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps({"type": name, **data}) + b"\n\n"


class StreamTranslator:
    """Chat completion chunks in, Anthropic stream events out."""

    def __init__(self, model: str) -> None:
        self._model = model
        self._events = EventStream()
        self._started = False
        self._open: tuple[str, int] | None = None  # ("text" | tool index as str, block index)
        self._blocks = 0
        self._stop: str | None = None
        self._usage: dict[str, int] = {"input_tokens": 0, "output_tokens": 0}
        self.finished = False

    def feed(self, chunk: bytes) -> bytes:
        """The events for the chat stream's bytes so far."""
        out: list[bytes] = []
        if not self._started:
            self._started = True
            message: dict[str, Any] = {"id": f"msg_{uuid.uuid4().hex[:24]}", "type": "message", "role": "assistant",
                       "model": self._model, "content": [], "stop_reason": None, "stop_sequence": None,
                       "usage": {"input_tokens": 0, "output_tokens": 0}}  # fmt: skip
            out.append(event("message_start", {"message": message}))
        for _, data in self._events.feed(chunk):
            if isinstance(data, dict):
                out.extend(self._chunk(data))
        return b"".join(out)

    def _chunk(self, data: dict[str, Any]) -> list[bytes]:
        out: list[bytes] = []
        if isinstance(data.get("usage"), Mapping):
            self._usage = _usage(data["usage"])
        for choice in data.get("choices") or []:
            delta = choice.get("delta") or {}
            if isinstance(delta.get("content"), str) and delta["content"]:
                out += self._switch("text", {"type": "text", "text": ""})
                out.append(self._delta({"type": "text_delta", "text": delta["content"]}))
            for call in delta.get("tool_calls") or []:
                function = call.get("function") or {}
                key = f"tool{call.get('index', 0)}"
                if self._open is None or self._open[0] != key:
                    block = {"type": "tool_use", "id": str(call.get("id") or f"toolu_{uuid.uuid4().hex[:24]}"),
                             "name": str(function.get("name", "")), "input": {}}  # fmt: skip
                    out += self._switch(key, block)
                if function.get("arguments"):
                    out.append(self._delta({"type": "input_json_delta", "partial_json": str(function["arguments"])}))
            if choice.get("finish_reason"):
                self._stop = STOP_REASONS.get(str(choice["finish_reason"]), "end_turn")
        return out

    def _switch(self, key: str, block: dict[str, Any]) -> list[bytes]:
        if self._open is not None and self._open[0] == key:
            return []
        out = self._close_block()
        self._open = (key, self._blocks)
        self._blocks += 1
        return [*out, event("content_block_start", {"index": self._open[1], "content_block": block})]

    def _delta(self, delta: dict[str, Any]) -> bytes:
        assert self._open is not None
        return event("content_block_delta", {"index": self._open[1], "delta": delta})

    def _close_block(self) -> list[bytes]:
        if self._open is None:
            return []
        index, self._open = self._open[1], None
        return [event("content_block_stop", {"index": index})]

    def finish(self) -> bytes:
        """The closing events (once): the open block's stop, ``message_delta`` and ``message_stop``."""
        if self.finished:
            return b""
        self.finished = True
        delta = {"delta": {"stop_reason": self._stop or "end_turn", "stop_sequence": None},
                 "usage": {"output_tokens": self._usage["output_tokens"]}}  # fmt: skip
        return b"".join([*self._close_block(), event("message_delta", delta), event("message_stop", {})])

    @property
    def stopped(self) -> bool:
        """A finish reason was seen."""
        return self._stop is not None


class TranslatedReply:
    """A chat upstream's answer, given back in Anthropic's shape."""

    def __init__(self, reply: UpstreamReply, model: str, stream: bool) -> None:
        self._reply = reply
        self._model = model
        self._stream = stream
        self.status = reply.status
        content_type = "text/event-stream" if stream else "application/json"
        self.headers: Mapping[str, str] = MappingProxyType({"Content-Type": content_type})
        self.ttfb_s = reply.ttfb_s

    async def chunks(self) -> AsyncIterator[bytes]:
        """The Anthropic events as the chat chunks arrive."""
        if not self._stream:
            yield await self.read()
            return
        translator = StreamTranslator(self._model)
        async for chunk in self._reply.chunks():
            if out := translator.feed(chunk):
                yield out
            if translator.stopped and b"[DONE]" in chunk:
                break
        yield translator.finish()

    async def read(self) -> bytes:
        """The whole Anthropic message."""
        if self._stream:
            return b"".join([chunk async for chunk in self.chunks()])
        return orjson.dumps(to_message(loads_or_none(await self._reply.read()), self._model))
