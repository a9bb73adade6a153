"""OpenAI chat completions (``POST /v1/chat/completions``): the view is the request's own messages."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from proxy.chat import parse_chat_request
from proxy.dialects.base import ChatView, Reply, loads_or_none
from proxy.memory.read import BlockPlan, appended, merge_block
from proxy.sse import reply_from_completion
from proxy.tool_history import ToolReplyAssembler, reply_tool_calls


def apply_to_messages(messages: list[dict[str, Any]], plan: BlockPlan) -> list[dict[str, Any]]:
    """Chat messages with the plan written in: turn parts appended to their user messages, the system part
    to the leading system message (or a new one in front)."""
    out = list(messages)
    for turn in plan.turns:
        out[turn.index] = {**out[turn.index], "content": appended(out[turn.index].get("content"), turn.text)}
    return merge_block(out, plan.system) if plan.system else out


class ChatReader:
    """The reply of a chat.completion.chunk stream."""

    def __init__(self) -> None:
        self._assembler = ToolReplyAssembler()

    def feed(self, chunk: bytes) -> None:
        """Consume bytes as they arrive."""
        self._assembler.feed(chunk)

    @property
    def complete(self) -> bool:
        """A finish reason or ``[DONE]`` was seen."""
        return self._assembler.complete

    @property
    def reply(self) -> Reply:
        """The text and tool calls so far."""
        return Reply(self._assembler.text, self._assembler.tool_texts)


class ChatCompletions:
    """The chat completions dialect."""

    name = "chat"

    def parse(self, raw: bytes) -> dict[str, Any]:
        """Validated body (``proxy.chat.parse_chat_request``)."""
        return parse_chat_request(raw)

    def view(self, body: Mapping[str, Any]) -> ChatView:
        """The messages as sent."""
        return ChatView(body["messages"])

    def apply(self, body: Mapping[str, Any], view: ChatView, plan: BlockPlan) -> dict[str, Any]:
        """The body with the plan in its messages."""
        return {**body, "messages": apply_to_messages(body["messages"], plan)}

    def reply(self, data: bytes) -> Reply:
        """Choice 0's text and tool calls."""
        completion = loads_or_none(data)
        return Reply(reply_from_completion(completion), reply_tool_calls(completion))

    def reader(self) -> ChatReader:
        """A chunk-stream reader."""
        return ChatReader()


CHAT = ChatCompletions()
