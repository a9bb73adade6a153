"""A client's connection handed to the chat process that serves its user, rather than each request relayed.

The kernel gives each connection to any chat process (``chat_routing``). Relaying a request to its user's owner
costs the relaying process a second HTTP request and response (~0.85 ms of CPU a request, as much as the rest of
its part of the work) and the answer one more hop; a connection that carries one user's chats (an SDK in a
desktop app, a bench's one connection) paid it on every request. So a chat process hands the connection itself
over: it stops reading from it, sends the owner the socket (``SCM_RIGHTS`` over the owner's private
``chat-<index>.handoff.sock``) with the request as it came (its head, and its body as read, with its length),
and once the owner has taken both it lets its own copy of the socket go, without a word on it. The owner serves
the request and every later one on that connection as if it had accepted it; a later request of another user is
handed on the same way.

Nothing is lost or answered twice: the client waits for its answer, so nothing else can arrive before the owner
reads the socket; a connection with bytes of a further request read already (pipelined requests) is relayed
instead; the owner acknowledges only after the request is its own, and until then the connection stays this
process's (if the owner is away or fails to take it, the request is relayed or served here as before). Once
handed, a request whose owner then dies is lost with the connection (the client sees it close), as a request
to any process that dies is.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import struct
from collections.abc import Callable
from pathlib import Path

import structlog
from aiohttp import web

log = structlog.get_logger("memproxy.routing")

_LENGTH = struct.Struct("!Q")  # the request's bytes, before them
_FIRST = 64 * 2**10  # bytes sent with the socket, the rest after
_TAKEN = b"1"  # the owner's acknowledgement: the request is its own
# Headers the owner gets afresh: the body's framing (it comes as read, decompressed, with its length) and a
# 100-continue (answered here already, if at all)
_REFRAMED = frozenset({b"content-length", b"transfer-encoding", b"content-encoding", b"expect"})


def handoff_socket(directory: Path, index: int) -> Path:
    """Chat process ``index``'s socket for connections handed to it, in the supervisor's directory."""
    return directory / f"chat-{index}.handoff.sock"


def request_bytes(request: web.Request, body: bytes) -> bytes:
    """The request as the owner's parser should read it: its head as it came (but the body's framing) and the
    body as read, with its length."""
    version = request.version
    lines = [f"{request.method} {request.raw_path} HTTP/{version.major}.{version.minor}".encode("latin-1")]
    lines += [name + b": " + value for name, value in request.raw_headers if name.lower() not in _REFRAMED]
    lines.append(b"Content-Length: " + str(len(body)).encode())
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def _handable(request: web.Request) -> socket.socket | None:
    """The request's socket, if its connection can be handed over: TCP, and nothing of a further request read."""
    transport, protocol = request.transport, request.protocol
    if transport is None or transport.is_closing() or not isinstance(transport.get_extra_info("peername"), tuple):
        return None
    parsed = getattr(protocol, "_messages", None)  # (aiohttp's requests parsed and not yet served)
    if parsed is None or parsed:
        return None  # (pipelined requests read already; or an aiohttp that keeps them elsewhere)
    sock = transport.get_extra_info("socket")
    return sock if sock is not None and hasattr(sock, "fileno") else None


async def hand_off(request: web.Request, body: bytes, path: Path) -> bool:
    """Hand the request's connection to the chat process listening on ``path``; True once it has taken it (this
    process then lets the connection go), False if it cannot be handed or the owner did not take it (the
    connection is still this process's)."""
    sock = _handable(request)
    transport = request.transport
    if sock is None or transport is None:
        return False
    loop = asyncio.get_running_loop()
    transport.pause_reading()
    taken = False
    try:
        payload = _LENGTH.pack(len(raw := request_bytes(request, body))) + raw
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as channel:
            channel.setblocking(False)
            await loop.sock_connect(channel, str(path))
            socket.send_fds(channel, [payload[:_FIRST]], [sock.fileno()])
            await loop.sock_sendall(channel, payload[_FIRST:])
            taken = await loop.sock_recv(channel, 1) == _TAKEN
    except OSError as error:
        log.info("routing.handoff_failed", error=type(error).__name__)
    if not taken:
        transport.resume_reading()
        return False
    transport.close()  # (the owner holds the socket: closing this copy sends nothing)
    return True


class HandoffReceiver:
    """Takes the connections other chat processes hand to this one (``hand_off``) and serves them with
    ``protocol`` (the server's: as if this process had accepted them); ``aclose`` when done."""

    def __init__(self, path: Path, protocol: Callable[[], asyncio.Protocol]) -> None:
        self.path = path
        self._protocol = protocol
        self._listener: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._taking: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()  # a process of the same index before this one
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(self.path))
        os.chmod(self.path, 0o600)
        listener.listen(128)
        listener.setblocking(False)
        self._listener = listener
        self._accepting = asyncio.create_task(self._accept(listener))

    async def aclose(self) -> None:
        tasks = [t for t in (self._accepting, *self._taking) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._listener is not None:
            self._listener.close()
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()

    async def _accept(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            channel, _ = await loop.sock_accept(listener)
            task = asyncio.create_task(self._take(channel))
            self._taking.add(task)
            task.add_done_callback(self._taking.discard)

    async def _take(self, channel: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        fds: list[int] = []
        with channel:
            try:
                channel.setblocking(False)
                data, fds = await _received(loop, channel)
                if len(fds) != 1 or len(data) < _LENGTH.size:
                    return
                (length,) = _LENGTH.unpack_from(data)
                raw = bytearray(data[_LENGTH.size :])
                while len(raw) < length:
                    more = await loop.sock_recv(channel, min(length - len(raw), 2**20))
                    if not more:
                        return
                    raw += more
                client = socket.socket(fileno=fds.pop())
                protocol = self._protocol()
                try:
                    await loop.connect_accepted_socket(lambda: protocol, client)
                except BaseException:
                    client.close()
                    raise
                protocol.data_received(bytes(raw))  # the request is this process's now
                await loop.sock_sendall(channel, _TAKEN)
            except OSError as error:
                log.info("routing.handoff_not_taken", error=type(error).__name__)
            finally:
                for fd in fds:
                    os.close(fd)


async def _received(loop: asyncio.AbstractEventLoop, channel: socket.socket) -> tuple[bytes, list[int]]:
    """The first bytes on ``channel`` and the file descriptor sent with them (waiting until they come)."""
    while True:
        try:
            data, fds, _, _ = socket.recv_fds(channel, _LENGTH.size + _FIRST, 1)
            return data, fds
        except BlockingIOError:
            ready: asyncio.Future[None] = loop.create_future()
            loop.add_reader(channel.fileno(), _settle, ready)
            try:
                await ready
            finally:
                loop.remove_reader(channel.fileno())


def _settle(ready: asyncio.Future[None]) -> None:
    if not ready.done():
        ready.set_result(None)
