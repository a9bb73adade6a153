"""The read path's cache of per-user query adapters, bounded in bytes (an adapter is ~400 kB at 384 dimensions).

The adapter of a user is loaded from the store on their first read and kept for ``ttl_s`` (a refit on another
replica shows within that time; one here calls ``invalidate``), least recently used first out once the cached
adapters hold more than ``max_bytes``. A user without an adapter is cached too (as None), so their reads do not
go to the store each time.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable

import structlog

from proxy.memory.query_adapter import QueryAdapter
from proxy.memory.store.adapters import AdapterTable

log = structlog.get_logger("memproxy.adapter")
_NONE_BYTES = 200  # what a user without an adapter costs the cache


class AdapterCache:
    """User id -> their query adapter (or None), loaded with ``load`` and kept within ``max_bytes``."""

    def __init__(
        self, load: Callable[[str], Awaitable[QueryAdapter | None]], max_bytes: int, ttl_s: float = 600.0
    ) -> None:
        self._load, self._max_bytes, self._ttl_s = load, max_bytes, ttl_s
        self._entries: OrderedDict[str, tuple[QueryAdapter | None, float]] = OrderedDict()
        self.cached_bytes = 0

    async def get(self, user_id: str) -> QueryAdapter | None:
        """The user's adapter (None: they have none), from the cache when it is fresh."""
        found = self._entries.get(user_id)
        if found is not None and time.monotonic() - found[1] < self._ttl_s:
            self._entries.move_to_end(user_id)
            return found[0]
        adapter = await self._load(user_id)
        self.invalidate(user_id)
        self._entries[user_id] = (adapter, time.monotonic())
        self.cached_bytes += _cost(adapter)
        while self.cached_bytes > self._max_bytes and self._entries:
            _, (dropped, _) = self._entries.popitem(last=False)
            self.cached_bytes -= _cost(dropped)
        return adapter

    def clear(self) -> None:
        """Drop every entry."""
        self._entries.clear()
        self.cached_bytes = 0

    def invalidate(self, user_id: str) -> None:
        """Drop the user's entry (their adapter was refitted or they were forgotten)."""
        found = self._entries.pop(user_id, None)
        if found is not None:
            self.cached_bytes -= _cost(found[0])


def adapter_loader(table: AdapterTable, model_id: str) -> Callable[[str], Awaitable[QueryAdapter | None]]:
    """A ``load`` for ``AdapterCache``: the user's stored adapter when it was fitted in ``model_id``'s space.

    The adapter is optional: a table that cannot be read (a storage fault, a damaged blob) means none, for the
    cache's ``ttl_s``, and the request goes on with the query as embedded.
    """

    async def load(user_id: str) -> QueryAdapter | None:
        try:
            stored = await table.get(user_id)
            return QueryAdapter.from_bytes(stored[1]) if stored is not None and stored[0] == model_id else None
        except (OSError, RuntimeError, ValueError, KeyError) as error:  # lance raises these; numpy's load too
            log.warning("memory.adapter_unreadable", error=repr(error)[:300])
            return None

    return load


def _cost(adapter: QueryAdapter | None) -> int:
    return _NONE_BYTES if adapter is None else adapter.nbytes + _NONE_BYTES
