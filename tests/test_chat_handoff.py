"""Handing a client's connection to another chat process (``proxy.chat_handoff``), over real sockets in one loop:
taken, the owner answers it and the connection's later requests; refused or unreachable, the request stays
where it arrived; sent and never answered, neither side answers it."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import struct
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from proxy.chat_handoff import HandoffReceiver, hand_off
from proxy.server import AppRunner


async def _front(path: Path) -> tuple[web.AppRunner, str]:
    """A server that hands each request to ``path`` and answers it itself when that fails."""

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        if await hand_off(request, body, path):
            return web.Response()  # never sent
        return web.Response(text=f"front:{body.decode()}")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}/v1/chat/completions"


async def _owner_app(path: Path) -> tuple[web.AppRunner, HandoffReceiver]:
    """The owner's server (memproxy's runner), taking handed connections on ``path``."""

    async def chat(request: web.Request) -> web.Response:
        return web.Response(text=f"owner:{(await request.read()).decode()}")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner = AppRunner(app)
    await runner.setup()
    receiver = HandoffReceiver(path, runner.server.primed)  # type: ignore[union-attr]
    await receiver.start()
    return runner, receiver


@contextlib.contextmanager
def _fake_owner(path: Path, behave: Callable[[socket.socket], None]) -> Iterator[None]:
    """A Unix listener on ``path`` that takes each handoff's connection and ``behave``s (in a thread)."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(8)

    def serve() -> None:
        while True:
            try:
                channel, _ = listener.accept()
            except OSError:
                return
            with channel:
                behave(channel)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield
    finally:
        listener.shutdown(socket.SHUT_RDWR)
        listener.close()
        thread.join(5)
        path.unlink()


async def _posts(url: str, bodies: list[str]) -> list[str]:
    """``bodies`` posted one after another on one kept-alive connection."""
    out = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as session:
        for body in bodies:
            async with session.post(url, data=body.encode()) as response:
                out.append(await response.text())
    return out


def test_a_taken_connection_is_answered_by_the_owner_from_then_on(tmp_path: Path) -> None:
    path = tmp_path / "owner.sock"

    async def scenario() -> list[str]:
        owner, receiver = await _owner_app(path)
        front, url = await _front(path)
        try:
            return await _posts(url, ["one", "two" * 50_000, "three"])
        finally:
            await receiver.aclose()
            await front.cleanup()
            await owner.cleanup()

    assert asyncio.run(scenario()) == ["owner:one", "owner:" + "two" * 50_000, "owner:three"]


def test_refused_or_unreachable_the_request_is_served_where_it_arrived(tmp_path: Path) -> None:
    path = tmp_path / "owner.sock"

    def refuse(channel: socket.socket) -> None:
        _, fds, _, _ = socket.recv_fds(channel, 2**16, 1)
        for fd in fds:
            os.close(fd)
        channel.send(b"0")

    async def scenario() -> tuple[list[str], list[str]]:
        front, url = await _front(path)
        try:
            unreachable = await _posts(url, ["a", "b"])  # nothing listens on the owner's socket
            with _fake_owner(path, refuse):
                refused = await _posts(url, ["c", "d"])
            return unreachable, refused
        finally:
            await front.cleanup()

    assert asyncio.run(scenario()) == (["front:a", "front:b"], ["front:c", "front:d"])


def test_a_socket_sent_and_never_answered_is_answered_by_neither(tmp_path: Path) -> None:
    """The owner has the socket and dies before saying whether it took the request: the front lets the
    connection go rather than answer a request the owner may be answering."""
    path = tmp_path / "owner.sock"

    def vanish(channel: socket.socket) -> None:
        data, fds, _, _ = socket.recv_fds(channel, 2**16, 1)
        assert struct.unpack_from("!Q", data)[0] > 0
        for fd in fds:
            os.close(fd)

    async def scenario() -> None:
        front, url = await _front(path)
        try:
            with _fake_owner(path, vanish), pytest.raises(aiohttp.ServerDisconnectedError):
                await _posts(url, ["lost"])
        finally:
            await front.cleanup()

    asyncio.run(scenario())
