"""What a write-path job holds: a finished exchange (identifiers redacted), and record ids fixed by the job.

Never the system prompt, never a key. Every effect of a job is idempotent by job id: ``derived_id`` makes a
record's id from the job id and a position, so a replayed job finds its records already there.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from proxy.memory.service import Exchange
from proxy.memory.write.extraction import ExtractionSettings
from proxy.memory.write.identifiers import redact_identifiers
from proxy.memory.write.job_types import GiveUp
from proxy.memory.write.screens import remembered_identifiers

ID_NAMESPACE = uuid.UUID("6f1d3c2a-9b8e-4f7a-a1c5-3e2d9b0c4f61")


class ExchangePayload(BaseModel):
    """What an ``exchange`` job holds (never the system prompt, never a key)."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    conversation_id: str
    model: str
    user_messages: tuple[str, ...]
    reply: str
    partial: bool = False
    finished_at: float
    request_id: str | None = None
    context: tuple[tuple[str, str], ...] = ()
    tool_results: tuple[str, ...] = ()  # stored as turns of role "tool"; never a source of facts
    tool_calls: tuple[str, ...] = ()  # the reply's tool calls, stored as assistant turns
    traceparent: str | None = None  # the request's span, when tracing is on (``memory.spans``)


class FactsPayload(ExchangePayload):
    """What a ``facts`` job holds: the exchange and the ids of its user turns (the facts' sources)."""

    source_ids: tuple[str, ...] = ()


P = TypeVar("P", bound=ExchangePayload)


def derived_id(job_id: str, *parts: object) -> str:
    """A record id fixed by the job id and a position, so that replays never duplicate."""
    return uuid.uuid5(ID_NAMESPACE, "/".join([job_id, *map(str, parts)])).hex


def exchange_payload(exchange: Exchange, screens: ExtractionSettings | None = None) -> dict[str, Any]:
    """The job payload of a finished exchange (the system prompt is deliberately left out), its identifiers
    redacted before it reaches the queue's disk unless the user asked to remember (see ``screens``)."""
    payload = ExchangePayload(
        conversation_id=exchange.conversation_id,
        model=exchange.model,
        user_messages=tuple(exchange.user_messages),
        reply=exchange.assistant_text,
        partial=exchange.partial,
        finished_at=exchange.finished_at.timestamp(),
        request_id=exchange.request_id,
        context=tuple(exchange.context),
        tool_results=exchange.tool_results,
        tool_calls=exchange.tool_calls,
        traceparent=exchange.traceparent,
    )
    return redacted_payload(payload, screens or ExtractionSettings()).model_dump(mode="json")


def redacted_payload(p: ExchangePayload, screens: ExtractionSettings) -> ExchangePayload:
    """``p`` with identifiers redacted in every text, except those the user asked to remember."""
    keep = remembered_identifiers(p.user_messages, screens.extra_sensitive_patterns)

    def redact(text: str) -> str:
        return redact_identifiers(text, screens.extra_sensitive_patterns, keep)[0]

    return p.model_copy(update={
        "user_messages": tuple(redact(t) for t in p.user_messages), "reply": redact(p.reply),
        "context": tuple((role, redact(t)) for role, t in p.context),
        "tool_results": tuple(redact(t) for t in p.tool_results),
        "tool_calls": tuple(redact(t) for t in p.tool_calls),
    })  # fmt: skip


def parse_payload(model: type[P], payload: Mapping[str, Any]) -> P:
    """The job's payload as ``model``; a payload that does not fit gives the job up (retrying cannot help)."""
    try:
        return model.model_validate(payload)
    except ValidationError as error:
        raise GiveUp(f"invalid job payload: {error.errors()[0]['loc']}: {error.errors()[0]['msg']}") from None
