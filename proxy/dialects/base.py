"""What every API dialect memproxy speaks provides to the one request pipeline (``proxy.relay``).

A dialect (chat completions, OpenAI's Responses API, Anthropic's Messages API) parses its request body, gives a
*chat view* of it (chat-completions-shaped messages: what retrieval reads, what the write path stores, what
the conversation fingerprint hashes), writes a placement plan (``BlockPlan``) into its own body shape, and reads
the assistant's reply out of a non-streamed body or a stream of events.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson

from proxy.memory.read import BlockPlan


@dataclass(frozen=True, slots=True)
class ChatView:
    """A request seen as chat messages (``role``, text ``content``, ``tool_calls``, ``tool_call_id``).

    ``origin[i]`` is the index in the dialect's own list of the item message ``i`` came from (None: not from the
    list, e.g. top-level instructions); ``provider_holds_history``: the provider keeps the earlier turns
    (``previous_response_id``); ``conversation``: the dialect's own conversation id, if it names one.
    """

    messages: list[dict[str, Any]]
    origin: tuple[int | None, ...] = ()
    provider_holds_history: bool = False
    conversation: str | None = None


@dataclass(frozen=True, slots=True)
class Reply:
    """The assistant's reply as the write path stores it: text, tool calls as turn texts, and its id."""

    text: str = ""
    tool_calls: tuple[str, ...] = ()
    response_id: str | None = None


class ReplyReader(Protocol):
    """Watches a relayed stream's raw bytes and puts the reply together."""

    def feed(self, chunk: bytes) -> None:
        """Consume bytes as they arrive."""
        ...

    @property
    def complete(self) -> bool:
        """Whether the event that completes the answer has been seen."""
        ...

    @property
    def reply(self) -> Reply:
        """The reply so far."""
        ...


class Dialect(Protocol):
    """One API's request and reply shapes."""

    name: str

    def parse(self, raw: bytes) -> dict[str, Any]:
        """The body as a dict; ``BadRequest`` naming the field when malformed."""
        ...

    def view(self, body: Mapping[str, Any]) -> ChatView:
        """The request as chat messages."""
        ...

    def apply(self, body: Mapping[str, Any], view: ChatView, plan: BlockPlan) -> dict[str, Any]:
        """The body to send upstream: ``plan`` written into ``body`` (not modified)."""
        ...

    def reply(self, data: bytes) -> Reply:
        """The reply of a non-streamed answer."""
        ...

    def reader(self) -> ReplyReader:
        """A fresh reader for a streamed answer."""
        ...


@dataclass(slots=True)
class EventStream:
    """Splits raw SSE bytes into ``(event name, parsed JSON data)`` pairs (unparseable data is skipped)."""

    buffer: bytes = b""
    _pending: list[tuple[str, Any]] = field(default_factory=list)

    def feed(self, chunk: bytes) -> list[tuple[str, Any]]:
        """The complete events in the bytes so far."""
        buffer = (self.buffer + chunk).replace(b"\r\n", b"\n")
        *events, self.buffer = buffer.split(b"\n\n")
        out: list[tuple[str, Any]] = []
        for event in events:
            name, data = "", []
            for line in event.split(b"\n"):
                if line.startswith(b"event:"):
                    name = line[6:].strip().decode("utf-8", "replace")
                elif line.startswith(b"data:"):
                    data.append(line[5:].lstrip(b" "))
            if data:
                try:
                    out.append((name, orjson.loads(b"\n".join(data))))
                except orjson.JSONDecodeError:
                    continue
        return out


def loads_or_none(data: bytes) -> Any:
    """``data`` parsed as JSON, or None."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
