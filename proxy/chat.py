"""Pure helpers for chat completion requests: validation (and the checks every dialect's body shares), the
messages the write path learns from, and the entries of the ``X-Memory-Arms`` response header."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import orjson

from proxy.errors import BadRequest
from proxy.memory.read import message_text


def arms_entries(arms: Iterable[str], degraded: Mapping[str, str]) -> list[str]:
    """The entries of ``X-Memory-Arms``: the arms that ran (and ``gated``), then ``degraded=<step>:<reason>``."""
    return [*arms, *(f"degraded={name}:{reason}" for name, reason in degraded.items())]


def load_object(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object, or a 400."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc.msg}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object", code="invalid_json")
    return body


def check_model_and_stream(body: Mapping[str, Any]) -> None:
    """``model`` a non-empty string, ``stream`` a boolean if present (400s naming the field)."""
    if "model" not in body:
        raise BadRequest("you must provide a model parameter", param="model", code="missing_required_parameter")
    if not isinstance(body["model"], str) or not body["model"]:
        raise BadRequest("'model' must be a non-empty string", param="model", code="invalid_type")
    if "stream" in body and not isinstance(body["stream"], bool | None):
        raise BadRequest("'stream' must be a boolean", param="stream", code="invalid_type")


def parse_chat_request(raw: bytes) -> dict[str, Any]:
    """The request body as a dict; ``BadRequest`` naming the field when it is malformed."""
    body = load_object(raw)
    check_model_and_stream(body)
    _check_messages(body)
    return body


def _check_messages(body: Mapping[str, Any]) -> None:
    if "messages" not in body:
        raise BadRequest("missing required parameter: 'messages'", param="messages", code="missing_required_parameter")
    messages = body["messages"]
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty array", param="messages", code="invalid_type")
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise BadRequest(
                f"'messages[{index}]' must be an object with a string 'role'",
                param=f"messages[{index}]",
                code="invalid_type",
            )


def new_user_messages(messages: list[dict[str, Any]]) -> tuple[str, ...]:
    """The user messages after the last assistant message: what this request adds to the conversation."""
    trailing: list[str] = []
    for message in reversed(messages):
        role = message.get("role")
        if role == "assistant":
            break
        if role == "user":
            text = message_text(message)
            if text:
                trailing.append(text)
    return tuple(reversed(trailing))


def earlier_messages(messages: list[dict[str, Any]], limit: int = 4) -> tuple[tuple[str, str], ...]:
    """(role, text) of the last ``limit`` user and assistant messages before this request's new user messages.

    The write path's context: the turn a new message answers (its vector carries it) and what "yes, that one"
    refers to (fact extraction). System messages never enter it.
    """
    last_reply = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=-1)
    end = last_reply + 1  # everything after the last assistant message is what this request adds
    earlier: list[tuple[str, str]] = []
    for message in reversed(messages[:end]):
        if len(earlier) >= limit:
            break
        role = message.get("role")
        text = message_text(message) if role in ("user", "assistant") else ""
        if text:
            earlier.append((str(role), text))
    return tuple(reversed(earlier))


def system_prompt(messages: list[dict[str, Any]]) -> str | None:
    """The app's own system prompt, if any (the write path must never learn facts from it)."""
    for message in messages:
        if message.get("role") in ("system", "developer"):
            return message_text(message)
    return None
