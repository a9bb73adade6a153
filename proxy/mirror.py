"""The link between the memory writer process and the chat processes of ``memproxy serve`` (``proxy.supervisor``).

The writer owns the store's writes, the Tantivy writer and the job queue; each chat process reads the same store
through a follower's view (``MemoryStore(follower=True)``) with caches of its own. Over a Unix socket in the
supervisor's private directory (``writer.sock``, reachable by this user only):

* ``GET /_memproxy/changes``: the writer's stream of what it applied to its own vector cache (records added or
  changed, with their vectors and word pieces; access times; deletions; users dropped), each commit of its keyword
  index, each user whose memories were edited or deleted (their read caches and what their conversations carry go)
  and each user whose query adapter was refitted. Frames: a 4-byte length, then a pickle (both ends are the same
  program, spawned by the same supervisor; nothing else can reach the socket). A chat process applies each op to its
  own caches, so a new memory is searchable there as soon as the writer committed it. A chat process that falls too
  far behind (``MAX_BACKLOG`` frames) is cut off; on every (re)connection it empties its caches (it may have missed
  ops) and sends everything below again. A management change (``settled``) ends with a ``sync`` frame that
  every chat process acknowledges (``POST /_memproxy/synced``) once it applied what came before it: the change
  answers only when every chat process reads it (a memory deleted over MCP is gone from the very next chat,
  whichever process serves it), or after ``SETTLE_S`` if one is too slow to say so (logged).
* ``POST /_memproxy/chats``: each user's latest chat (model, route and, where the chat passes the client's key on,
  that key), batched every ``PUSH_S``. Keys stay in memory in both processes; a writer that restarts (recycled
  or killed) gets them all again from every chat process when the stream reconnects, so jobs waiting for a key
  resume without waiting for the user's next chat.
* ``POST /_memproxy/touches``: the memories each request sent (their access times) and which of them are young
  (``MemoryStore.young_of``: the chat process caches the user, the writer does not), batched every ``TOUCH_S``.

Exchanges do not go through the link: a chat process commits them to the job queue's SQLite file itself
(durably, before its reply's end goes out), so an answered exchange is stored whether or not the writer is up.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pickle
import struct
import time
from collections.abc import Awaitable, Callable, Collection, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import structlog
from aiohttp import web
from pydantic import SecretStr

from proxy.memory.store import MemoryStore
from proxy.memory.write import JobQueue, LatestChats

log = structlog.get_logger("memproxy.mirror")

WRITER_SOCKET = "writer.sock"
MEMORY_SOCKET = "memory.sock"  # the writer's own copy of the app: the management API and MCP, relayed to it
MAX_BACKLOG = 50_000  # frames waiting for one chat process before it is cut off (it reconnects and resyncs)
PUSH_S = 0.05
TOUCH_S = 1.0
SHARED_QUEUE_WATCH_S = 0.02  # how often the writer looks for the chat processes' enqueues
SETTLE_S = 5.0  # how long a management change waits for every chat process to have applied it
_LENGTH = struct.Struct("!I")


def _frame(op: str, args: tuple[Any, ...]) -> bytes:
    body = pickle.dumps((op, args), protocol=pickle.HIGHEST_PROTOCOL)
    return _LENGTH.pack(len(body)) + body


class Mirror:
    """The writer's side: every write it applies to its caches, sent to each connected chat process."""

    def __init__(self) -> None:
        self._subscribers: dict[int, asyncio.Queue[bytes | None]] = {}
        self.generation = f"{os.getpid()}-{time.time_ns()}"
        self.sent = 0
        self.cut_off = 0
        self.unsettled = 0  # management changes answered before every chat process had applied them
        self._syncs: dict[int, tuple[set[int], asyncio.Future[None]]] = {}
        self._sync_seq = 0

    def emit(self, op: str, args: tuple[Any, ...]) -> None:
        """Send one op to every chat process (a pickle made once, whoever listens)."""
        if not self._subscribers:
            return
        frame = _frame(op, args)
        for key, queue in list(self._subscribers.items()):
            if queue.qsize() >= MAX_BACKLOG:
                self.cut_off += 1
                log.warning("mirror.follower_cut_off", backlog=queue.qsize())
                del self._subscribers[key]
                queue.put_nowait(None)
                self._gone(key)  # it empties its caches when it reconnects: nothing stale to wait for
                continue
            queue.put_nowait(frame)
        self.sent += 1

    def gauges(self) -> dict[str, float]:
        """Management changes answered before every chat process had applied them (``settled`` timed out), and
        chat processes cut off for falling behind."""
        return {"unsettled_total": float(self.unsettled), "followers_cut_off_total": float(self.cut_off)}

    async def settled(self, timeout_s: float = SETTLE_S) -> bool:
        """Wait until every chat process following now has applied every op sent before this call (each
        acknowledges a ``sync`` frame, ``acknowledged``); False if one had not within ``timeout_s``."""
        if not self._subscribers:
            return True
        self._sync_seq += 1
        token = self._sync_seq
        waiting = set(self._subscribers)
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._syncs[token] = (waiting, done)
        try:
            self.emit("sync", (token,))
            waiting &= set(self._subscribers)  # any cut off by this very frame
            if waiting:
                await asyncio.wait_for(done, timeout_s)
            return True
        except TimeoutError:
            self.unsettled += 1
            log.warning("mirror.change_unsettled", followers=len(waiting), timeout_s=timeout_s)
            return False
        finally:
            self._syncs.pop(token, None)

    def acknowledged(self, subscriber: int, token: int) -> None:
        """Chat process ``subscriber`` applied every op up to ``sync`` frame ``token``."""
        entry = self._syncs.get(token)
        if entry is not None:
            self._settle(entry, subscriber)

    def _gone(self, subscriber: int) -> None:
        for entry in list(self._syncs.values()):
            self._settle(entry, subscriber)

    @staticmethod
    def _settle(entry: tuple[set[int], asyncio.Future[None]], subscriber: int) -> None:
        waiting, done = entry
        waiting.discard(subscriber)
        if not waiting and not done.done():
            done.set_result(None)

    def close(self) -> None:
        """End every stream (the writer stops)."""
        for queue in self._subscribers.values():
            queue.put_nowait(None)
        self._subscribers.clear()

    async def stream(self, request: web.Request) -> web.StreamResponse:
        """``GET /_memproxy/changes``: a hello, then every op from now on."""
        response = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
        await response.prepare(request)
        queue: asyncio.Queue[bytes | None] = asyncio.Queue()
        key = id(queue)
        self._subscribers[key] = queue
        try:
            await response.write(_frame("hello", (self.generation, key)))
            while (frame := await queue.get()) is not None:
                chunk = [frame]
                while not queue.empty() and len(chunk) < 256:  # one write for what piled up meanwhile
                    item = queue.get_nowait()
                    if item is None:
                        return response
                    chunk.append(item)
                await response.write(b"".join(chunk))
        finally:
            self._subscribers.pop(key, None)
            self._gone(key)
        return response


def writer_routes(
    app: web.Application, mirror: Mirror, latest: LatestChats, jobs: JobQueue, store: MemoryStore
) -> None:
    """The writer's end of the link (on its private socket)."""

    async def chats(request: web.Request) -> web.Response:
        for user_id, model, route, key in orjson.loads(await request.read()):
            if latest.remember(user_id, model, route, SecretStr(key) if key else None):
                await jobs.resume_waiting(user_id)
        return web.Response(status=204)

    async def touches(request: web.Request) -> web.Response:
        for user_id, ids, at, young in orjson.loads(await request.read()):
            await store.touch(user_id, ids, datetime.fromisoformat(at), young)
        return web.Response(status=204)

    async def synced(request: web.Request) -> web.Response:
        subscriber, token = orjson.loads(await request.read())
        mirror.acknowledged(int(subscriber), int(token))
        return web.Response(status=204)

    app.router.add_get("/_memproxy/changes", mirror.stream)
    app.router.add_post("/_memproxy/chats", chats)
    app.router.add_post("/_memproxy/touches", touches)
    app.router.add_post("/_memproxy/synced", synced)


class WriterLink:
    """A chat process's side: follows the writer's changes, and sends it chats and access times."""

    def __init__(
        self,
        directory: Path,
        store: MemoryStore,
        latest: LatestChats,
        on_changed: Callable[[str, str], object],
        on_resync: Callable[[], Awaitable[None]],
    ) -> None:
        self._path = directory / WRITER_SOCKET
        self._store = store
        self._latest = latest
        self._on_changed = on_changed
        self._on_resync = on_resync
        self._session: aiohttp.ClientSession | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._chats: dict[str, tuple[str, str, str | None]] = {}
        self._touches: list[tuple[str, list[str], str, list[str]]] = []
        self._pushed = asyncio.Event()
        self.connected = False
        self._followed = asyncio.Event()  # set at the first connection
        self._acks: set[asyncio.Task[None]] = set()
        self._subscriber = 0  # the writer's name for this process's stream
        self.generation: str | None = None
        self.resyncs = 0

    async def __aenter__(self) -> WriterLink:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.UnixConnector(path=str(self._path)), timeout=aiohttp.ClientTimeout(total=None)
        )
        self._tasks = [asyncio.create_task(self._follow()), asyncio.create_task(self._push())]
        return self

    async def __aexit__(self, *exc: object) -> None:
        tasks = [*self._tasks, *self._acks]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        with contextlib.suppress(Exception):
            await self._flush()  # the last access times and chats, if the writer is there
        if self._session is not None:
            await self._session.close()

    async def wait_connected(self, timeout_s: float) -> bool:
        """Whether the writer's stream is followed within ``timeout_s``."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._followed.wait(), timeout_s)
        return self.connected

    def note_chat(self, user_id: str, model: str, route: str, key: SecretStr | None) -> None:
        """A user's latest chat, for the writer's memory-side calls (sent within ``PUSH_S``)."""
        self._chats[user_id] = (model, route, key.get_secret_value() if key is not None else None)
        self._pushed.set()

    def note_touch(self, user_id: str, ids: Sequence[str], at: datetime, young: Collection[str]) -> None:
        """Memories a request sent, and which of them are young (``MemoryStore.young_of``; sent within
        ``TOUCH_S``)."""
        self._touches.append((user_id, list(ids), at.isoformat(), sorted(young)))

    async def _follow(self) -> None:
        pause = 0.05
        while True:
            try:
                await self._follow_once()
                pause = 0.05
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the writer is restarting (or not up yet): follow again shortly
                if self.connected:
                    log.warning("mirror.writer_lost", error=type(exc).__name__)
                self.connected = False
            await asyncio.sleep(pause)
            pause = min(pause * 2, 1.0)

    async def _follow_once(self) -> None:
        assert self._session is not None
        async with self._session.get("http://writer/_memproxy/changes") as response:
            response.raise_for_status()
            reader = response.content
            while True:
                (length,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
                op, args = pickle.loads(await reader.readexactly(length))  # noqa: S301 - our own writer, private socket
                if op == "hello":
                    await self._resync(*args)
                elif op == "sync":  # everything before it is applied: say so (not waiting: the stream goes on)
                    task = asyncio.create_task(self._acknowledge(args[0]))
                    self._acks.add(task)
                    task.add_done_callback(self._acks.discard)
                elif op in ("changed", "adapter"):
                    self._on_changed(op, args[0])
                else:
                    await self._store.follow(op, args)

    async def _acknowledge(self, token: int) -> None:
        assert self._session is not None
        body = orjson.dumps([self._subscriber, token])
        with contextlib.suppress(Exception):  # the writer went away: it no longer waits
            async with self._session.post("http://writer/_memproxy/synced", data=body) as response:
                response.raise_for_status()

    async def _resync(self, generation: str, subscriber: int) -> None:
        """Connected (again): what was cached may have missed ops; the writer gets every held chat again."""
        self.resyncs += 1
        self._subscriber = subscriber
        self._store.cache.clear()
        await self._store.follow("keyword", ())
        await self._on_resync()
        for user_id, model, route, key in self._latest.held():
            self._chats.setdefault(user_id, (model, route, key))
        self.generation, self.connected = generation, True
        self._followed.set()
        self._pushed.set()
        log.info("mirror.following", writer=generation, resyncs=self.resyncs)

    async def _push(self) -> None:
        last_touch = time.monotonic()
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._pushed.wait(), TOUCH_S)
            self._pushed.clear()
            await asyncio.sleep(PUSH_S)  # gather what comes meanwhile into one request
            touches_due = time.monotonic() - last_touch >= TOUCH_S
            try:
                await self._flush(touches=touches_due)
            except asyncio.CancelledError:
                raise
            except Exception:  # the writer is away: the chats go again at the resync; touches are best effort
                self._touches.clear()
            if touches_due:
                last_touch = time.monotonic()

    async def _flush(self, *, touches: bool = True) -> None:
        assert self._session is not None
        if self._chats:
            chats, self._chats = self._chats, {}
            body = orjson.dumps([[user, *chat] for user, chat in chats.items()])
            async with self._session.post("http://writer/_memproxy/chats", data=body) as response:
                response.raise_for_status()
        if touches and self._touches:
            pending, self._touches = self._touches, []
            async with self._session.post("http://writer/_memproxy/touches", data=orjson.dumps(pending)) as response:
                response.raise_for_status()
