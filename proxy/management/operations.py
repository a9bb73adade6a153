"""Operator routes of the management API: bulk add, and the dead letters of the memory job queue.

- ``POST /v1/memory/users/{user_id}/memories:batch``: up to ``MAX_BATCH`` facts in one request, all checked
  before any is written and written in one store submission. Idempotent: an item keeps its ``id``, or gets one
  derived from user and text, and an id already stored is left as it is, so sending the same batch twice adds
  nothing. The answer counts what was added and what was there already.
- ``GET /v1/memory/dead-letters``: memory jobs (fact extraction, summaries, insights) that failed every attempt.
- ``POST /v1/memory/dead-letters/{job_id}/requeue``: give one a fresh set of attempts.

Same rules as ``proxy.management.memories`` (``proxy.management.shared``): admin key, user id checked, pydantic
bodies, 503 when memory is off; everything goes through the engine's management seam (``MemoryAdmin``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator

from proxy.errors import NotFound, ProxyError
from proxy.management.shared import (
    PREFIX,
    USER,
    Body,
    Count,
    Handler,
    Text,
    admin_only,
    audit,
    json_response,
    memory_admin,
    path_user,
    read_body,
    read_query,
)
from proxy.memory import StoreError
from proxy.memory.store import Kind, MemoryRecord, utcnow
from proxy.transfer import content_id

MAX_BATCH = 1000
_DATETIME = TypeAdapter(datetime)
DEAD_LETTERS = PREFIX + "/dead-letters"


class IdTaken(ProxyError):
    """A batch item's id names another user's memory (409); nothing of the batch was written."""

    status = 409
    type = "invalid_request_error"
    code = "id_taken"


class BatchItem(Body):
    """One fact of a batch (strict JSON types; an optional field is left out, never null)."""

    text: Text
    id: str | None = Field(None, min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._:@+=/|~-]+$")
    importance: Count | None = Field(None, ge=1, le=10)
    category: str | None = Field(None, min_length=1, max_length=40, pattern=r"^[a-z_]+$")
    created_at: str | None = Field(None, min_length=1, max_length=64)  # RFC 3339; naive means UTC
    expires_at: str | None = Field(None, min_length=1, max_length=64)  # RFC 3339; naive means UTC

    @field_validator("created_at", "expires_at", mode="after")
    @classmethod
    def _rfc3339(cls, value: str | None) -> str | None:
        if value is not None:
            _utc_datetime(value)
        return value


class BatchAdd(Body):
    """``POST .../memories:batch``."""

    memories: list[BatchItem] = Field(min_length=1, max_length=MAX_BATCH)


class LimitQuery(BaseModel):
    """Query string of ``GET /v1/memory/dead-letters``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    limit: int = Field(100, ge=1, le=1000)


def _utc_datetime(value: str) -> datetime:
    """An RFC 3339 timestamp in UTC; ``ValueError`` if it is not one (or leaves the range in UTC)."""
    try:
        parsed = _DATETIME.validate_python(value)
        return parsed.replace(tzinfo=UTC) if parsed.tzinfo is None else parsed.astimezone(UTC)
    except (ValidationError, OverflowError):
        raise ValueError("not an RFC 3339 date-time") from None


def _record(user_id: str, item: BatchItem) -> MemoryRecord:
    created = _utc_datetime(item.created_at) if item.created_at else utcnow()
    return MemoryRecord(
        user_id=user_id,
        kind=Kind.FACT,
        text=item.text,
        importance=item.importance or 5,
        id=item.id or content_id(user_id, "fact", item.text),
        category=item.category,
        created_at=created,
        meta='{"source": "batch"}',
        expires_at=_utc_datetime(item.expires_at) if item.expires_at else None,
    )


async def add_batch(request: web.Request) -> web.Response:
    """``POST .../memories:batch``: many facts, embedded and indexed together, idempotent by id."""
    user_id = path_user(request)
    batch = await read_body(request, BatchAdd)
    records = list({r.id: r for r in (_record(user_id, item) for item in batch.memories)}.values())
    admin = memory_admin(request)
    try:
        added = await asyncio.shield(admin.add_many(user_id, records))
    except StoreError:
        raise IdTaken(
            "memories: an id of this batch is already used by another user's memory", param="memories"
        ) from None
    audit(request, "batch_added", user_id, added=len(added), existing=len(records) - len(added))
    return json_response({"ids": [r.id for r in records], "added": len(added), "existing": len(records) - len(added)})


# --- dead letters -------------------------------------------------------------------------------------


def _iso(epoch: float | None) -> str | None:
    return None if epoch is None else datetime.fromtimestamp(epoch, UTC).isoformat()


def dead_letter_dict(row: Mapping[str, Any]) -> dict[str, Any]:
    """A dead job as the API shows it (no payload: it may hold conversation text)."""
    return {
        "id": row["id"],
        "kind": row["kind"],
        "user_id": row["user_id"],
        "attempts": row["attempts"],
        "created_at": _iso(row["created_at"]),
        "updated_at": _iso(row["updated_at"]),
        "last_error": row["last_error"],
    }


async def list_dead_letters(request: web.Request) -> web.Response:
    """``GET /v1/memory/dead-letters``: the most recently failed jobs first."""
    query = read_query(request, LimitQuery)
    rows = await memory_admin(request).dead_letters(query.limit)
    return json_response({"data": [dead_letter_dict(row) for row in rows], "next_cursor": None})


async def requeue_dead_letter(request: web.Request) -> web.Response:
    """``POST /v1/memory/dead-letters/{job_id}/requeue``: the job runs again with a fresh set of attempts."""
    job_id = request.match_info["job_id"]
    admin = memory_admin(request)
    if not await asyncio.shield(admin.requeue_dead_letter(job_id)):
        raise NotFound("no dead job with this id", param="job_id")
    row = await admin.job(job_id)
    kind = row["kind"] if row is not None else ""
    audit(request, "requeued", row["user_id"] if row is not None else "", job_id=job_id, kind=kind)
    return json_response({"id": job_id, "kind": kind, "status": "queued"})


OPS_ROUTES: Mapping[tuple[str, str], Handler] = {
    ("POST", USER + "/memories:batch"): add_batch,
    ("GET", DEAD_LETTERS): list_dead_letters,
    ("POST", DEAD_LETTERS + "/{job_id}/requeue"): requeue_dead_letter,
}


def add_operations_routes(app: web.Application) -> None:
    """Register the bulk-add and dead-letter routes (admin key required)."""
    for (method, path), handler in OPS_ROUTES.items():
        app.router.add_route(method, path, admin_only(handler))
