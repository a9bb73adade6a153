"""OpenAI's Responses API (``POST /v1/responses``).

The chat view: ``instructions`` as a system message; ``input`` as a string (one user message) or items: messages
(string content or ``input_text``/``output_text`` parts; images are relayed, not read), ``function_call`` items as
assistant tool calls and ``function_call_output`` items as tool messages, like chat tool calls; other items
(reasoning, built-in tool calls, item references) are relayed and not read. A request that continues
``previous_response_id`` (or a ``conversation``) has the provider hold the earlier turns.

The plan goes into ``instructions`` (the system part) and into the input's user messages (turn parts, as one
more ``input_text`` part or after a string content). The reply is the response's ``output``: its
``output_text`` parts and ``function_call`` items, from the body or a stream's ``response.completed`` event.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from proxy.chat import check_model_and_stream, load_object
from proxy.dialects.base import ChatView, EventStream, Reply, loads_or_none
from proxy.errors import BadRequest
from proxy.memory.read import BlockPlan, appended, content_text
from proxy.tool_history import MAX_TOOL_ITEMS, call_text

_TEXT_PARTS = frozenset({"input_text", "output_text", "text"})
_ROLES = frozenset({"user", "assistant", "system", "developer"})


def _output_text(output: Any) -> str:
    if isinstance(output, str):
        return output
    return content_text(output, _TEXT_PARTS)


def _message(item: Mapping[str, Any]) -> dict[str, Any] | None:
    kind = item.get("type")
    if (kind in (None, "message")) and item.get("role") in _ROLES:
        return {"role": item["role"], "content": content_text(item.get("content"), _TEXT_PARTS)}
    if kind == "function_call":
        call = {"name": str(item.get("name") or ""), "arguments": str(item.get("arguments") or "")}
        tool_call = {"id": str(item.get("call_id") or ""), "type": "function", "function": call}
        return {"role": "assistant", "content": "", "tool_calls": [tool_call]}
    if kind == "function_call_output":
        return {
            "role": "tool",
            "tool_call_id": str(item.get("call_id") or ""),
            "content": _output_text(item.get("output")),
        }
    return None


def conversation_of(body: Mapping[str, Any]) -> str | None:
    """The ``conversation`` the request names (a string id or ``{"id": ...}``), or None."""
    conversation = body.get("conversation")
    if isinstance(conversation, Mapping):
        conversation = conversation.get("id")
    return conversation if isinstance(conversation, str) and conversation else None


class ResponsesReader:
    """The reply of a Responses event stream: deltas as they come, the final response when it completes."""

    def __init__(self) -> None:
        self._events = EventStream()
        self._parts: list[str] = []
        self._final: Reply | None = None
        self._id: str | None = None
        self.failed = False

    def feed(self, chunk: bytes) -> None:
        """Consume bytes as they arrive."""
        for name, data in self._events.feed(chunk):
            kind = data.get("type", name) if isinstance(data, dict) else name
            if not isinstance(data, dict):
                continue
            if kind == "response.output_text.delta" and isinstance(data.get("delta"), str):
                self._parts.append(data["delta"])
            elif kind == "response.created" and isinstance(data.get("response"), dict):
                self._id = data["response"].get("id")
            elif kind in ("response.completed", "response.incomplete"):
                self._final = response_reply(data.get("response"))
            elif kind in ("response.failed", "error"):
                self.failed = True

    @property
    def complete(self) -> bool:
        """``response.completed`` (or ``response.incomplete``) was seen."""
        return self._final is not None and not self.failed

    @property
    def reply(self) -> Reply:
        """The final reply, else the text streamed so far."""
        if self._final is not None:
            return self._final
        return Reply("".join(self._parts), (), self._id)


def response_reply(response: Any) -> Reply:
    """The text and tool calls of a response object's ``output``."""
    if not isinstance(response, Mapping):
        return Reply()
    texts: list[str] = []
    calls: list[str] = []
    for item in response.get("output") or []:
        if not isinstance(item, Mapping):
            continue
        if item.get("type") == "message":
            texts.append(content_text(item.get("content"), _TEXT_PARTS))
        elif item.get("type") == "function_call":
            calls.append(call_text(str(item.get("name") or ""), str(item.get("arguments") or "")))
    response_id = response.get("id")
    return Reply("".join(texts), tuple(calls[:MAX_TOOL_ITEMS]), response_id if isinstance(response_id, str) else None)


class Responses:
    """The Responses API dialect."""

    name = "responses"

    def parse(self, raw: bytes) -> dict[str, Any]:
        """The body; ``model``, ``stream``, ``input`` and ``instructions`` checked."""
        body = load_object(raw)
        check_model_and_stream(body)
        if "input" in body and not isinstance(body["input"], str | list | None):
            raise BadRequest("'input' must be a string or an array of items", param="input", code="invalid_type")
        if isinstance(body.get("input"), list) and not all(isinstance(i, dict) for i in body["input"]):
            raise BadRequest("every item of 'input' must be an object", param="input", code="invalid_type")
        if "instructions" in body and not isinstance(body["instructions"], str | None):
            raise BadRequest("'instructions' must be a string", param="instructions", code="invalid_type")
        return body

    def view(self, body: Mapping[str, Any]) -> ChatView:
        """Instructions and input as chat messages."""
        messages: list[dict[str, Any]] = []
        origin: list[int | None] = []
        if isinstance(body.get("instructions"), str) and body["instructions"]:
            messages.append({"role": "system", "content": body["instructions"]})
            origin.append(None)
        items = body.get("input")
        if isinstance(items, str):
            messages.append({"role": "user", "content": items})
            origin.append(-1)  # the string input itself
        for index, item in enumerate(items if isinstance(items, list) else []):
            message = _message(item)
            if message is not None:
                messages.append(message)
                origin.append(index)
        holds = bool(body.get("previous_response_id")) or conversation_of(body) is not None
        return ChatView(messages, tuple(origin), holds, conversation_of(body))

    def apply(self, body: Mapping[str, Any], view: ChatView, plan: BlockPlan) -> dict[str, Any]:
        """The system part after ``instructions``, turn parts on their input messages."""
        out = dict(body)
        items = body.get("input")
        if isinstance(items, list):
            items = list(items)
        for turn in plan.turns:
            where = view.origin[turn.index]
            if where == -1 and isinstance(items, str):
                items = appended(items, turn.text)
            elif isinstance(where, int) and where >= 0 and isinstance(items, list):
                item = items[where]
                items[where] = {**item, "content": appended(item.get("content"), turn.text, "input_text")}
        if plan.turns:
            out["input"] = items
        if plan.system:
            instructions = body.get("instructions")
            out["instructions"] = f"{instructions}\n\n{plan.system}" if instructions else plan.system
        return out

    def reply(self, data: bytes) -> Reply:
        """The response's output."""
        return response_reply(loads_or_none(data))

    def reader(self) -> ResponsesReader:
        """An event-stream reader."""
        return ResponsesReader()


RESPONSES = Responses()
