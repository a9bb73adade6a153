"""Tool calls as history: what a tool-using exchange adds to the conversation, as bounded turn texts.

A tool-using app sends a user message, gets an assistant reply holding ``tool_calls`` (no text), runs the
tools, and sends their results back as ``tool`` messages for the final answer. Both halves are part of the
conversation, so both are stored as turns:

- the assistant's tool calls (from the reply, streamed or not): ``tool call get_weather({"city": "Paris"})``,
  stored with role ``assistant``;
- the new ``tool`` messages of a request (those after its last assistant message), named after the call they
  answer: ``tool result get_weather: {"temp_c": 18}``, stored with role ``tool``.

Each text is clipped to ``MAX_TOOL_CHARS`` characters and at most ``MAX_TOOL_ITEMS`` of each are kept per
exchange, so a tool that returns a whole web page cannot flood memory. Facts never come from these: the
write path extracts facts from the user's own messages only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from proxy.memory.read import message_text
from proxy.sse import ReplyAssembler

MAX_TOOL_CHARS = 2000
MAX_TOOL_ITEMS = 16


def clip(text: str, limit: int = MAX_TOOL_CHARS) -> str:
    """``text`` cut to ``limit`` characters (an ellipsis marks the cut)."""
    return text if len(text) <= limit else text[: limit - 1] + "…"


def call_text(name: str, arguments: str) -> str:
    """One tool call as a turn text."""
    return clip(f"tool call {name or '?'}({arguments.strip()})")


def _function(call: Any) -> Mapping[str, Any]:
    function = call.get("function") if isinstance(call, Mapping) else None
    return function if isinstance(function, Mapping) else {}


def reply_tool_calls(completion: Any) -> tuple[str, ...]:
    """The tool calls of choice 0 of a non-streamed completion, as turn texts."""
    try:
        calls = completion["choices"][0]["message"].get("tool_calls") or []
    except (KeyError, IndexError, TypeError, AttributeError):
        return ()
    texts = [
        call_text(str(_function(c).get("name") or ""), str(_function(c).get("arguments") or ""))
        for c in calls
        if isinstance(c, Mapping)
    ]
    return tuple(texts[:MAX_TOOL_ITEMS])


def _call_names(messages: list[dict[str, Any]]) -> dict[str, str]:
    """``tool_call_id -> function name`` over the assistant messages of a request."""
    names: dict[str, str] = {}
    for message in messages:
        calls = message.get("tool_calls") if message.get("role") == "assistant" else None
        for call in calls if isinstance(calls, list) else []:
            if isinstance(call, Mapping) and call.get("id"):
                names[str(call["id"])] = str(_function(call).get("name") or "")
    return names


def new_tool_results(messages: list[dict[str, Any]]) -> tuple[str, ...]:
    """The ``tool`` messages after the request's last assistant message, as turn texts."""
    last_reply = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=-1)
    names = _call_names(messages)
    texts = []
    for message in messages[last_reply + 1 :]:
        if message.get("role") == "tool":
            name = names.get(str(message.get("tool_call_id")), "") or str(message.get("name") or "")
            texts.append(clip(f"tool result {name or '?'}: {message_text(message)}"))
    return tuple(texts[:MAX_TOOL_ITEMS])


class ToolReplyAssembler(ReplyAssembler):
    """``ReplyAssembler`` that also puts together the tool calls streamed in choice 0's deltas."""

    def __init__(self) -> None:
        super().__init__()
        self._calls: dict[int, list[str]] = {}

    def _consume_choices(self, choices: object) -> None:
        super()._consume_choices(choices)
        if not isinstance(choices, list):
            return
        for choice in choices:
            if isinstance(choice, dict) and choice.get("index", 0) == 0 and isinstance(choice.get("delta"), dict):
                self._add_deltas(choice["delta"].get("tool_calls"))

    def _add_deltas(self, deltas: object) -> None:
        for delta in deltas if isinstance(deltas, list) else []:
            if not isinstance(delta, dict):
                continue
            index = delta.get("index", 0)
            parts = self._calls.setdefault(index if isinstance(index, int) else 0, ["", ""])
            function = _function(delta)
            parts[0] += str(function.get("name") or "")
            if len(parts[1]) <= MAX_TOOL_CHARS:
                parts[1] += str(function.get("arguments") or "")

    @property
    def tool_texts(self) -> tuple[str, ...]:
        """The streamed tool calls so far, as turn texts."""
        return tuple(call_text(name, args) for _, (name, args) in sorted(self._calls.items()))[:MAX_TOOL_ITEMS]
