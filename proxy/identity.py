"""Who a chat request is for, which conversation it continues, and what memory may do with it.

Pure functions of the request's headers and parsed body (see ARCHITECTURE.md, "Identity, modes and headers").
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping
from enum import StrEnum
from typing import Any

import orjson

from proxy.errors import BadRequest
from proxy.memory.store import APP_ID_RULE, valid_app_id

USER_HEADER = "X-Memory-User"
CONVERSATION_HEADER = "X-Memory-Conversation"
MODE_HEADER = "X-Memory-Mode"


class Mode(StrEnum):
    """What memory may do for one request: ``off`` is a temporary chat (nothing read, nothing stored)."""

    FULL = "full"
    READ = "read"
    WRITE = "write"
    OFF = "off"

    @property
    def reads(self) -> bool:
        """Whether memories are retrieved and injected."""
        return self in (Mode.FULL, Mode.READ)

    @property
    def writes(self) -> bool:
        """Whether the exchange is stored and learned from."""
        return self in (Mode.FULL, Mode.WRITE)


@dataclasses.dataclass(frozen=True, slots=True)
class Identity:
    """The memory context of one request; ``user_id`` None means pure passthrough."""

    user_id: str | None
    conversation_id: str | None
    mode: Mode


def _checked(value: object, param: str) -> str:
    """``value`` if it is a valid user or conversation id (``proxy.memory.store.ids``), else a 400 naming ``param``."""
    if not isinstance(value, str) or not valid_app_id(value):
        raise BadRequest(
            f"{param} must be {APP_ID_RULE}",
            param=param,
            code="invalid_memory_id",
        )
    return value


def _user_from(headers: Mapping[str, str], body: Mapping[str, Any]) -> str | None:
    if USER_HEADER in headers:
        return _checked(headers[USER_HEADER], USER_HEADER)
    if body.get("user") is not None:
        return _checked(body["user"], "user")
    metadata = body.get("metadata")
    if isinstance(metadata, Mapping) and metadata.get("user_id") is not None:
        return _checked(metadata["user_id"], "metadata.user_id")
    return None


def _mode_from(headers: Mapping[str, str], default: Mode) -> Mode:
    raw = headers.get(MODE_HEADER)
    if raw is None:
        return default
    try:
        return Mode(raw.strip().lower())
    except ValueError:
        raise BadRequest(
            f"{MODE_HEADER} must be one of full, read, write, off; got {raw[:40]!r}",
            param=MODE_HEADER,
            code="invalid_memory_mode",
        ) from None


def conversation_fingerprint(messages: list[Any]) -> str:
    """A stable id for a conversation: a hash of its system prompt and first user message."""
    opening: list[Any] = []
    for message in messages:
        if not isinstance(message, Mapping):
            continue
        if message.get("role") in ("system", "developer"):
            opening.append(message.get("content"))
        elif message.get("role") == "user":
            opening.append(message.get("content"))
            break
    digest = hashlib.sha256(orjson.dumps(opening, option=orjson.OPT_SORT_KEYS)).hexdigest()
    return f"fp-{digest[:24]}"


def identify(
    headers: Mapping[str, str],
    body: Mapping[str, Any],
    default_mode: Mode,
    *,
    messages: list[Any] | None = None,
    conversation: str | None = None,
) -> Identity:
    """The identity of a request; raises ``BadRequest`` for malformed memory headers or ids.

    The conversation is ``X-Memory-Conversation``, else the one the request's dialect names (``conversation``:
    a Responses ``conversation`` or ``previous_response_id`` chain), else a fingerprint of ``messages`` (the
    request's chat view; the body's own ``messages`` by default).
    """
    mode = _mode_from(headers, default_mode)
    user_id = _user_from(headers, body)
    if user_id is None:
        return Identity(None, None, Mode.OFF)
    if mode is Mode.OFF:
        return Identity(user_id, None, mode)
    if CONVERSATION_HEADER in headers:
        conversation = _checked(headers[CONVERSATION_HEADER], CONVERSATION_HEADER)
    elif conversation is None:
        conversation = conversation_fingerprint(messages if messages is not None else body.get("messages") or [])
    return Identity(user_id, conversation, mode)


def log_user(user_id: str | None, how: str) -> str | None:
    """The user id as it may appear in logs: hashed (default) or raw."""
    if user_id is None or how == "raw":
        return user_id
    return "u-" + hashlib.sha256(user_id.encode()).hexdigest()[:16]
