"""Bounded work per request: checks that run on a chat request before anything expensive sees it.

- ``check_json_depth``: JSON nested deeper than ``MAX_JSON_DEPTH`` is a 400, found by a vectorised scan of the
  raw bytes before the body is parsed, so that no recursive walk (ours, orjson's, litellm's) ever meets it.
- ``reject_duplicate_headers``: two ``X-Memory-User`` (or ``-Conversation``, ``-Mode``) headers are a 400, not
  "the first one wins" (a proxy in front may have added one, the client another).
- ``capped_turn``: a stored turn keeps at most ``max_chars`` characters. Longer text is *truncated with a
  marker*, not chunked: the head (most of the budget) and the tail (where a long paste usually ends with the
  actual question) are kept around ``[... N characters not stored ...]``. Chunking would turn one 8 MB paste
  into hundreds of records, embeddings and index entries (a storage and CPU amplification any client could
  trigger), and the embedding model reads only the first few hundred tokens of a record anyway.
- ``body_deadline_middleware``: a request body must arrive within ``server.body_timeout_s``; a body sent at
  1 byte/s is cut off with a 408 instead of holding a connection and a buffer open for hours. A body that cannot
  be read as sent (a ``Content-Encoding: gzip`` that does not decompress, a broken chunked encoding) is a 400
  ``malformed_request``, and the connection is closed (aiohttp would otherwise read the rest of it again).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping

import numpy as np
from aiohttp import web
from multidict import CIMultiDictProxy

from proxy.errors import BadRequest, PayloadTooLarge, ProxyError
from proxy.identity import CONVERSATION_HEADER, MODE_HEADER, USER_HEADER
from proxy.memory import cap_text
from proxy.paths import is_relayed

MAX_JSON_DEPTH = 64
MAX_TURN_CHARS = 16_000
_BRACKETS = {ord("["): 1, ord("{"): 1, ord("]"): -1, ord("}"): -1}
_KEEP = bytes(sorted({*_BRACKETS, ord('"')}))
_DROP = bytes(b for b in range(256) if b not in _KEEP)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class RequestTimeout(ProxyError):
    """The request body did not arrive in time (408)."""

    status = 408
    type = "invalid_request_error"
    code = "request_timeout"


def json_depth(raw: bytes) -> int:
    """The deepest nesting of arrays and objects in a JSON text (brackets inside strings do not count)."""
    # Escaped backslashes first (pairs, left to right, as JSON reads them), then escaped quotes: every quote
    # left delimits a string. Then only quotes and brackets are kept, and numpy does the counting.
    stripped = raw.replace(b"\\\\", b"").replace(b'\\"', b"").translate(None, _DROP)
    if not stripped:
        return 0
    codes = np.frombuffer(stripped, dtype=np.uint8)
    quote = codes == ord('"')
    outside = (np.cumsum(quote) - quote) % 2 == 0  # not inside a string (the quote itself excluded)
    step = np.zeros(len(codes), dtype=np.int32)
    step[codes == ord("[")] = 1
    step[codes == ord("{")] = 1
    step[codes == ord("]")] = -1
    step[codes == ord("}")] = -1
    step[~outside | quote] = 0
    return int(np.cumsum(step).max(initial=0))


def check_json_depth(raw: bytes, limit: int = MAX_JSON_DEPTH) -> None:
    """``BadRequest`` if the body nests arrays/objects deeper than ``limit``."""
    if raw.count(b"[") + raw.count(b"{") <= limit:  # cannot be too deep: skip the scan
        return
    depth = json_depth(raw)
    if depth > limit:
        raise BadRequest(f"request body nests JSON {depth} levels deep; the limit is {limit}", code="json_too_deep")


def reject_duplicate_headers(headers: CIMultiDictProxy[str] | Mapping[str, str]) -> None:
    """``BadRequest`` if a memory identity header appears more than once."""
    getall = getattr(headers, "getall", None)
    if getall is None:
        return
    for name in (USER_HEADER, CONVERSATION_HEADER, MODE_HEADER):
        if len(getall(name, ())) > 1:
            raise BadRequest(f"{name} appears more than once; send it once", param=name, code="duplicate_header")


def capped_turn(text: str, max_chars: int = MAX_TURN_CHARS) -> str:
    """``text`` if it fits in ``max_chars``; else its head and tail around a marker saying what was cut."""
    return cap_text(text, max_chars)


def _unreadable(request: web.Request, exc: web.RequestPayloadError) -> BadRequest:
    """The 400 for a body that cannot be decoded; its connection closes after the answer (nothing more of the
    body is read: aiohttp's own read of the rest would raise the same error again, as a traceback)."""
    request.content.feed_eof()
    request.protocol.close()
    cause = exc.__cause__ or exc
    encoding = request.headers.get("Content-Encoding")
    what = f"Content-Encoding {encoding[:20]!r}" if encoding else "its transfer encoding"
    return BadRequest(
        f"the request body could not be decoded as {what} ({type(cause).__name__})", code="malformed_request"
    )


def body_deadline_middleware(timeout_s: float, max_bytes: int) -> Callable[..., Awaitable[web.StreamResponse]]:
    """A middleware that reads each request body within ``timeout_s`` (408 otherwise) before the handler runs."""

    @web.middleware
    async def read_body_in_time(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.body_exists and not is_relayed(request.path):  # relayed bodies stream (proxy.passthrough)
            try:
                # no timer armed when all of it came with the headers (nothing to wait for)
                async with asyncio.timeout(None if request.content.is_eof() else timeout_s):
                    await request.read()  # kept by aiohttp: the handler's own read returns it at once
            except TimeoutError:
                raise RequestTimeout(f"the request body did not arrive within {timeout_s:g} s") from None
            except web.HTTPRequestEntityTooLarge:
                raise PayloadTooLarge(f"request body exceeds the limit of {max_bytes} bytes") from None
            except web.RequestPayloadError as exc:
                raise _unreadable(request, exc) from None
        return await handler(request)

    return read_body_in_time
