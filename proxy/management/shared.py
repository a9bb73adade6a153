"""What every management handler shares: the admin key, the user id in the path, bodies, answers and the audit line.

Every ``/v1/memory`` route is wrapped by ``admin_only`` (``Authorization: Bearer <admin key>``, compared in constant
time; 503 ``management_disabled`` when no key is configured). ``memory_admin`` is the memory engine's management seam
(``proxy.memory.service.MemoryAdmin``), or a 503 ``memory_disabled`` when memory is off. Bodies and query strings are
pydantic models; a refusal is an OpenAI-style 400 naming the field.
"""

from __future__ import annotations

import functools
import hmac
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Annotated, Any, TypeVar

import orjson
import structlog
from aiohttp import web
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    StringConstraints,
    TypeAdapter,
    ValidationError,
    field_validator,
)

from proxy.errors import BadRequest, ServiceUnavailable, Unauthorized
from proxy.identity import log_user
from proxy.memory import MemoryAdmin
from proxy.memory.store import APP_ID_RULE, valid_app_id
from proxy.state import STATE, AppState

log = structlog.get_logger("memproxy.management")

PREFIX = "/v1/memory"
USER = PREFIX + "/users/{user_id}"
MAX_TEXT_CHARS = 4000

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_M = TypeVar("_M", bound=BaseModel)
# Whitespace as the OpenAPI document's pattern spells it (JSON Schema patterns are ECMA-262 regexes, whose \s
# leaves out U+0085 and takes U+FEFF; pydantic strips Unicode White_Space, U+0085 included): one explicit class
# for both, so that a string of only these characters ("\x85", "\ufeff") is refused by the server exactly when
# the document calls it invalid.
NOT_WHITESPACE = r"[^\t\n\v\f\r \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000\ufeff]"
Text = Annotated[
    str,
    StringConstraints(strip_whitespace=True, min_length=1, max_length=MAX_TEXT_CHARS, pattern=NOT_WHITESPACE),
]


# --- request bodies and query strings -----------------------------------------------------------------


def _integral(value: Any) -> Any:
    """JSON numbers like ``3.0`` are integers (JSON Schema agrees); strings and ``3.5`` stay refused."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _no_null(value: Any) -> Any:
    """An optional field may be left out, not sent as ``null``."""
    if value is None:
        raise ValueError("leave the field out instead of sending null")
    return value


Count = Annotated[int, BeforeValidator(_integral)]


_DATETIME = TypeAdapter(datetime)


def _rfc3339(value: Any) -> datetime:
    """An ``expires_at``: an RFC 3339 date-time string, in UTC (without an offset: taken as UTC)."""
    if not isinstance(value, str) or not 1 <= len(value) <= 64:
        raise ValueError("not an RFC 3339 date-time")
    try:
        parsed = _DATETIME.validate_python(value)
        return parsed.replace(tzinfo=UTC) if parsed.tzinfo is None else parsed.astimezone(UTC)
    except (ValidationError, OverflowError):
        raise ValueError("not an RFC 3339 date-time") from None


Expiry = Annotated[datetime, BeforeValidator(_rfc3339)]  # ISO 8601 / RFC 3339 date-time


class Body(BaseModel):
    """A JSON request body: strict types, no unknown field, an optional field left out rather than null."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    @field_validator("*", mode="before")
    @classmethod
    def _present_means_not_null(cls, value: Any) -> Any:
        return _no_null(value)


def _invalid(exc: ValidationError, where: str) -> BadRequest:
    error = exc.errors(include_url=False)[0]
    field = ".".join(str(part) for part in error["loc"])
    message = str(error["msg"]).removeprefix("Value error, ")
    if not field:
        return BadRequest(f"{where}: {message}", code="invalid_request")
    return BadRequest(f"{field}: {message}", param=field, code="invalid_request")


async def read_body(request: web.Request, model: type[_M]) -> _M:
    """The request's JSON body as ``model``; a 400 naming the field otherwise."""
    raw = await request.read()
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        if exc.errors()[0]["type"] == "json_invalid":
            raise BadRequest("the request body is not valid JSON", code="invalid_json") from None
        raise _invalid(exc, "request body must be a JSON object") from None


def read_query(request: web.Request, model: type[_M]) -> _M:
    """The request's query string as ``model``; a 400 naming the parameter otherwise."""
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
    if scheme.lower() != "bearer" or not hmac.compare_digest(
        given.strip().encode("utf-8", "surrogateescape"), key.encode()
    ):
        raise Unauthorized("missing or wrong admin key: send the header Authorization: Bearer <admin key>")


def admin_only(handler: Handler) -> Handler:
    """Wrap a management handler with the admin key check."""

    @functools.wraps(handler)
    async def guarded(request: web.Request) -> web.StreamResponse:
        check_admin(_state(request), request.headers.get("Authorization"))
        return await handler(request)

    return guarded


def memory_admin(request: web.Request) -> MemoryAdmin:
    """The memory engine's management operations; 503 ``memory_disabled`` when memory is off."""
    admin = _state(request).memory.admin
    if admin is None:
        raise ServiceUnavailable("memory is disabled on this server (memory.enabled = false)", code="memory_disabled")
    return admin


def path_user(request: web.Request) -> str:
    """The ``{user_id}`` of the path, checked; a 400 ``invalid_user_id`` otherwise."""
    user_id = request.match_info["user_id"]
    if not valid_app_id(user_id):
        raise BadRequest(f"user_id must be {APP_ID_RULE}", param="user_id", code="invalid_user_id")
    return user_id


# --- answers ------------------------------------------------------------------------------------------


def json_response(data: Any, status: int = 200) -> web.Response:
    """``data`` as a JSON answer (numpy values and non-string keys allowed)."""
    body = orjson.dumps(data, option=orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS)
    return web.Response(status=status, body=body, content_type="application/json")


def audit(request: web.Request, action: str, user_id: str, **fields: Any) -> None:
    """One ``management.<action>`` log line, the user id as ``logging.user_ids`` says (hashed by default)."""
    how = _state(request).settings.logging.user_ids
    log.info("management." + action, user=log_user(user_id, how), **fields)
