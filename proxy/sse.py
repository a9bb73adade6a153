"""Server-sent events: reading the assistant's reply out of a relayed stream, and writing OpenAI chunks.

The relay itself forwards bytes untouched; ``ReplyAssembler`` only watches them, so that the write path gets
the complete assistant reply of a streamed answer.
"""

from __future__ import annotations

import re
from typing import Any

import orjson

# The end of an event: a blank line, whichever line ending the server uses (the earliest one ends the event).
_EVENT_END = re.compile(rb"\r\n\r\n|\n\n|\r\r")


def _event_data(event: bytes) -> bytes | None:
    lines = [line for line in event.splitlines() if line.startswith(b"data:")]
    if not lines:
        return None
    return b"\n".join(line[5:].lstrip(b" ") for line in lines)


class ReplyAssembler:
    """Accumulates the text of choice 0 from chat.completion.chunk events fed as raw bytes."""

    def __init__(self) -> None:
        self._buffer = b""
        self._parts: list[str] = []
        self.finish_reason: str | None = None
        self.done = False
        self.error: dict[str, Any] | None = None
        self.tool_calls = 0

    def feed(self, chunk: bytes) -> None:
        """Consume bytes as they arrive from the upstream."""
        buffer = self._buffer + chunk if self._buffer else chunk
        start = 0
        for end in _EVENT_END.finditer(buffer):  # one pass over the bytes, however many events they hold
            data = _event_data(buffer[start : end.start()])
            if data is not None:
                self._consume(data)
            start = end.end()
        self._buffer = buffer[start:]

    def _consume(self, data: bytes) -> None:
        if data.strip() == b"[DONE]":
            self.done = True
            return
        try:
            payload = orjson.loads(data)
        except orjson.JSONDecodeError:
            return
        if not isinstance(payload, dict):
            return
        if isinstance(payload.get("error"), dict):
            self.error = payload["error"]
            return
        self._consume_choices(payload.get("choices"))

    def _consume_choices(self, choices: object) -> None:
        if not isinstance(choices, list):
            return
        for choice in choices:
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            if isinstance(delta, dict):
                if isinstance(delta.get("content"), str):
                    self._parts.append(delta["content"])
                if delta.get("tool_calls"):
                    self.tool_calls += 1
            if choice.get("finish_reason"):
                self.finish_reason = str(choice["finish_reason"])

    @property
    def text(self) -> str:
        """The reply so far."""
        return "".join(self._parts)

    @property
    def complete(self) -> bool:
        """Whether the stream ended normally (a finish reason or ``[DONE]`` was seen)."""
        return self.error is None and (self.done or self.finish_reason is not None)


def reply_from_completion(payload: object) -> str:
    """The text of choice 0 of a non-streamed chat completion (empty if there is none)."""
    if not isinstance(payload, dict):
        return ""
    choices = payload.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return ""
    message = choices[0].get("message")
    if not isinstance(message, dict):
        return ""
    content = message.get("content")
    return content if isinstance(content, str) else ""


def data_event(payload: bytes) -> bytes:
    """One SSE ``data:`` event around a JSON payload."""
    return b"data: " + payload + b"\n\n"


DONE_EVENT = b"data: [DONE]\n\n"
