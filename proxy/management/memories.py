"""The memory management API under ``/v1/memory`` and the web page at ``/ui/``.

Operators and users see, correct, export and erase what memproxy keeps. Every ``/v1/memory`` route needs
``Authorization: Bearer <admin key>`` (``admin.api_key``, compared in constant time); with no key configured
the API is off and answers 503. Handlers are thin: they check the key, the user id and the body (pydantic),
then call the memory engine's management seam (``MemoryAdmin``); with memory disabled they answer 503
``memory_disabled``. Every read and delete is scoped to the user id in the path. The OpenAPI document
(``proxy/openapi.json``) describes exactly these routes (a test checks both ways).
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, model_validator

from proxy.errors import BadRequest, NotFound
from proxy.management.shared import (
    PREFIX,
    USER,
    Body,
    Count,
    Expiry,
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
from proxy.memory.store import Kind, MemoryRecord
from proxy.ui import add_ui_routes

OPENAPI_PATH = Path(__file__).resolve().parent.parent / "openapi.json"
EXPORT_CHUNK_BYTES = 64 * 1024
KINDS = frozenset(str(kind) for kind in Kind)


# --- request models -----------------------------------------------------------------------------------


class NewMemory(Body):
    """``POST .../memories``: a fact written by an operator."""

    text: Text
    kind: Literal["fact"] = "fact"
    importance: Count | None = Field(None, ge=1, le=10)
    category: str | None = Field(None, min_length=1, max_length=40, pattern=r"^[a-z_]+$")
    expires_at: Expiry | None = None


class MemoryEdit(Body):
    """``PATCH .../memories/{id}``: new text (re-embedded; the old version stays in history), importance or
    expiry."""

    text: Text | None = None
    importance: Count | None = Field(None, ge=1, le=10)
    expires_at: Expiry | None = None

    @model_validator(mode="after")
    def _something(self) -> MemoryEdit:
        if self.text is None and self.importance is None and self.expires_at is None:
            raise ValueError("give text, importance or expires_at")
        return self


class SearchRequest(Body):
    """``POST .../search``: what would be injected for a conversation whose last message is ``query``."""

    query: Text
    k: Count = Field(10, ge=1, le=50)


class ListQuery(BaseModel):
    """Query string of ``GET .../memories``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Kind | None = None
    limit: int = Field(50, ge=1, le=500)
    cursor: str | None = Field(None, min_length=1, max_length=512)
    include_invalid: bool = False


class PageQuery(BaseModel):
    """Query string of the other lists (users, insights)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    limit: int = Field(100, ge=1, le=500)
    cursor: str | None = Field(None, min_length=1, max_length=512)


# --- memories -----------------------------------------------------------------------------------------


def insight_dict(record: MemoryRecord) -> dict[str, Any]:
    """An insight as the API shows it: text, confidence, the dates it covers and its cluster's size."""
    return {
        "id": record.id, "text": record.text, "confidence": record.confidence,
        "date_range": {"start": record.start_at, "end": record.end_at}, "size": record.cluster_size,
        "created_at": record.created_at, "generation_id": record.generation_id,
    }  # fmt: skip


async def list_users(request: web.Request) -> web.Response:
    """``GET /v1/memory/users``: users with at least one record, by id."""
    query = read_query(request, PageQuery)
    users = sorted(await memory_admin(request).user_ids())
    if query.cursor is not None:
        users = [user for user in users if user > query.cursor]
    page = users[: query.limit]
    next_cursor = page[-1] if len(users) > len(page) else None
    return json_response({"data": [{"user_id": user} for user in page], "next_cursor": next_cursor})


async def list_memories(request: web.Request) -> web.Response:
    """``GET .../memories``: the user's records, newest first."""
    user_id, query = path_user(request), read_query(request, ListQuery)
    admin = memory_admin(request)
    kinds = [query.kind] if query.kind is not None else None
    try:
        page = await admin.list_memories(
            user_id, kinds, limit=query.limit, cursor=query.cursor, include_invalid=query.include_invalid
        )
    except ValueError as exc:
        raise BadRequest(f"cursor: {exc}", param="cursor", code="invalid_cursor") from None
    return json_response({"data": [record.public_dict() for record in page.data], "next_cursor": page.next_cursor})


async def add_memory(request: web.Request) -> web.Response:
    """``POST .../memories``: a new fact, embedded and indexed before the answer."""
    user_id = path_user(request)
    new = await read_body(request, NewMemory)
    admin = memory_admin(request)
    record = await asyncio.shield(admin.add_fact(user_id, new.text, new.importance, new.category, new.expires_at))
    audit(request, "added", user_id, id=record.id)
    return json_response(record.public_dict(), status=201)


async def get_memory(request: web.Request) -> web.Response:
    """``GET .../memories/{id}``: one record, history included."""
    user_id = path_user(request)
    record = await memory_admin(request).get_memory(user_id, request.match_info["id"])
    if record is None:
        raise NotFound("no such memory for this user", param="id")
    return json_response(record.public_dict())


async def edit_memory(request: web.Request) -> web.Response:
    """``PATCH .../memories/{id}``: the edited record (a new id when the text changed)."""
    user_id = path_user(request)
    edit = await read_body(request, MemoryEdit)
    admin, record_id = memory_admin(request), request.match_info["id"]
    record = await asyncio.shield(admin.edit(user_id, record_id, edit.text, edit.importance, edit.expires_at))
    if record is None:
        raise NotFound("no such memory for this user", param="id")
    audit(request, "edited", user_id, id=record_id, new_id=record.id)
    return json_response(record.public_dict())


async def delete_memory(request: web.Request) -> web.Response:
    """``DELETE .../memories/{id}``: gone from both indexes and the cache."""
    user_id, record_id = path_user(request), request.match_info["id"]
    if not await asyncio.shield(memory_admin(request).delete(user_id, record_id)):
        raise NotFound("no such memory for this user", param="id")
    audit(request, "deleted", user_id, id=record_id)
    return json_response({"id": record_id, "deleted": True})


async def forget_user(request: web.Request) -> web.Response:
    """``DELETE /v1/memory/users/{user_id}``: every trace of the user; counts by kind (and queued jobs)."""
    user_id = path_user(request)
    admin = memory_admin(request)
    started = time.perf_counter()
    counts = await asyncio.shield(admin.forget_user(user_id))
    seconds = time.perf_counter() - started
    records = sum(n for kind, n in counts.items() if kind in KINDS)
    audit(request, "forgotten", user_id, records=records, seconds=round(seconds, 3))
    return json_response({"user_id": user_id, "deleted": counts, "total": records, "seconds": round(seconds, 3)})


def _download_name(user_id: str) -> str:
    return "memories-" + re.sub(r"[^A-Za-z0-9._-]", "_", user_id) + ".jsonl"


async def export_user(request: web.Request) -> web.StreamResponse:
    """``GET .../export``: everything kept about the user, history included, one JSON object a line."""
    user_id = path_user(request)
    admin = memory_admin(request)
    response = web.StreamResponse(headers={
        "Content-Type": "application/x-ndjson; charset=utf-8",
        "Content-Disposition": f'attachment; filename="{_download_name(user_id)}"',
    })  # fmt: skip
    await response.prepare(request)
    chunk: list[bytes] = []
    size = 0
    async for line in admin.export_user(user_id):
        chunk.append(line.encode())
        size += len(chunk[-1])
        if size >= EXPORT_CHUNK_BYTES:
            await response.write(b"".join(chunk))
            chunk, size = [], 0
    await response.write(b"".join(chunk))
    await response.write_eof()
    audit(request, "exported", user_id)
    return response


async def search(request: web.Request) -> web.Response:
    """``POST .../search``: the ranked results, the arms that ran and the exact block that would be injected."""
    user_id = path_user(request)
    ask = await read_body(request, SearchRequest)
    preview = await memory_admin(request).search(user_id, ask.query, ask.k)
    return json_response({"results": preview.results, "arms": preview.arms, "injected_block": preview.injected_block})


# --- insights -----------------------------------------------------------------------------------------


async def list_insights(request: web.Request) -> web.Response:
    """``GET .../insights``: the user's current insights, newest first."""
    user_id, query = path_user(request), read_query(request, PageQuery)
    try:
        page = await memory_admin(request).list_memories(
            user_id, [Kind.INSIGHT], limit=query.limit, cursor=query.cursor
        )
    except ValueError as exc:
        raise BadRequest(f"cursor: {exc}", param="cursor", code="invalid_cursor") from None
    return json_response({"data": [insight_dict(record) for record in page.data], "next_cursor": page.next_cursor})


async def regenerate_insights(request: web.Request) -> web.Response:
    """``POST .../insights/regenerate``: queue a fresh insight run for the user (202)."""
    user_id = path_user(request)
    job_id = await asyncio.shield(memory_admin(request).regenerate_insights(user_id))
    audit(request, "insights_requested", user_id, job_id=job_id)
    return json_response({"job_id": job_id, "status": "queued"}, status=202)


# --- the API's document ------------------------------------------------------------------------------


def _openapi_handler(document: bytes) -> Handler:
    async def openapi(request: web.Request) -> web.Response:
        """``GET /v1/memory/openapi.json``: this API's OpenAPI 3.1 document."""
        return web.Response(body=document, content_type="application/json")

    return openapi


ROUTES: Mapping[tuple[str, str], Handler] = {
    ("GET", PREFIX + "/users"): list_users,
    ("GET", USER + "/memories"): list_memories,
    ("POST", USER + "/memories"): add_memory,
    ("GET", USER + "/memories/{id}"): get_memory,
    ("PATCH", USER + "/memories/{id}"): edit_memory,
    ("DELETE", USER + "/memories/{id}"): delete_memory,
    ("DELETE", USER): forget_user,
    ("GET", USER + "/export"): export_user,
    ("POST", USER + "/search"): search,
    ("GET", USER + "/insights"): list_insights,
    ("POST", USER + "/insights/regenerate"): regenerate_insights,
}


def add_management_routes(app: web.Application) -> None:
    """Register the management API under ``/v1/memory`` and the web page under ``/ui/``."""
    for (method, path), handler in ROUTES.items():
        app.router.add_route(method, path, admin_only(handler))
    app.router.add_get(PREFIX + "/openapi.json", admin_only(_openapi_handler(OPENAPI_PATH.read_bytes())))
    add_ui_routes(app)
