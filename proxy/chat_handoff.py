"""A client's connection handed to the chat process that serves its user, rather than each request relayed.

The kernel gives each connection to any chat process (``chat_routing``). Relaying a request to its user's owner
costs the relaying process a second HTTP request and response (~0.85 ms of CPU a request, as much as the rest of
its part of the work) and the answer one more hop; a connection that carries one user's chats (an SDK in a
desktop app, a bench's one connection) paid it on every request. So a chat process hands the connection itself
over: it stops reading from it, sends the owner the socket (``SCM_RIGHTS`` over the owner's private
``chat-<index>.handoff.sock``) with the request as the client sent it (its head, its key included, and its body
as read, with its length), and once the owner has taken both it lets its own copy of the socket go, without a
word on it. The owner serves the request and every later one on that connection as if it had accepted it (the
request is its connection's first bytes, before anything read from the socket); a later request of another
user is handed on the same way.

No request is answered twice: the owner answers ``1`` once the request is its own, ``0`` if it will not take it
(the connection stays this process's: the request is relayed, or served here, as before); with the socket sent
and no answer (the owner died meanwhile), neither process serves it and the client sees the connection close,
as it does when the process serving it dies. A connection with a further request parsed already (pipelined
requests) is relayed instead.
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

from proxy.as_sent import as_sent

log = structlog.get_logger("memproxy.routing")

_LENGTH = struct.Struct("!Q")  # the request's bytes, before them
_FIRST = 64 * 2**10  # bytes sent with the socket, the rest after
_TAKEN, _REFUSED = b"1", b"0"  # the owner's answer: the request is its own, or still the sender's
_CONNECT_S = 1.0  # the owner's socket not accepting within this: relayed or served here
_TAKE_S = 10.0  # the owner waits this long for a request's bytes
_RETRY_S = 0.1  # after an accept failed (out of file descriptors, say)
# Headers the owner gets afresh: the body's framing (it comes as read, decompressed, with its length) and a
# 100-continue (answered here already, if at all)
_REFRAMED = frozenset({b"content-length", b"transfer-encoding", b"content-encoding", b"expect"})


def handoff_socket(directory: Path, index: int) -> Path:
    """Chat process ``index``'s socket for connections handed to it, in the supervisor's directory."""
    return directory / f"chat-{index}.handoff.sock"


def request_bytes(request: web.Request, body: bytes) -> bytes:
    """The request as the owner's parser should read it: its head as the client sent it (but the body's framing)
    and the body as read, with its length."""
    version = request.version
    lines = [f"{request.method} {request.raw_path} HTTP/{version.major}.{version.minor}".encode("latin-1")]
    sent = as_sent(request).raw_headers
    lines += [name + b": " + value for name, value in sent if name.lower() not in _REFRAMED]
    lines.append(b"Content-Length: " + str(len(body)).encode())
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def _handable(request: web.Request) -> socket.socket | None:
    """The request's socket, if its connection can be handed over: TCP, and no further request parsed."""
    transport, protocol = request.transport, request.protocol
    if transport is None or transport.is_closing() or not isinstance(transport.get_extra_info("peername"), tuple):
        return None
    parsed = getattr(protocol, "_messages", None)  # (aiohttp's requests parsed and not yet served)
    if parsed is None or parsed:
        return None  # (pipelined requests read already; or an aiohttp that keeps them elsewhere)
    sock = transport.get_extra_info("socket")
    return sock if sock is not None and hasattr(sock, "fileno") else None


async def hand_off(request: web.Request, body: bytes, path: Path) -> bool:
    """Hand the request's connection to the chat process listening on ``path``; True once the connection is not
    this process's any more (the owner took the request, or has the socket and did not say), False if it is
    still this process's to serve (it could not be handed, or the owner refused it)."""
    sock = _handable(request)
    transport = request.transport
    if sock is None or transport is None:
        return False
    loop = asyncio.get_running_loop()
    reading = getattr(transport, "is_reading", lambda: True)()
    transport.pause_reading()
    handed, answer = False, b""
    try:
        raw = request_bytes(request, body)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as channel:
            channel.setblocking(False)
            async with asyncio.timeout(_CONNECT_S):
                await loop.sock_connect(channel, str(path))
            # the length, then the request, sent from where they lie (not joined into one more copy)
            length, rest = _LENGTH.pack(len(raw)), memoryview(raw)
            sent = socket.send_fds(channel, [length, rest[:_FIRST]], [sock.fileno()])
            handed = True
            left: list[bytes | memoryview] = (
                [length[sent:], rest] if sent < len(length) else [rest[sent - len(length) :]]
            )
            with contextlib.suppress(OSError):  # (the owner stopped reading: its answer says why)
                for part in left:
                    if part:
                        await loop.sock_sendall(channel, part)
            answer = await loop.sock_recv(channel, 1)
    except (OSError, TimeoutError) as error:
        log.info("routing.handoff_failed", error=type(error).__name__, handed=handed)
    if answer == _TAKEN:
        transport.close()  # (the owner holds the socket: closing this copy sends nothing)
        return True
    if handed and answer != _REFUSED:  # the owner may have the request: it must not be answered here too
        log.warning("routing.handoff_unanswered")
        transport.close()
        return True
    if reading:
        transport.resume_reading()
    return False


class HandoffReceiver:
    """Takes the connections other chat processes hand to this one (``hand_off``) and serves them with
    ``protocol(request)`` (the server's, fed the handed request before anything read from the socket: as if this
    process had accepted the connection); ``aclose`` when done."""

    def __init__(self, path: Path, protocol: Callable[[bytes], asyncio.Protocol]) -> None:
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
        """Take every handoff waiting each time the listener is ready: one a wake-up left the others waiting a
        turn of a busy event loop each (the first requests of 32 connections handed at once waited up to 2 s)."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                channel, _ = await loop.sock_accept(listener)
                self._start(channel)
                while True:
                    try:
                        channel, _ = listener.accept()
                    except BlockingIOError:
                        break
                    self._start(channel)
            except OSError as error:  # (out of file descriptors, say: the senders wait, then serve it themselves)
                log.warning("routing.handoff_accept_failed", error=type(error).__name__)
                await asyncio.sleep(_RETRY_S)

    def _start(self, channel: socket.socket) -> None:
        channel.setblocking(False)
        task = asyncio.create_task(self._take(channel))
        self._taking.add(task)
        task.add_done_callback(self._taking.discard)

    async def _take(self, channel: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        fds: list[int] = []
        taken = False
        with channel:
            try:
                async with asyncio.timeout(_TAKE_S):
                    data, fds = await _received(loop, channel)
                    if len(fds) != 1 or len(data) < _LENGTH.size:
                        raise ValueError("no socket or no length")
                    (length,) = _LENGTH.unpack_from(data)
                    raw = bytearray(data[_LENGTH.size :])
                    while len(raw) < length:
                        more = await loop.sock_recv(channel, min(length - len(raw), 2**20))
                        if not more:
                            raise ValueError("cut short")
                        raw += more
                client = socket.socket(fileno=fds.pop())
                try:
                    protocol = self._protocol(bytes(raw))
                    await loop.connect_accepted_socket(lambda: protocol, client)
                except BaseException:
                    client.close()
                    raise
                taken = True  # the request is this process's now
                await loop.sock_sendall(channel, _TAKEN)
            except Exception as error:  # (not a cancellation: the process is stopping, the sender sees it go)
                log.info("routing.handoff_not_taken" if not taken else "routing.handoff_unacknowledged",
                         error=type(error).__name__)  # fmt: skip
                if not taken:
                    with contextlib.suppress(OSError):
                        channel.send(_REFUSED)
            finally:
                for fd in fds:
                    os.close(fd)


async def _received(loop: asyncio.AbstractEventLoop, channel: socket.socket) -> tuple[bytes, list[int]]:
    """The first bytes on ``channel`` and the file descriptor sent with them (waiting until they come)."""
    while True:
        try:
            data, fds, _, _ = socket.recv_fds(channel, _LENGTH.size + _FIRST, 1, socket.MSG_CMSG_CLOEXEC)
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
