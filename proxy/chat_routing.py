"""Each user's chats served by one chat process: the one that holds that user's read-side state.

In ``memproxy serve``'s process model the kernel hands each connection to any chat process, and one connection
carries the requests of many users (an app's connection pool). Each chat process keeps per-user state the read
path needs: the vector cache, the read caches, the memory each conversation already carries (the prompt-cache
placement: a conversation whose requests alternated between processes got a new block, and lost the provider's
cached prefix, at every switch) and the Responses chains. So a request is served by its user's owner
(``owner_of``: a stable hash of the user id over the chat processes). Another chat process hands the client's
connection itself to the owner (``chat_handoff``), which serves that request and the connection's next ones as if
it had accepted it; where a connection cannot be handed (pipelined requests, a Unix socket) or the owner does
not take it, the request is relayed there as it came, over the owner's private socket (``chat-<index>.sock``), and
the answer streamed back unchanged. Each user's state is then held once, not once per process, and a user's
requests all see it.

A relayed request carries ``X-Memproxy-Routed``, which makes the owner serve it itself; the header is accepted
only on the private socket (from a client it is ignored). If the owner cannot be reached (it is restarting:
nothing listens on its socket), the request is served where it arrived, with that process's colder state.
If the owner dies while serving it, the request fails (503, as it would have had it reached that process
directly): the owner may have stored the exchange already, and serving it again would store it twice. Each
relay opens its own connection, so no pooled connection to a process that has since died is ever reused (kept-alive
connections measured no cheaper: the relaying process spent ~0.85 ms of CPU a relayed request either way, about
what ``bench/floor.py``'s whole relay costs). The request goes with the client's headers and none of aiohttp's;
the answer's bytes come back as they were sent (``auto_decompress`` off), with their ``Content-Length``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

import aiohttp
import structlog
from aiohttp import web

from proxy.as_sent import as_sent
from proxy.chat_handoff import hand_off, handoff_socket
from proxy.errors import ServiceUnavailable
from proxy.relay_memory import REQUEST_HOP, relay_session, stream_back

log = structlog.get_logger("memproxy.routing")

ROUTED_HEADER = "X-Memproxy-Routed"
_REQUEST_HOP = REQUEST_HOP - {"host"}  # the owner checks the client's Host (``server.allowed_hosts``) as it came


def owner_of(user_id: str, processes: int) -> int:
    """The chat process (index) that serves ``user_id``'s requests, the same in every process and restart."""
    digest = hashlib.blake2b(user_id.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big") % processes


def chat_socket(directory: Path, index: int) -> Path:
    """Chat process ``index``'s private socket in the supervisor's directory."""
    return directory / f"chat-{index}.sock"


def routed_here(request: web.Request) -> bool:
    """Whether another chat process relayed this request here (only believed on the private socket)."""
    return ROUTED_HEADER in request.headers and request.transport is not None and _on_unix_socket(request)


def _on_unix_socket(request: web.Request) -> bool:
    sockname = request.transport.get_extra_info("sockname") if request.transport is not None else None
    return isinstance(sockname, str)  # a Unix socket's name is its path; a TCP one's is (host, port)


class ChatRouter:
    """Relays requests to their users' chat processes; ``aclose`` when done."""

    def __init__(self, directory: Path, index: int, processes: int) -> None:
        self.directory = directory
        self.index = index
        self.processes = processes
        self._sessions: dict[int, aiohttp.ClientSession] = {}
        # Told of each relay ("relayed") and each that found nobody there ("owner_unreachable"):
        # ``memproxy_routing_relayed_total`` / ``memproxy_routing_owner_unreachable_total``, summed over the processes
        self.observe: Callable[[str], object] | None = None

    def _observed(self, outcome: str) -> None:
        if self.observe is not None:
            self.observe(outcome)

    async def aclose(self) -> None:
        """Close the connections to the other chat processes."""
        for session in self._sessions.values():
            await session.close()
        self._sessions.clear()

    def owner(self, request: web.Request, user_id: str | None) -> int | None:
        """The other chat process that should serve this request, or None to serve it here."""
        if user_id is None or self.processes < 2 or routed_here(request):
            return None
        owner = owner_of(user_id, self.processes)
        return None if owner == self.index else owner

    def _session(self, owner: int) -> aiohttp.ClientSession:
        session = self._sessions.get(owner)
        if session is None or session.closed:
            connector = aiohttp.UnixConnector(path=str(chat_socket(self.directory, owner)), force_close=True)
            session = self._sessions[owner] = relay_session(connector)
        return session

    async def hand_off(self, request: web.Request, body: bytes, owner: int) -> bool:
        """Hand the request's connection to the owner (``chat_handoff``); True once it has taken it, False if the
        request is still to be relayed (or served) here."""
        if not await hand_off(request, body, handoff_socket(self.directory, owner)):
            return False
        self._observed("handed_off")
        return True

    async def relay(self, request: web.Request, body: bytes, owner: int) -> web.StreamResponse | None:
        """The owner's answer to the request, streamed back as it comes; None if the owner cannot be reached
        (serve it here)."""
        sent = as_sent(request).headers  # (with the client's key: the owner checks it again)
        headers = {k: v for k, v in sent.items() if k.lower() not in _REQUEST_HOP}
        headers[ROUTED_HEADER] = str(self.index)
        if request.remote:
            headers.setdefault("X-Forwarded-For", request.remote)
        try:
            upstream = await self._session(owner).request(
                request.method, f"http://chat{request.rel_url}", headers=headers, data=body, allow_redirects=False
            )
        except (aiohttp.ClientConnectorError, FileNotFoundError, ConnectionRefusedError) as error:
            self._observed("owner_unreachable")
            log.info("routing.owner_unreachable", owner=owner, error=type(error).__name__)
            return None
        except aiohttp.ClientConnectionError as error:  # it took the request, then went away
            log.warning("routing.owner_lost", owner=owner, error=type(error).__name__, detail=str(error))
            raise ServiceUnavailable("the process serving this user stopped; try again", code="restarting") from None
        async with upstream:
            self._observed("relayed")
            return await stream_back(request, upstream)
