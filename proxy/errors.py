"""Errors the HTTP shell reports, rendered as OpenAI error JSON by one middleware.

``ProxyError`` is the root: every subclass knows its HTTP status and OpenAI ``type``/``code``. Handlers raise
them; ``error_middleware`` turns them (and anything unexpected, without a traceback in the body) into
``{"error": {"message", "type", "param", "code"}}``. A fault of the data directory's disk (read-only, full) that
reaches it is a 503 ``storage_unavailable`` naming the fault, not a 500. Once an SSE stream has started, errors are
sent as a final event instead (``sse_error_event``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import orjson
import structlog
from aiohttp import web

from proxy.memory.store import fault_reason, is_storage_fault

log = structlog.get_logger("memproxy.errors")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class ProxyError(Exception):
    """An error with an HTTP status and an OpenAI-style body."""

    status = 500
    type = "server_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code

    def body(self) -> dict[str, object]:
        """The OpenAI error object."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class BadRequest(ProxyError):
    """The request is malformed (400)."""

    status = 400
    type = "invalid_request_error"


class Unauthorized(ProxyError):
    """Missing or wrong credentials (401)."""

    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"


class Forbidden(ProxyError):
    """A browser origin that is not allowed (403)."""

    status = 403
    type = "invalid_request_error"
    code = "origin_not_allowed"


class UnsupportedMediaType(ProxyError):
    """A chat request whose body is not declared as JSON (415)."""

    status = 415
    type = "invalid_request_error"
    code = "unsupported_media_type"


class MisdirectedRequest(ProxyError):
    """A ``Host`` this server is not pinned to (421)."""

    status = 421
    type = "invalid_request_error"
    code = "host_not_allowed"


class NotFound(ProxyError):
    """No such route or record (404)."""

    status = 404
    type = "invalid_request_error"
    code = "not_found"


class PayloadTooLarge(ProxyError):
    """The body exceeds ``server.max_body_bytes`` (413)."""

    status = 413
    type = "invalid_request_error"
    code = "request_too_large"


class ServiceUnavailable(ProxyError):
    """A component this route needs is off or not ready (503)."""

    status = 503
    type = "server_error"
    code = "unavailable"


class UpstreamUnreachable(ProxyError):
    """The upstream refused or dropped the connection (502)."""

    status = 502
    type = "upstream_error"
    code = "upstream_unreachable"


class UpstreamTimeout(ProxyError):
    """The upstream did not answer in time (504)."""

    status = 504
    type = "upstream_error"
    code = "upstream_timeout"


class UpstreamStatusError(ProxyError):
    """The upstream answered with an error status; its status and body are relayed as they were."""

    def __init__(self, status: int, body: bytes, content_type: str) -> None:
        super().__init__(f"upstream returned HTTP {status}")
        self.status = status
        self.raw_body = body
        self.content_type = content_type


def error_response(exc: ProxyError) -> web.Response:
    """The HTTP response for ``exc``."""
    if isinstance(exc, UpstreamStatusError):
        return _relayed(exc)
    return web.Response(status=exc.status, body=orjson.dumps(exc.body()), content_type="application/json")


def _relayed(exc: UpstreamStatusError) -> web.Response:
    try:
        parsed = orjson.loads(exc.raw_body)
    except orjson.JSONDecodeError:
        parsed = None
    if isinstance(parsed, dict) and isinstance(parsed.get("error"), dict):
        return web.Response(status=exc.status, body=exc.raw_body, content_type="application/json")
    message = exc.raw_body.decode("utf-8", "replace")[:2000] or exc.message
    wrapped = ProxyError(message)
    wrapped.type = "upstream_error"
    return web.Response(status=exc.status, body=orjson.dumps(wrapped.body()), content_type="application/json")


def sse_error_event(exc: ProxyError) -> bytes:
    """A final SSE event carrying ``exc`` for a stream that has already started."""
    return b"data: " + orjson.dumps(exc.body()) + b"\n\n"


# Anthropic's error types by status (its API reference, "Errors").
ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    529: "overloaded_error",
}
ANTHROPIC_PATHS = ("/v1/messages", "/messages")


def anthropic_body(exc: ProxyError) -> dict[str, object]:
    """``exc`` in Anthropic's error shape: ``{"type": "error", "error": {"type", "message"}}``."""
    return {"type": "error", "error": {"type": ANTHROPIC_TYPES.get(exc.status, "api_error"), "message": exc.message}}


def stream_error_event(dialect: str, exc: ProxyError) -> bytes:
    """The final event of a started stream that failed, in the dialect's own shape."""
    if dialect == "messages":
        return b"event: error\ndata: " + orjson.dumps(anthropic_body(exc)) + b"\n\n"
    if dialect == "responses":
        body = {"type": "error", "code": exc.code, "message": exc.message, "param": exc.param}
        return b"event: error\ndata: " + orjson.dumps(body) + b"\n\n"
    return sse_error_event(exc)


def anthropic_error_response(exc: ProxyError) -> web.Response:
    """The response for ``exc`` on Anthropic's paths: memproxy's own errors in Anthropic's shape; an upstream's
    Anthropic-shaped error relayed as it came, any other upstream error re-shaped."""
    if isinstance(exc, UpstreamStatusError):
        parsed = _parsed(exc.raw_body)
        if isinstance(parsed, dict) and parsed.get("type") == "error":
            return web.Response(status=exc.status, body=exc.raw_body, content_type="application/json")
        message = exc.raw_body.decode("utf-8", "replace")[:2000] or exc.message
        if isinstance(parsed, dict) and isinstance(parsed.get("error"), dict):
            message = str(parsed["error"].get("message") or message)
        status, exc = exc.status, ProxyError(message)
        exc.status = status
    return web.Response(status=exc.status, body=orjson.dumps(anthropic_body(exc)), content_type="application/json")


def _parsed(raw: bytes) -> object:
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None


def _render(request: web.Request, exc: ProxyError) -> web.Response:
    if request.path.startswith(ANTHROPIC_PATHS):
        return anthropic_error_response(exc)
    return error_response(exc)


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Render every error as OpenAI error JSON; never leak a traceback to the client."""
    try:
        return await handler(request)
    except ProxyError as exc:
        return _render(request, exc)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        err = NotFound(exc.reason) if exc.status == 404 else BadRequest(exc.reason)
        err.status = exc.status
        response = _render(request, err)
        if "Allow" in exc.headers:  # a 405 must say which methods are allowed
            response.headers["Allow"] = exc.headers["Allow"]
        return response
    except Exception as exc:
        if is_storage_fault(exc):
            return _render(request, storage_unavailable(exc))
        log.exception("request.unhandled", path=request.path)
        return _render(request, ProxyError("internal error in memproxy; see its logs"))


def storage_unavailable(exc: BaseException) -> ServiceUnavailable:
    """The 503 for a write the data directory refused (read-only, full...), naming the fault."""
    reason = fault_reason(exc)
    log.warning("request.storage_unavailable", reason=reason)
    return ServiceUnavailable(
        f"memory storage is failing ({reason}): retry when it recovers",
        code="storage_unavailable",
    )
