"""Anthropic's Messages API (``POST /v1/messages``).

The chat view: ``system`` (a string or text blocks) as a system message; each message's text blocks as its
text; an assistant's ``tool_use`` blocks as tool calls and a user's ``tool_result`` blocks as tool messages,
like chat tool calls; images and documents are relayed, not read.

The plan goes into ``system`` (the system part, after the app's own text or blocks) and into user messages (a
turn part as one more text block). Blocks are appended, never changed: the app's
``cache_control`` breakpoints stay where it put them and cover the same prefix. The reply is the message's
``text`` and ``tool_use`` blocks, from the body or the stream's content block events.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from proxy.chat import check_model_and_stream, load_object
from proxy.dialects.base import ChatView, EventStream, Reply, loads_or_none
from proxy.errors import BadRequest
from proxy.memory.read import BlockPlan, appended, content_text
from proxy.tool_history import MAX_TOOL_ITEMS, call_text


def _tool_calls(content: Any) -> list[dict[str, Any]]:
    calls = []
    for block in content if isinstance(content, list) else []:
        if isinstance(block, Mapping) and block.get("type") == "tool_use":
            arguments = orjson.dumps(block.get("input") or {}).decode()
            function = {"name": str(block.get("name") or ""), "arguments": arguments}
            calls.append({"id": str(block.get("id") or ""), "type": "function", "function": function})
    return calls


def _tool_results(content: Any) -> list[dict[str, Any]]:
    results = []
    for block in content if isinstance(content, list) else []:
        if isinstance(block, Mapping) and block.get("type") == "tool_result":
            text = content_text(block.get("content"))
            results.append({"role": "tool", "tool_call_id": str(block.get("tool_use_id") or ""), "content": text})
    return results


def view_messages(body: Mapping[str, Any]) -> tuple[list[dict[str, Any]], list[int | None]]:
    """The chat messages of a Messages request and, for each, the index of the message it came from."""
    messages: list[dict[str, Any]] = []
    origin: list[int | None] = []
    system = content_text(body.get("system"))
    if system:
        messages.append({"role": "system", "content": system})
        origin.append(None)
    for index, message in enumerate(body.get("messages") or []):
        role, content = message.get("role"), message.get("content")
        if role == "assistant":
            out: dict[str, Any] = {"role": "assistant", "content": content_text(content)}
            if calls := _tool_calls(content):
                out["tool_calls"] = calls
            messages.append(out)
            origin.append(index)
            continue
        for result in _tool_results(content):
            messages.append(result)
            origin.append(None)
        text = content_text(content)
        if text or not _tool_results(content):
            messages.append({"role": "user", "content": text})
            origin.append(index)
    return messages, origin


class MessagesReader:
    """The reply of a Messages event stream."""

    def __init__(self) -> None:
        self._events = EventStream()
        self._texts: list[str] = []
        self._tools: dict[int, list[str]] = {}
        self._id: str | None = None
        self.stopped = False
        self.failed = False

    def feed(self, chunk: bytes) -> None:
        """Consume bytes as they arrive."""
        for name, data in self._events.feed(chunk):
            if isinstance(data, dict):
                self._consume(data.get("type", name), data)

    def _consume(self, kind: str, data: dict[str, Any]) -> None:
        index: int = data["index"] if isinstance(data.get("index"), int) else 0
        if kind == "message_start" and isinstance(data.get("message"), dict):
            self._id = data["message"].get("id")
        elif kind == "content_block_start" and isinstance(data.get("content_block"), dict):
            block = data["content_block"]
            if block.get("type") == "tool_use":
                self._tools[index] = [str(block.get("name") or ""), ""]
            elif block.get("type") == "text" and block.get("text"):
                self._texts.append(str(block["text"]))
        elif kind == "content_block_delta" and isinstance(data.get("delta"), dict):
            delta = data["delta"]
            if delta.get("type") == "text_delta":
                self._texts.append(str(delta.get("text") or ""))
            elif delta.get("type") == "input_json_delta" and index in self._tools:
                self._tools[index][1] += str(delta.get("partial_json") or "")
        elif kind == "message_stop":
            self.stopped = True
        elif kind == "error":
            self.failed = True

    @property
    def complete(self) -> bool:
        """``message_stop`` was seen."""
        return self.stopped and not self.failed

    @property
    def reply(self) -> Reply:
        """The text and tool calls so far."""
        calls = tuple(call_text(name, args or "{}") for _, (name, args) in sorted(self._tools.items()))
        return Reply("".join(self._texts), calls[:MAX_TOOL_ITEMS], self._id)


def message_reply(message: Any) -> Reply:
    """The text and tool calls of a Messages response body."""
    if not isinstance(message, Mapping):
        return Reply()
    content = message.get("content")
    calls = [call_text(str(c["function"]["name"]), str(c["function"]["arguments"])) for c in _tool_calls(content)]
    message_id = message.get("id")
    return Reply(
        content_text(content), tuple(calls[:MAX_TOOL_ITEMS]), message_id if isinstance(message_id, str) else None
    )


def _with_block(content: Any, text: str) -> list[Any]:
    """User content with one more text block. A string content becomes a single text block first (the same
    prompt to the model): the app sends its latest message as blocks (with a ``cache_control`` mark) and the
    same message later as a string, and the turn part must follow it as the same block either way."""
    blocks = [{"type": "text", "text": content}] if isinstance(content, str) else list(content)
    return [*blocks, {"type": "text", "text": text}]


class Messages:
    """The Anthropic Messages dialect."""

    name = "messages"

    def parse(self, raw: bytes) -> dict[str, Any]:
        """The body; ``model``, ``stream``, ``messages`` and ``system`` checked."""
        body = load_object(raw)
        check_model_and_stream(body)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("'messages' must be a non-empty array", param="messages", code="invalid_type")
        for index, message in enumerate(messages):
            if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
                raise BadRequest(
                    f"messages.{index}: each message must be an object with role 'user' or 'assistant'",
                    param=f"messages.{index}",
                    code="invalid_type",
                )
            if not isinstance(message.get("content"), str | list):
                raise BadRequest(
                    f"messages.{index}.content must be a string or an array of blocks",
                    param=f"messages.{index}.content",
                    code="invalid_type",
                )
        if "system" in body and not isinstance(body["system"], str | list | None):
            raise BadRequest(
                "'system' must be a string or an array of text blocks", param="system", code="invalid_type"
            )
        return body

    def view(self, body: Mapping[str, Any]) -> ChatView:
        """System and messages as chat messages."""
        messages, origin = view_messages(body)
        return ChatView(messages, tuple(origin))

    def apply(self, body: Mapping[str, Any], view: ChatView, plan: BlockPlan) -> dict[str, Any]:
        """The system part after the app's system, turn parts as text blocks on their user messages."""
        out = dict(body)
        if plan.turns:
            messages = list(body["messages"])
            for turn in plan.turns:
                where = view.origin[turn.index]
                if where is not None:
                    messages[where] = {**messages[where], "content": _with_block(messages[where]["content"], turn.text)}
            out["messages"] = messages
        if plan.system:
            system = body.get("system")
            out["system"] = appended(system, plan.system) if system else plan.system
        return out

    def reply(self, data: bytes) -> Reply:
        """The message's text and tool uses."""
        return message_reply(loads_or_none(data))

    def reader(self) -> MessagesReader:
        """An event-stream reader."""
        return MessagesReader()


MESSAGES = Messages()
