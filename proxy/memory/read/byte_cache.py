"""A cache for the read path's per-text work, bounded in bytes rather than in entries.

The texts it is keyed by are memories (up to ``memory.max_turn_chars``) and the messages of requests (up to
``server.max_body_bytes``): a count-bounded cache of 16,384 such texts holds anything from a few MB to GBs,
depending on what the app sends. A RAG-style app whose every request carries its own 50 kB document grew the
normalised-text cache by ~120 kB a request (35.6 MB after 300 requests, tracemalloc; ~1.9 GB at 16,384).
``ByteCache`` charges each entry its key's and value's size and keeps the total under ``max_bytes``.

Two generations instead of an exact LRU, so that a hit costs one dict lookup (the read path calls these caches
hundreds of times a request): entries go into the young generation; when it holds half the budget, it becomes
the old one and the previous old one is dropped; a hit in the old generation moves the entry back to the young.
What the last half-budget of work used stays cached; what nothing used for a whole generation goes.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

_V = TypeVar("_V")
_MISS: Any = object()
MIB = 2**20
ENTRY_OVERHEAD = 120  # bytes per entry beyond its key and value: the dict slots and small objects


def text_bytes(*parts: object) -> int:
    """The bytes of the str parts of a key or value (others count as nothing: ``ENTRY_OVERHEAD`` covers them)."""
    return sum(sys.getsizeof(part) for part in parts if isinstance(part, str))


class ByteCache(dict[Hashable, _V]):
    """``function(key)`` cached within ``max_bytes``, an entry charged ``size(key, value)`` + ``ENTRY_OVERHEAD``;
    look it up as ``cache[key]``.

    It is the young generation itself (a dict whose ``__missing__`` computes), so a hit costs what a dict
    lookup does, less than a ``functools.lru_cache`` hit. An entry larger than half the budget is
    computed every time and never cached.
    """

    def __init__(self, function: Callable[[Any], _V], max_bytes: int, size: Callable[[Any, _V], int]) -> None:
        super().__init__()
        self.function, self._size, self._half = function, size, max_bytes // 2
        self._old: dict[Hashable, _V] = {}
        self._young_bytes = 0
        self._old_bytes = 0
        _ALL.append(weakref.ref(self))

    def __missing__(self, key: Hashable) -> _V:
        value = self._old.pop(key, _MISS)
        moved = value is not _MISS
        if not moved:
            value = self.function(key)
        cost = self._size(key, value) + ENTRY_OVERHEAD
        if moved:
            self._old_bytes -= cost
        if cost > self._half:
            return value  # type: ignore[no-any-return]
        if self._young_bytes + cost > self._half:  # a new generation: the old one goes
            self._old, self._old_bytes = dict(self), self._young_bytes
            self.clear()
            self._young_bytes = 0
        self[key] = value
        self._young_bytes += cost
        return value  # type: ignore[no-any-return]

    @property
    def cached_bytes(self) -> int:
        """What the cached entries are charged (at most ``max_bytes``)."""
        return self._young_bytes + self._old_bytes

    @property
    def entries(self) -> int:
        """Entries cached, in both generations."""
        return len(self) + len(self._old)

    def cache_clear(self) -> None:
        """Drop every entry (as ``functools.lru_cache``'s)."""
        self.clear()
        self._old = {}
        self._young_bytes = self._old_bytes = 0


_ALL: list[weakref.ref[ByteCache[Any]]] = []  # every ByteCache made (a dict subclass: unhashable, no WeakSet)


def cached_bytes_total() -> int:
    """What every ``ByteCache`` of this process is charged, together (``memproxy_memory_bytes{part="text_caches"}``)."""
    _ALL[:] = [ref for ref in _ALL if ref() is not None]
    return sum(cache.cached_bytes for ref in _ALL if (cache := ref()) is not None)


def byte_cache(max_bytes: int, size: Callable[[Any, Any], int]) -> Callable[[Callable[[Any], _V]], ByteCache[_V]]:
    """Decorate a function of one hashable argument with a ``ByteCache`` (then look it up as ``name[key]``)."""

    def wrap(function: Callable[[Any], _V]) -> ByteCache[_V]:
        return ByteCache(function, max_bytes, size)

    return wrap
