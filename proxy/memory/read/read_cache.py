"""What the read path needs from the store, and a cache of the per-user lookups that change slowly.

``RetrievalStore`` is the slice of ``MemoryStore`` the read path uses (every call scoped to one user). Four lookups
do not depend on the query: the user's name index (entities of facts, names of subjects), their current insights,
what their summaries cover, and their newest turns. They come from the vector cache (``MemoryStore.newest``), which
holds the user's records anyway. ``ReadCache`` keeps them per user (names, insights and coverage ``ttl_s``, 5
minutes by default, newest turns ``recent_ttl_s``, 30 s), at most ``max_users`` users (LRU); ``invalidate`` drops a
user at once, e.g. after their memories change or they are forgotten. Concurrent requests for one user share one
load. An expired name index or insight set is still served while it reloads in the background, so only a user's
first request after start (or after ``invalidate``) pays those listings (``bench/readpath.py``'s cold figure); a new
fact is found by the dense and keyword arms at once, only its entity lift waits for the next load.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from datetime import datetime
from typing import Any, Protocol, TypeVar, cast

import numpy as np
import numpy.typing as npt

from proxy.memory.pieces import IntArray, TermVectors
from proxy.memory.read.candidates import ScoredRecord
from proxy.memory.read.names import NameIndex
from proxy.memory.store.records import Kind, MemoryRecord, Pool, newest_generation

_T = TypeVar("_T")


class RetrievalStore(Protocol):
    """The part of ``MemoryStore`` the read path uses; every call is scoped to one user."""

    async def vector_search_pools(
        self, user_id: str, query: npt.NDArray[np.float32], pools: Sequence[Pool]
    ) -> Sequence[Sequence[ScoredRecord]]: ...

    async def keyword_search_pools(
        self, user_id: str, query: str, pools: Sequence[Pool]
    ) -> Sequence[Sequence[ScoredRecord]]: ...

    async def read_many(self, user_id: str, ids: Sequence[str]) -> list[MemoryRecord]: ...

    async def newest(self, user_id: str, kinds: Sequence[Kind], limit: int) -> list[MemoryRecord]: ...

    def term_pieces(self, user_id: str, ids: Sequence[str], vectors: TermVectors) -> Sequence[IntArray | None]: ...


async def load_name_index(store: RetrievalStore, user_id: str, *, max_records: int = 20_000) -> NameIndex:
    """Build a user's name index from their valid facts and subjects (pages through the store)."""
    records = await store.newest(user_id, [Kind.FACT, Kind.SUBJECT], max_records)
    return NameIndex.build([r for r in records if r.valid])


async def load_insights(store: RetrievalStore, user_id: str, limit: int) -> list[MemoryRecord]:
    """The user's current insights: the newest generation's, most confident first."""
    records = await store.newest(user_id, [Kind.INSIGHT], limit)
    return newest_generation([r for r in records if r.valid])


Coverage = dict[str, datetime]  # conversation id -> the newest turn time its summary covers


async def load_coverage(store: RetrievalStore, user_id: str, *, max_records: int = 20_000) -> Coverage:
    """What the user's current summaries cover: per conversation, the end of its valid summary's span.

    A conversation's rolling summary spans its turns from the first to ``end_at`` (older summaries of it are
    superseded), so its turns created up to then are told by the summary (``arms.visible``)."""
    records = await store.newest(user_id, [Kind.SUMMARY], max_records)
    coverage: Coverage = {}
    for r in records:
        if r.valid and r.conversation_id is not None:
            end, known = r.end_at or r.created_at, coverage.get(r.conversation_id)
            coverage[r.conversation_id] = end if known is None else max(known, end)
    return coverage


async def load_newest_turns(store: RetrievalStore, user_id: str, limit: int) -> list[MemoryRecord]:
    """The user's newest valid turns (both roles, all conversations), newest first."""
    return [r for r in await store.newest(user_id, [Kind.TURN], limit) if r.valid]


class ReadCache:
    """Per-user name index, insights and newest turns, kept briefly (see the module docstring)."""

    def __init__(self, *, ttl_s: float = 300.0, recent_ttl_s: float = 30.0, max_users: int = 1024) -> None:
        self._ttl_s = ttl_s
        self._recent_ttl_s = recent_ttl_s
        self._max_users = max_users
        self._users: OrderedDict[str, dict[tuple[Any, ...], tuple[float, Any]]] = OrderedDict()
        self._locks: dict[tuple[Any, ...], asyncio.Lock] = {}
        # Loads run in their own tasks so that a request's deadline cannot cancel them: a load slower than
        # the deadline would otherwise never be cached, and the user would never get that part of memory.
        self._loads: dict[tuple[Any, ...], asyncio.Task[Any]] = {}

    async def aclose(self) -> None:
        """Stop the loads in flight (the engine closes; nothing would use them)."""
        for task in self._loads.values():
            task.cancel()
        await self.wait_for_loads()

    async def wait_for_loads(self) -> None:
        """Wait until the loads in flight (background reloads included) have finished."""
        await asyncio.gather(*self._loads.values(), return_exceptions=True)

    def invalidate(self, user_id: str) -> None:
        """Forget everything cached for a user."""
        self._users.pop(user_id, None)

    def clear(self) -> None:
        """Forget everything cached for every user."""
        self._users.clear()

    async def get(self, store: RetrievalStore, user_id: str) -> NameIndex:
        """The user's name index (the original ``NameIndexCache`` call)."""
        return await self.names(store, user_id)

    def cached_names(self, user_id: str) -> NameIndex | None:
        """The user's name index if a fresh one is cached (never loads)."""
        fresh = self._fresh(user_id, ("names",), self._ttl_s)
        return cast(NameIndex, fresh[0]) if fresh is not None else None

    async def names(self, store: RetrievalStore, user_id: str) -> NameIndex:
        """The user's name index."""
        return await self._cached(
            user_id, ("names",), self._ttl_s, lambda: load_name_index(store, user_id), stale_ok=True
        )

    async def insights(self, store: RetrievalStore, user_id: str, limit: int) -> list[MemoryRecord]:
        """The user's current insights."""
        return await self._cached(
            user_id, ("insights", limit), self._ttl_s, lambda: load_insights(store, user_id, limit), stale_ok=True
        )

    async def coverage(self, store: RetrievalStore, user_id: str) -> Coverage:
        """What the user's summaries cover (``load_coverage``); a new summary hides its turns within ``ttl_s``."""
        return await self._cached(
            user_id, ("coverage",), self._ttl_s, lambda: load_coverage(store, user_id), stale_ok=True
        )

    async def newest_turns(self, store: RetrievalStore, user_id: str, limit: int) -> list[MemoryRecord]:
        """The user's newest turns."""
        return await self._cached(
            user_id,
            ("turns", limit),
            self._recent_ttl_s,
            lambda: load_newest_turns(store, user_id, limit),
            stale_ok=False,  # recent activity must show a message from another chat soon
        )

    async def _cached(
        self, user_id: str, key: tuple[Any, ...], ttl_s: float, load: Callable[[], Awaitable[_T]], *, stale_ok: bool
    ) -> _T:
        """The cached value for ``(user_id, key)``, or one load shared by concurrent callers. ``stale_ok``: an
        expired value is still served while a reload runs in the background (a returning user's first request
        must not pay the listings)."""
        entry = self._users.get(user_id, {}).get(key)
        if entry is not None and (stale_ok or time.monotonic() - entry[0] <= ttl_s):
            self._users.move_to_end(user_id)
            if time.monotonic() - entry[0] > ttl_s:
                self._load_task(user_id, key, load)  # owned by the cache: ``aclose`` stops it
            return cast(_T, entry[1])
        lock = self._locks.setdefault((user_id, *key), asyncio.Lock())
        async with lock:
            fresh = self._fresh(user_id, key, ttl_s)
            if fresh is None:
                fresh = (await asyncio.shield(self._load_task(user_id, key, load)),)
        if not lock.locked():
            self._locks.pop((user_id, *key), None)
        return cast(_T, fresh[0])

    def _load_task(self, user_id: str, key: tuple[Any, ...], load: Callable[[], Awaitable[_T]]) -> asyncio.Task[_T]:
        """The running load for ``(user_id, key)``, started if there is none; it caches what it loads."""
        task = self._loads.get((user_id, *key))
        if task is None:

            async def load_and_keep() -> _T:
                value = await load()
                self._put(user_id, key, value)
                return value

            task = self._loads[(user_id, *key)] = asyncio.create_task(load_and_keep())
            task.add_done_callback(lambda _: self._loads.pop((user_id, *key), None))
        return cast("asyncio.Task[_T]", task)

    def _fresh(self, user_id: str, key: tuple[Any, ...], ttl_s: float) -> tuple[Any] | None:
        """The cached value (in a 1-tuple, so a cached None or [] counts) if younger than ``ttl_s``."""
        entry = self._users.get(user_id, {}).get(key)
        if entry is None or time.monotonic() - entry[0] > ttl_s:
            return None
        self._users.move_to_end(user_id)
        return (entry[1],)

    def _put(self, user_id: str, key: tuple[Any, ...], value: Any) -> None:
        """Keep ``value``, evicting the least recently used users beyond ``max_users``."""
        self._users.setdefault(user_id, {})[key] = (time.monotonic(), value)
        self._users.move_to_end(user_id)
        while len(self._users) > self._max_users:
            self._users.popitem(last=False)


NameIndexCache = ReadCache  # the first name of this cache; kept for callers that use it
