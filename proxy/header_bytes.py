"""Header values as bytes: a request whose header is not UTF-8 is answered, never a 500.

aiohttp decodes header values with ``surrogateescape``: a byte that is not UTF-8 becomes a lone surrogate, and
the first ``encode()`` of it (a key hash, a cloned request, a log line, a header sent upstream) raises. So before
anything reads a header, ``header_bytes_middleware`` looks at the raw bytes (ASCII is the quick path):

- a header memproxy reads (``READ_HEADERS``) that is not UTF-8 is a 400 ``invalid_header`` naming it;
- ``X-Request-Id`` (only echoed and logged) is kept with its bad bytes escaped (``\\xff``);
- any other header that is not UTF-8 is ignored: the handlers see the request without it.

The refusal is a ``ProxyError`` raised inside the error middleware, which renders it (in the route's dialect).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web
from multidict import CIMultiDict

from proxy.errors import BadRequest
from proxy.identity import CONVERSATION_HEADER, MODE_HEADER, USER_HEADER
from proxy.logs import escaped

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
REQUEST_ID_HEADER = "X-Request-Id"
# Every request header whose value memproxy (or aiohttp for it) interprets.
READ_HEADERS = frozenset(
    name.lower()
    for name in (
        "Authorization", "X-Api-Key", USER_HEADER, CONVERSATION_HEADER, MODE_HEADER, "Host", "Origin",
        "Content-Type", "Content-Encoding", "Content-Length", "Transfer-Encoding", "Access-Control-Request-Headers",
        "Access-Control-Request-Method", "Anthropic-Version", "Anthropic-Beta",
    )
)  # fmt: skip


def _utf8(raw: bytes) -> bool:
    if raw.isascii():
        return True
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def undecodable(raw_headers: tuple[tuple[bytes, bytes], ...]) -> list[str]:
    """The names (lower case) of the headers whose value is not UTF-8, in order."""
    return [name.decode("latin-1").lower() for name, value in raw_headers if not _utf8(value)]


def _cleaned(request: web.Request, bad: list[str]) -> web.Request:
    headers = CIMultiDict[str]()
    for name, value in request.headers.items():
        if name.lower() not in bad:
            headers.add(name, value)
        elif name.lower() == REQUEST_ID_HEADER.lower():
            headers.add(name, escaped(value))
    return request.clone(headers=headers)


@web.middleware
async def header_bytes_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """A 400 for a read header that is not UTF-8; other such headers escaped or dropped (see the module doc)."""
    bad = undecodable(request.raw_headers)
    if not bad:
        return await handler(request)
    read = next((name for name in bad if name in READ_HEADERS), None)
    if read is not None:
        shown = next(k for k in request.headers if k.lower() == read)
        raise BadRequest(f"header {shown} is not valid UTF-8", param=shown, code="invalid_header")
    return await handler(_cleaned(request, bad))


def install_header_check(app: web.Application) -> None:
    """Add the check right after the error middleware (before access checks and everything reading headers)."""
    app.middlewares.insert(1, header_bytes_middleware)
