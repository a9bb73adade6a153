"""The passthrough floor: the least an aiohttp relay can do (``floor`` target of ``make bench-load``).

Relays ``POST /v1/chat/completions`` byte for byte to the upstream over one pooled client session and streams
the answer back: no JSON parsing, no headers beyond the content type and the app's key, no logging, no
metrics. Whatever memproxy spends above this per request is the price of its features. Run as
``python -m bench.floor --upstream URL``; it prints ``floor relay on http://127.0.0.1:PORT/v1`` once listening.
"""

from __future__ import annotations

import argparse
import asyncio
import socket

import aiohttp
from aiohttp import web

UPSTREAM = web.AppKey("upstream", str)
SESSION = web.AppKey("session", aiohttp.ClientSession)


async def relay(request: web.Request) -> web.StreamResponse:
    """Send the body on as it came, stream the upstream's answer back as it comes."""
    data = await request.read()
    headers = {"Content-Type": "application/json", "Authorization": request.headers.get("Authorization", "")}
    async with request.app[SESSION].post(
        request.app[UPSTREAM] + "/chat/completions", data=data, headers=headers
    ) as upstream:
        response = web.StreamResponse(
            status=upstream.status, headers={"Content-Type": upstream.headers.get("Content-Type", "")}
        )
        await response.prepare(request)
        async for chunk in upstream.content.iter_any():
            await response.write(chunk)
        await response.write_eof()
        return response


async def _session(app: web.Application) -> object:
    app[SESSION] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    yield
    await app[SESSION].close()


async def serve(upstream: str) -> None:
    """Listen on a free loopback port until cancelled."""
    app = web.Application()
    app[UPSTREAM] = upstream.rstrip("/")
    app.cleanup_ctx.append(_session)
    app.router.add_post("/v1/chat/completions", relay)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    site = web.SockSite(runner, sock)
    await site.start()
    print(f"floor relay on http://127.0.0.1:{sock.getsockname()[1]}/v1", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


def main() -> None:
    """Run the relay."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--upstream", required=True, help="the upstream's base URL (ending in /v1)")
    args = parser.parse_args()
    asyncio.run(serve(args.upstream))


if __name__ == "__main__":
    main()
