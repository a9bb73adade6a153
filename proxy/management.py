"""The memory management API under ``/v1/memory`` and the web page at ``/ui/``.

Operators and users see, correct, export and erase what memproxy keeps. Every ``/v1/memory`` route needs
``Authorization: Bearer <admin key>`` (``admin.api_key``, compared in constant time); with no key configured
the API is off and answers 503. Handlers are thin: they check the key, the user id and the body (pydantic),
then call the memory engine (``state.memory``) and its store; with memory disabled they answer 503
``memory_disabled``. Every read and delete is scoped to the user id in the path. The OpenAPI document
(``proxy/openapi.json``) describes exactly these routes (a test checks both ways).
"""

from __future__ import annotations

import asyncio
import builtins
import functools
import hmac
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, Protocol, TypeVar, cast

import orjson
import structlog
from aiohttp import web
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    field_validator,
    model_validator,
)

from proxy.errors import BadRequest, NotFound, ServiceUnavailable, Unauthorized
from proxy.identity import log_user
from proxy.memory.store.ids import APP_ID_RULE, valid_app_id
from proxy.memory.store.records import Kind, MemoryRecord
from proxy.state import STATE, AppState

log = structlog.get_logger("memproxy.management")

PREFIX = "/v1/memory"
USER = PREFIX + "/users/{user_id}"
PACKAGE_DIR = Path(__file__).resolve().parent
OPENAPI_PATH = PACKAGE_DIR / "openapi.json"
WEB_DIR = PACKAGE_DIR / "web"
WEB_FILES = {"app.js": "application/javascript", "style.css": "text/css"}
WEB_HEADERS = {
    "Cache-Control": "no-cache",
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}
MAX_TEXT_CHARS = 4000
EXPORT_CHUNK_BYTES = 64 * 1024
KINDS = frozenset(str(kind) for kind in Kind)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_M = TypeVar("_M", bound=BaseModel)
Text = Annotated[str, StringConstraints(strip_whitespace=True, min_length=1, max_length=MAX_TEXT_CHARS)]


class Preview(Protocol):
    """What the engine's ``search`` returns (``proxy.engine.SearchPreview``)."""

    @property
    def results(self) -> list[dict[str, Any]]: ...

    @property
    def arms(self) -> list[str]: ...

    @property
    def injected_block(self) -> str: ...


class Page(Protocol):
    """A page of records (``proxy.memory.store.reads.Page``)."""

    @property
    def data(self) -> list[MemoryRecord]: ...

    @property
    def next_cursor(self) -> str | None: ...


class AdminStore(Protocol):
    """The store reads the management API makes (``proxy.memory.store.memory_store.MemoryStore``)."""

    async def get(self, user_id: str, id: str) -> MemoryRecord | None: ...

    async def list(self, user_id: str, kinds: Sequence[Kind] | None = None, *, limit: int = 50,
                   cursor: str | None = None, include_invalid: bool = False) -> Page: ...

    def export(self, user_id: str) -> AsyncIterator[str]: ...

    async def user_ids(self) -> builtins.list[str]: ...  # ``list`` is the method above in this scope


class ManagedMemory(Protocol):
    """The memory engine as the management API uses it (``proxy.engine.MemoryEngine``)."""

    @property
    def store(self) -> AdminStore: ...

    async def search(self, user_id: str, query: str, k: int = 10) -> Preview: ...

    async def add_fact(self, user_id: str, text: str, importance: int | None = None,
                       category: str | None = None) -> MemoryRecord: ...

    async def edit(self, user_id: str, id: str, text: str | None = None,
                   importance: int | None = None) -> MemoryRecord | None: ...

    async def delete(self, user_id: str, id: str) -> bool: ...

    async def forget_user(self, user_id: str) -> dict[str, int]: ...

    async def regenerate_insights(self, user_id: str) -> str: ...


# --- request models -----------------------------------------------------------------------------------


def _integral(value: Any) -> Any:
    """JSON numbers like ``3.0`` are integers (JSON Schema agrees); strings and ``3.5`` stay refused."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _no_null(value: Any) -> Any:
    """An optional field may be left out, not sent as ``null``."""
    if value is None:
        raise ValueError("leave the field out instead of sending null")
    return value


Count = Annotated[int, BeforeValidator(_integral)]


class _Body(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    @field_validator("*", mode="before")
    @classmethod
    def _present_means_not_null(cls, value: Any) -> Any:
        return _no_null(value)


class NewMemory(_Body):
    """``POST .../memories``: a fact written by an operator."""

    text: Text
    kind: Literal["fact"] = "fact"
    importance: Count | None = Field(None, ge=1, le=10)
    category: str | None = Field(None, min_length=1, max_length=40, pattern=r"^[a-z_]+$")


class MemoryEdit(_Body):
    """``PATCH .../memories/{id}``: new text (re-embedded; the old version stays in history) or importance."""

    text: Text | None = None
    importance: Count | None = Field(None, ge=1, le=10)

    @model_validator(mode="after")
    def _something(self) -> MemoryEdit:
        if self.text is None and self.importance is None:
            raise ValueError("give text or importance")
        return self


class SearchRequest(_Body):
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


def _invalid(exc: ValidationError, where: str) -> BadRequest:
    error = exc.errors(include_url=False)[0]
    field = ".".join(str(part) for part in error["loc"])
    message = str(error["msg"]).removeprefix("Value error, ")
    if not field:
        return BadRequest(f"{where}: {message}", code="invalid_request")
    return BadRequest(f"{field}: {message}", param=field, code="invalid_request")


async def _body(request: web.Request, model: type[_M]) -> _M:
    raw = await request.read()
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        if exc.errors()[0]["type"] == "json_invalid":
            raise BadRequest("the request body is not valid JSON", code="invalid_json") from None
        raise _invalid(exc, "request body must be a JSON object") from None


def _query(request: web.Request, model: type[_M]) -> _M:
    try:
        return model.model_validate(dict(request.query))
    except ValidationError as exc:
        raise _invalid(exc, "query") from None


# --- guards -------------------------------------------------------------------------------------------


def _state(request: web.Request) -> AppState:
    return request.config_dict[STATE]


def check_admin(state: AppState, authorization: str | None) -> None:
    """Raise unless ``authorization`` carries the configured admin key (or 503 when none is configured)."""
    key = state.settings.admin.api_key.get_secret_value()
    if not key:
        raise ServiceUnavailable(
            "the management API is off: set admin.api_key (env MEMPROXY_ADMIN__API_KEY) to turn it on",
            code="management_disabled",
        )
    scheme, _, given = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), key.encode()):
        raise Unauthorized("missing or wrong admin key: send the header Authorization: Bearer <admin key>")


def admin_only(handler: Handler) -> Handler:
    """Wrap a management handler with the admin key check."""

    @functools.wraps(handler)
    async def guarded(request: web.Request) -> web.StreamResponse:
        check_admin(_state(request), request.headers.get("Authorization"))
        return await handler(request)

    return guarded


def _memory(request: web.Request) -> ManagedMemory:
    memory = _state(request).memory
    if getattr(memory, "store", None) is None:
        raise ServiceUnavailable("memory is disabled on this server (memory.enabled = false)",
                                 code="memory_disabled")
    return cast(ManagedMemory, memory)


def _user(request: web.Request) -> str:
    user_id = request.match_info["user_id"]
    if not valid_app_id(user_id):
        raise BadRequest(f"user_id must be {APP_ID_RULE}",
                         param="user_id", code="invalid_user_id")
    return user_id


def _json(data: Any, status: int = 200) -> web.Response:
    body = orjson.dumps(data, option=orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS)
    return web.Response(status=status, body=body, content_type="application/json")


def _audit(request: web.Request, action: str, user_id: str, **fields: Any) -> None:
    how = _state(request).settings.logging.user_ids
    log.info("management." + action, user=log_user(user_id, how), **fields)


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
    query = _query(request, PageQuery)
    users = sorted(await _memory(request).store.user_ids())
    if query.cursor is not None:
        users = [user for user in users if user > query.cursor]
    page = users[: query.limit]
    next_cursor = page[-1] if len(users) > len(page) else None
    return _json({"data": [{"user_id": user} for user in page], "next_cursor": next_cursor})


async def list_memories(request: web.Request) -> web.Response:
    """``GET .../memories``: the user's records, newest first."""
    user_id, query = _user(request), _query(request, ListQuery)
    store = _memory(request).store
    kinds = [query.kind] if query.kind is not None else None
    try:
        page = await store.list(user_id, kinds, limit=query.limit, cursor=query.cursor,
                                include_invalid=query.include_invalid)
    except ValueError as exc:
        raise BadRequest(f"cursor: {exc}", param="cursor", code="invalid_cursor") from None
    return _json({"data": [record.public_dict() for record in page.data], "next_cursor": page.next_cursor})


async def add_memory(request: web.Request) -> web.Response:
    """``POST .../memories``: a new fact, embedded and indexed before the answer."""
    user_id = _user(request)
    new = await _body(request, NewMemory)
    memory = _memory(request)
    record = await asyncio.shield(memory.add_fact(user_id, new.text, new.importance, new.category))
    _audit(request, "added", user_id, id=record.id)
    return _json(record.public_dict(), status=201)


async def get_memory(request: web.Request) -> web.Response:
    """``GET .../memories/{id}``: one record, history included."""
    user_id = _user(request)
    record = await _memory(request).store.get(user_id, request.match_info["id"])
    if record is None:
        raise NotFound("no such memory for this user", param="id")
    return _json(record.public_dict())


async def edit_memory(request: web.Request) -> web.Response:
    """``PATCH .../memories/{id}``: the edited record (a new id when the text changed)."""
    user_id = _user(request)
    edit = await _body(request, MemoryEdit)
    memory, record_id = _memory(request), request.match_info["id"]
    record = await asyncio.shield(memory.edit(user_id, record_id, edit.text, edit.importance))
    if record is None:
        raise NotFound("no such memory for this user", param="id")
    _audit(request, "edited", user_id, id=record_id, new_id=record.id)
    return _json(record.public_dict())


async def delete_memory(request: web.Request) -> web.Response:
    """``DELETE .../memories/{id}``: gone from both indexes and the cache."""
    user_id, record_id = _user(request), request.match_info["id"]
    if not await asyncio.shield(_memory(request).delete(user_id, record_id)):
        raise NotFound("no such memory for this user", param="id")
    _audit(request, "deleted", user_id, id=record_id)
    return _json({"id": record_id, "deleted": True})


async def forget_user(request: web.Request) -> web.Response:
    """``DELETE /v1/memory/users/{user_id}``: every trace of the user; counts by kind (and queued jobs)."""
    user_id = _user(request)
    memory = _memory(request)
    started = time.perf_counter()
    counts = await asyncio.shield(memory.forget_user(user_id))
    seconds = time.perf_counter() - started
    records = sum(n for kind, n in counts.items() if kind in KINDS)
    _audit(request, "forgotten", user_id, records=records, seconds=round(seconds, 3))
    return _json({"user_id": user_id, "deleted": counts, "total": records, "seconds": round(seconds, 3)})


def _download_name(user_id: str) -> str:
    return "memories-" + re.sub(r"[^A-Za-z0-9._-]", "_", user_id) + ".jsonl"


async def export_user(request: web.Request) -> web.StreamResponse:
    """``GET .../export``: everything kept about the user, history included, one JSON object a line."""
    user_id = _user(request)
    store = _memory(request).store
    response = web.StreamResponse(headers={
        "Content-Type": "application/x-ndjson; charset=utf-8",
        "Content-Disposition": f'attachment; filename="{_download_name(user_id)}"',
    })  # fmt: skip
    await response.prepare(request)
    chunk: list[bytes] = []
    size = 0
    async for line in store.export(user_id):
        chunk.append(line.encode())
        size += len(chunk[-1])
        if size >= EXPORT_CHUNK_BYTES:
            await response.write(b"".join(chunk))
            chunk, size = [], 0
    await response.write(b"".join(chunk))
    await response.write_eof()
    _audit(request, "exported", user_id)
    return response


async def search(request: web.Request) -> web.Response:
    """``POST .../search``: the ranked results, the arms that ran and the exact block that would be injected."""
    user_id = _user(request)
    ask = await _body(request, SearchRequest)
    preview = await _memory(request).search(user_id, ask.query, ask.k)
    return _json({"results": preview.results, "arms": preview.arms, "injected_block": preview.injected_block})


# --- insights -----------------------------------------------------------------------------------------


async def list_insights(request: web.Request) -> web.Response:
    """``GET .../insights``: the user's current insights, newest first."""
    user_id, query = _user(request), _query(request, PageQuery)
    try:
        page = await _memory(request).store.list(user_id, [Kind.INSIGHT], limit=query.limit, cursor=query.cursor)
    except ValueError as exc:
        raise BadRequest(f"cursor: {exc}", param="cursor", code="invalid_cursor") from None
    return _json({"data": [insight_dict(record) for record in page.data], "next_cursor": page.next_cursor})


async def regenerate_insights(request: web.Request) -> web.Response:
    """``POST .../insights/regenerate``: queue a fresh insight run for the user (202)."""
    user_id = _user(request)
    job_id = await asyncio.shield(_memory(request).regenerate_insights(user_id))
    _audit(request, "insights_requested", user_id, job_id=job_id)
    return _json({"job_id": job_id, "status": "queued"}, status=202)


# --- documents and the web page -----------------------------------------------------------------------


def _openapi_handler(document: bytes) -> Handler:
    async def openapi(request: web.Request) -> web.Response:
        """``GET /v1/memory/openapi.json``: this API's OpenAPI 3.1 document."""
        return web.Response(body=document, content_type="application/json")

    return openapi


async def ui_redirect(request: web.Request) -> web.StreamResponse:
    """``GET /ui``: to ``/ui/``."""
    raise web.HTTPPermanentRedirect("/ui/")


def _ui_handler(web_dir: Path) -> Handler:
    files = {name: (web_dir / name).read_bytes() for name in ("index.html", *WEB_FILES)}

    async def ui_file(request: web.Request) -> web.Response:
        """``GET /ui/`` and its two assets; nothing else under ``/ui/`` exists."""
        name = request.match_info.get("name") or "index.html"
        if name not in files:
            raise NotFound("no such file")
        return web.Response(body=files[name], content_type=WEB_FILES.get(name, "text/html"), charset="utf-8",
                            headers=WEB_HEADERS)

    return ui_file


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
    ui_file = _ui_handler(WEB_DIR)
    app.router.add_get("/ui", ui_redirect)
    app.router.add_get("/ui/", ui_file)
    app.router.add_get("/ui/{name}", ui_file)
