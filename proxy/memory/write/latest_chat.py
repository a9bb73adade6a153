"""Each user's latest chat request, as the memory-side calls need it: its model, its route and the client's key.

Memory-side calls (facts, summaries, insights) default to the model and route of the user's own latest chat.
When the proxy holds no key for that route, they use the key the user's client sent with that chat:

- **In process memory only.** The key lives in this object as a ``SecretStr`` (masked in any repr); it is
  never put in a job payload, written to disk or logged. The job runner tells the memory LLM client whose
  job is running through a context variable (``CURRENT_USER``), and the client asks ``key(route)``.
- **Same route only.** A key is used only on the route whose chat brought it (a key for one provider never
  goes to another), and only by memory clients that post to that route's own base URL.
- **Expiry.** A key is used for at most ``key_ttl_s`` after the latest chat that brought it, and at most
  ``max_users`` users are held (least recently seen dropped first). A key the upstream rejects (401/403) is
  dropped at once and not taken again until a different key arrives.
- **After a restart** nothing is held: a job that needs a key waits in the queue (state ``waiting``, reason
  ``no_key``; see ``proxy.memory.write.job_types``) and runs as soon as the user's next chat brings one
  (``remember`` returns True, and the engine wakes the user's waiting jobs).
"""

from __future__ import annotations

import contextvars
import dataclasses
import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterator
from typing import TypeVar

from pydantic import SecretStr

K = TypeVar("K")
V = TypeVar("V")
CURRENT_USER: contextvars.ContextVar[str | None] = contextvars.ContextVar("memproxy_job_user", default=None)


@dataclasses.dataclass(frozen=True, slots=True)
class LatestChat:
    """What a user's latest chat used (no key here: keys are held apart, per route)."""

    model: str
    route: str
    at: float


def fingerprint(key: str) -> str:
    """A one-way digest of a key, to recognise a rejected key without keeping it."""
    return hashlib.sha256(key.encode()).hexdigest()


class LatestChats:
    """The latest chat of each user and, for routes that pass the client's key on, that key."""

    def __init__(
        self,
        keyed_routes: Collection[str],
        *,
        key_ttl_s: float = 7200.0,
        max_users: int = 100_000,
        hold_keys: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._keyed_routes = frozenset(keyed_routes) if hold_keys else frozenset()
        self._ttl_s = key_ttl_s
        self._max_users = max_users
        self._clock = clock
        self._chats: OrderedDict[str, LatestChat] = OrderedDict()
        self._keys: OrderedDict[tuple[str, str], tuple[SecretStr, float]] = OrderedDict()
        self._rejected: dict[tuple[str, str], str] = {}

    def remember(self, user_id: str, model: str, route: str, key: SecretStr | None) -> bool:
        """Note a user's chat; True when it brought something a waiting job may need (a first model, a new key)."""
        now = self._clock()
        first = user_id not in self._chats
        self._chats[user_id] = LatestChat(model, route, now)
        self._chats.move_to_end(user_id)
        _trim(self._chats, self._max_users)
        return self._hold(user_id, route, key, now) or first

    def _hold(self, user_id: str, route: str, key: SecretStr | None, now: float) -> bool:
        if route not in self._keyed_routes or key is None or not key.get_secret_value():
            return False
        slot = (user_id, route)
        value = key.get_secret_value()
        held = self._keys.get(slot)
        fresh = held is not None and now - held[1] <= self._ttl_s
        new = not (fresh and held is not None and held[0].get_secret_value() == value)
        if self._rejected.get(slot) == fingerprint(value):
            return False  # the same key was rejected: holding it again cannot help
        self._rejected.pop(slot, None)
        self._keys[slot] = (key, now)
        self._keys.move_to_end(slot)
        _trim(self._keys, self._max_users)
        return new

    def latest(self, user_id: str) -> LatestChat | None:
        """The user's latest chat (model, route), or None (none since start)."""
        return self._chats.get(user_id)

    def model(self, user_id: str) -> str | None:
        """The model of the user's latest chat, or None (none since start)."""
        chat = self._chats.get(user_id)
        return chat.model if chat is not None else None

    def key(self, route: str) -> str | None:
        """The held key of the running job's user on ``route``, if any and not expired."""
        user_id = CURRENT_USER.get()
        if user_id is None:
            return None
        held = self._keys.get((user_id, route))
        if held is None:
            return None
        if self._clock() - held[1] > self._ttl_s:
            del self._keys[(user_id, route)]
            return None
        return held[0].get_secret_value()

    def rejected(self, route: str, key: str) -> None:
        """The upstream rejected ``key`` for the running job's user: drop it and remember its fingerprint."""
        user_id = CURRENT_USER.get()
        if user_id is None:
            return
        slot = (user_id, route)
        held = self._keys.get(slot)
        if held is not None and held[0].get_secret_value() == key:
            del self._keys[slot]
        self._rejected[slot] = fingerprint(key)
        while len(self._rejected) > self._max_users:
            self._rejected.pop(next(iter(self._rejected)))

    def forget(self, user_id: str) -> None:
        """Drop everything held for ``user_id``."""
        self._chats.pop(user_id, None)
        for slot in [s for s in self._keys if s[0] == user_id]:
            del self._keys[slot]
        for slot in [s for s in self._rejected if s[0] == user_id]:
            del self._rejected[slot]

    def held(self) -> Iterator[tuple[str, str, str, str | None]]:
        """(user, model, route, held key or None) of each user's latest chat: what another process holding
        these chats needs (``proxy.mirror``: the memory writer, after it restarted)."""
        now = self._clock()
        for user_id, chat in list(self._chats.items()):
            held = self._keys.get((user_id, chat.route))
            fresh = held is not None and now - held[1] <= self._ttl_s
            yield user_id, chat.model, chat.route, held[0].get_secret_value() if held is not None and fresh else None

    def held_keys(self) -> int:
        """How many keys are held (for metrics; never the keys)."""
        return len(self._keys)


def _trim(items: OrderedDict[K, V], limit: int) -> None:
    """Drop the least recently used entries past ``limit``."""
    while len(items) > limit:
        items.popitem(last=False)
