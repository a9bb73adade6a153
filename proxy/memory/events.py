"""What memory announces to the systems around it: the events, their bodies, and the seam they go through.

Whoever changes what memory keeps calls ``MemoryEvents.emit``: the write path's facts job (a fact added,
superseded or invalidated), the management API and the MCP server (memories added, edited, deleted; a user
forgotten), the retention sweep (expired memories deleted) and the insights job (a new set of insights).
``NoEvents`` drops them; ``proxy.memory.write.webhooks.Webhooks`` turns each into signed deliveries from the
durable job queue. ``event_body`` is the JSON every receiver gets (the memory's text as stored, after the screens).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, Final, Literal, Protocol, get_args

import orjson

from proxy.memory.store.records import MemoryRecord

Event = Literal["memory.created", "memory.updated", "memory.deleted", "user.forgotten", "insights.regenerated"]
EVENTS: Final[tuple[Event, ...]] = get_args(Event)


class MemoryEvents(Protocol):
    """Where changes to memory are announced."""

    async def emit(self, event: Event, user_id: str, records: Sequence[MemoryRecord] = (), **extra: Any) -> None:
        """Announce ``event`` for ``user_id`` (one announcement per record; one without a record when none)."""
        ...


class NoEvents:
    """No one listens: every event is dropped."""

    async def emit(self, event: Event, user_id: str, records: Sequence[MemoryRecord] = (), **extra: Any) -> None:
        """Drop the event."""


def memory_dict(record: MemoryRecord) -> dict[str, Any]:
    """A memory as an event shows it: id, kind, text as stored, and when it expires (None: never)."""
    expires = record.expires_at.isoformat() if record.expires_at is not None else None
    return {"id": record.id, "kind": str(record.kind), "text": record.text, "expires_at": expires}


def event_body(
    event: Event, user_id: str, delivery_id: str, at: datetime, record: MemoryRecord | None,
    extra: Mapping[str, Any],
) -> bytes:  # fmt: skip
    """The JSON body of one delivery: the bytes that are signed and sent."""
    body = {
        "event": event,
        "user": user_id,
        "memory": memory_dict(record) if record is not None else None,
        "delivery_id": delivery_id,
        "created_at": at.isoformat(),
        **extra,
    }
    return orjson.dumps(body)
