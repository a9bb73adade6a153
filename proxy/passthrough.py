"""Every other API path, relayed as it is: embeddings, completions, audio, images, files, uploads, batches,
moderations, ``/v1/responses/{id}`` and its sub-paths, Anthropic's ``/v1/messages/count_tokens``, ...

No memory: the method, the path under the upstream's base URL, the query and the body go through, and the answer
comes back, both streamed chunk by chunk (an upload or an audio file is never held whole in memory). The
client's key is replaced by the configured one when there is one; hop-by-hop headers and memproxy's own stay
here. The body limit (``server.max_body_bytes``) and deadline (``server.body_timeout_s``) still hold. Anthropic's
paths go to ``upstream.anthropic_base_url``; with translation on, ``count_tokens`` is answered here from the
same token estimate as the memory budget.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Mapping

import orjson
import structlog
from aiohttp import web

from proxy.bounds import RequestTimeout
from proxy.dialects.anthropic_upstream import AnthropicUpstream
from proxy.dialects.messages import MESSAGES, view_messages
from proxy.errors import PayloadTooLarge, ProxyError, ServiceUnavailable
from proxy.memory.read import estimate_tokens
from proxy.state import STATE
from proxy.upstream import map_client_errors

log = structlog.get_logger("memproxy.request")

CHUNK = 64 * 1024
# Request headers that stay here: hop-by-hop ones, the client's credentials (replaced), memproxy's own, cookies.
_DROPPED_REQUEST = frozenset(
    {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer", "trailers",
     "transfer-encoding", "upgrade", "host", "authorization", "x-api-key", "cookie", "origin", "referer",
     "accept-encoding", "x-memory-user", "x-memory-conversation", "x-memory-mode"}
)  # fmt: skip
# Response headers that stay there (the body is re-chunked and already decompressed by the client session).
_DROPPED_RESPONSE = frozenset(
    {"connection", "keep-alive", "transfer-encoding", "content-length", "content-encoding", "set-cookie", "server",
     "date", "upgrade"}
)  # fmt: skip


def _request_headers(headers: Mapping[str, str]) -> dict[str, str]:
    return {name: value for name, value in headers.items() if name.lower() not in _DROPPED_REQUEST}


class _Body:
    """The request body as it arrives, cut off past ``limit`` bytes or ``timeout_s`` seconds; the refusal is kept
    (``failure``) because the client session reports it as its own connection error."""

    def __init__(self, request: web.Request, limit: int, timeout_s: float) -> None:
        if request.content_length is not None and request.content_length > limit:
            raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
        self._request, self._limit, self._timeout_s = request, limit, timeout_s
        self.failure: ProxyError | None = None

    async def chunks(self) -> AsyncIterator[bytes]:
        """The chunks, as the upstream request sends them."""
        deadline, seen = time.monotonic() + self._timeout_s, 0
        while True:
            try:
                async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                    chunk = await self._request.content.readany()
            except TimeoutError:
                self.failure = RequestTimeout(f"the request body did not arrive within {self._timeout_s:g} s")
                raise self.failure from None
            if not chunk:
                return
            seen += len(chunk)
            if seen > self._limit:
                self.failure = PayloadTooLarge(f"request body exceeds the limit of {self._limit} bytes")
                raise self.failure
            yield chunk


async def relay(request: web.Request, url: str, auth: Mapping[str, str]) -> web.StreamResponse:
    """``request`` sent to ``url`` with ``auth``; the answer streamed back."""
    state = request.app[STATE]
    server = state.settings.server
    headers = {**_request_headers(request.headers), **auth}
    body = _Body(request, server.max_body_bytes, server.body_timeout_s) if request.body_exists else None
    session = state.router.default.session
    try:
        with map_client_errors():
            data = body.chunks() if body is not None else None
            async with session.request(request.method, url, params=request.query, data=data, headers=headers) as reply:
                out = {k: v for k, v in reply.headers.items() if k.lower() not in _DROPPED_RESPONSE}
                response = web.StreamResponse(status=reply.status, headers=out)
                await response.prepare(request)
                async for chunk in reply.content.iter_chunked(CHUNK):
                    await response.write(chunk)
                await response.write_eof()
    except ProxyError:
        if body is not None and body.failure is not None:  # the client's body, not the upstream, failed
            raise body.failure from None
        raise
    state.metrics.requests.labels("relay", str(reply.status)).inc()
    log.info("request.relayed", method=request.method, path=request.path, status=reply.status)
    return response


async def openai_path(request: web.Request) -> web.StreamResponse:
    """``/v1/{path}``: relayed to the default upstream (``<base_url>/{path}``)."""
    upstream = request.app[STATE].router.default
    tail = request.path.removeprefix("/v1")
    return await relay(request, upstream.base_url + tail, upstream.auth(request.headers))


async def anthropic_path(request: web.Request) -> web.StreamResponse:
    """``/v1/messages/{path}`` (``count_tokens``, batches): relayed to Anthropic; with translation on,
    ``count_tokens`` is estimated here and the rest is a 503 naming the setting."""
    targets = request.app[STATE].targets
    anthropic: AnthropicUpstream | None = targets.anthropic
    if anthropic is not None:
        headers = anthropic.headers(request.headers, json=False)
        auth = {k: v for k, v in headers.items() if k.lower() in ("x-api-key", "authorization", "anthropic-version")}
        return await relay(request, anthropic.base_url + request.path, auth)
    if request.path.endswith("/count_tokens") and request.method == "POST":
        return count_tokens_estimate(MESSAGES.parse(await request.read()))
    raise ServiceUnavailable(
        f"{request.path} needs Anthropic's API: set upstream.anthropic_base_url (MEMPROXY_UPSTREAM__ANTHROPIC_BASE_URL)"
    )


def count_tokens_estimate(body: Mapping[str, object]) -> web.Response:
    """``{"input_tokens": N}`` from memproxy's token estimate (an upper bound of common tokenizers)."""
    messages, _ = view_messages(body)
    tokens = sum(estimate_tokens(str(m.get("content") or "")) + 4 for m in messages)
    return web.Response(body=orjson.dumps({"input_tokens": tokens}), content_type="application/json")
