"""A chat process's management API, MCP endpoint and web page: relayed to the memory writer process.

In ``memproxy serve``'s process model the writer owns every write to the store and the queue, so the management
API (``/v1/memory``), ``/mcp`` and ``/ui`` are served by the writer's own copy of the app on its private socket
(``mirror.MEMORY_SOCKET``); a chat process relays each request there as it came (the writer applies the same
access rules) and streams the answer back. While the writer restarts, these answer 503 ``memory_unavailable``.
"""

from __future__ import annotations

from pathlib import Path

import aiohttp
import orjson
from aiohttp import web

from proxy.mirror import MEMORY_SOCKET

MEMORY_PATHS = ("/v1/memory", "/v1/memory/{tail:.*}", "/mcp", "/mcp/{tail:.*}", "/ui", "/ui/{tail:.*}")
HOP = frozenset({"connection", "keep-alive", "transfer-encoding", "host", "content-length"})
# A request's headers not passed on: those and its Content-Encoding (aiohttp's server hands the body over
# decompressed, so the header would make the other process decompress it again: a 400)
REQUEST_HOP = HOP | {"content-encoding"}
_SESSION: web.AppKey[aiohttp.ClientSession] = web.AppKey("memory_relay_session", aiohttp.ClientSession)
UNAVAILABLE = orjson.dumps(
    {"error": {"message": "memory management is restarting; try again shortly", "type": "server_error",
               "param": None, "code": "memory_unavailable"}}
)  # fmt: skip


def add_memory_relay(app: web.Application, directory: Path) -> None:
    """Relay the management API, MCP and the web page to the writer at ``directory``."""

    async def session(app: web.Application):  # type: ignore[no-untyped-def]
        app[_SESSION] = relay_session(aiohttp.UnixConnector(path=str(directory / MEMORY_SOCKET)))
        yield
        await app[_SESSION].close()

    app.cleanup_ctx.append(session)
    for path in MEMORY_PATHS:
        app.router.add_route("*", path, relay)


def relay_session(connector: aiohttp.UnixConnector) -> aiohttp.ClientSession:
    """A session that relays requests to another memproxy process as they came: no timeout of its own, no
    cookies kept, no header aiohttp would add (the other process sees the client's), the answer's bytes as they
    were sent (``auto_decompress`` off: ``stream_back`` passes them on with their ``Content-Length``)."""
    return aiohttp.ClientSession(
        connector=connector,
        timeout=aiohttp.ClientTimeout(total=None),
        cookie_jar=aiohttp.DummyCookieJar(),
        auto_decompress=False,
        skip_auto_headers=("Accept", "Accept-Encoding", "User-Agent"),
    )


async def relay(request: web.Request) -> web.StreamResponse:
    """One request to the writer's app, the answer streamed back."""
    headers = {k: v for k, v in request.headers.items() if k.lower() not in REQUEST_HOP}
    headers["X-Forwarded-For"] = request.remote or ""
    body = await request.read() if request.body_exists else None  # bounded by server.max_body_bytes
    try:
        async with request.app[_SESSION].request(
            request.method, f"http://memory{request.rel_url}", headers=headers, data=body, allow_redirects=False
        ) as upstream:
            return await stream_back(request, upstream)
    except (aiohttp.ClientConnectionError, FileNotFoundError, ConnectionRefusedError):
        return web.Response(status=503, body=UNAVAILABLE, content_type="application/json")


async def stream_back(request: web.Request, upstream: aiohttp.ClientResponse) -> web.StreamResponse:
    """Another process's answer to ``request``, streamed back as it comes (hop-by-hop headers left out; its
    ``Content-Length`` kept: the session passes the bytes as they came, ``auto_decompress`` off)."""
    response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
    for key, value in upstream.headers.items():
        if key.lower() not in HOP:
            response.headers.add(key, value)
    if upstream.content_length is not None and "chunked" not in upstream.headers.get("Transfer-Encoding", ""):
        response.content_length = upstream.content_length
    await response.prepare(request)
    async for chunk in upstream.content.iter_any():
        await response.write(chunk)
    await response.write_eof()
    return response


async def writer_metrics(app: web.Application) -> bytes:
    """The writer's Prometheus text (its queue, storage and memory-side numbers), b"" while it is away."""
    try:
        async with app[_SESSION].get("http://memory/metrics?collectors=only") as response:
            return await response.read() if response.status == 200 else b""
    except (aiohttp.ClientConnectionError, FileNotFoundError, ConnectionRefusedError):
        return b""


def merged_metrics(own: bytes, writer: bytes) -> bytes:
    """``own`` (a chat process's exposition) with the writer's components' families (``writer``: its collectors
    only; counters and histograms are summed over every process in ``own`` already): a family ``own`` lacks
    whole, and for one both have, the writer's samples labelled ``process="writer"`` after the chat process's."""
    mine, theirs = _families(own.decode()), _families(writer.decode(errors="replace"))
    out: list[str] = []
    for name, lines in mine.items():
        out += lines
        if name in theirs:
            out += [_labelled(line) for line in theirs[name] if not line.startswith("#")]
    for name, lines in theirs.items():
        if name not in mine:
            out += lines
    return ("\n".join(out) + "\n").encode()


def _families(text: str) -> dict[str, list[str]]:
    """Exposition lines by family (a family starts at its ``# HELP`` line)."""
    families: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        if line.startswith("# HELP "):
            current = families.setdefault(line.split()[2], [])
        if current is not None and line:
            current.append(line)
    return families


def _labelled(sample: str) -> str:
    name, brace, rest = sample.partition("{")
    if brace:
        return f'{name}{{process="writer",{rest}'
    name, _, value = sample.partition(" ")
    return f'{name}{{process="writer"}} {value}'


__all__ = ["add_memory_relay", "merged_metrics", "relay", "relay_session", "writer_metrics"]
