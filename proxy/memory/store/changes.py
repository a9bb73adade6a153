"""The change feed: each replica announces the users whose records it changes, and polls the others'.

Every write publishes a change (``changes/<ms>-<replica>-<n>-<op>[~<users>].json``) before its commit and again
after it; the users are named in the key itself when they fit (so readers need only the listing), else in
the body. Replicas poll the feed and look back a window for changes that arrive late.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Iterable
from dataclasses import dataclass

import orjson

from proxy.memory.store.objectstore import ObjectStore

_KEY_USERS_MAX = 700  # bytes of base64 user ids in a change's key (S3 keys go to 1024)
CHANGES = "changes/"


def now_ms() -> int:
    """Wall-clock milliseconds (the feed's clock: change keys sort by it)."""
    return int(time.time() * 1000)


@dataclass(frozen=True)
class Change:
    """Users whose records another replica changed (``op``: ``write`` or ``forget``)."""

    key: str
    at_ms: int
    replica: str
    users: tuple[str, ...]
    op: str


class ChangeFeed:
    """Publishes this replica's changes and lists the others', with a look-back window for late arrivals."""

    def __init__(self, objects: ObjectStore, replica: str, lookback_s: float) -> None:
        self._objects = objects
        self.replica = replica
        self._lookback_ms = int(lookback_s * 1000)
        self._seq = 0
        self._seen: dict[str, int] = {}
        self._since_ms = now_ms()

    def start_at(self, at_ms: int) -> None:
        """Deliver changes published from ``at_ms`` on (the moment before the store opened)."""
        self._since_ms = at_ms

    async def publish(self, users: Iterable[str], op: str = "write") -> None:
        """Announce that ``users``' records change (before the commit) or changed (after it)."""
        users = sorted(set(users))
        if not users:
            return
        self._seq += 1
        at = now_ms()
        key = f"{CHANGES}{at:013d}-{self.replica}-{self._seq:08d}-{op}"
        named = base64.urlsafe_b64encode("\n".join(users).encode()).decode().rstrip("=")
        if len(named) <= _KEY_USERS_MAX:  # the usual case: readers need only the listing, no GET per change
            key += f"~{named}"
        body = orjson.dumps({"users": users, "op": op, "replica": self.replica, "at_ms": at})
        await self._objects.put(f"{key}.json", body)

    async def poll(self) -> list[Change]:
        """Changes by other replicas not delivered yet, oldest first."""
        floor = max(self._since_ms, now_ms() - self._lookback_ms)
        keys: list[str] = []
        after = f"{CHANGES}{max(floor, 0):013d}"
        while True:
            page = await self._objects.list(CHANGES, start_after=after)
            keys.extend(page)
            if len(page) < 1000:
                break
            after = page[-1]
        out = []
        for key in keys:
            at_ms, replica, op, users = _parse_change_key(key)
            if key in self._seen or at_ms < self._since_ms:
                continue
            self._seen[key] = at_ms
            if replica == self.replica:
                continue
            if users is None:
                found = await self._objects.get(key)
                users = tuple(orjson.loads(found.body)["users"]) if found is not None else ()
            out.append(Change(key, at_ms, replica, users, op))
        self._forget_seen(floor)
        return out

    def _forget_seen(self, floor_ms: int) -> None:
        for key in [key for key, at in self._seen.items() if at < floor_ms]:
            del self._seen[key]

    async def cleanup(self, keep_s: float) -> int:
        """Delete changes older than ``keep_s`` (the lease holder does this); returns how many."""
        cutoff = f"{CHANGES}{now_ms() - int(keep_s * 1000):013d}"
        old = [key for key in await self._objects.list(CHANGES) if key < cutoff]
        for key in old:
            await self._objects.delete(key)
        return len(old)


def _parse_change_key(key: str) -> tuple[int, str, str, tuple[str, ...] | None]:
    """(time, replica, op, users) of a change key; users None when only the object's body names them."""
    head, _, named = key.rsplit("/", 1)[-1].removesuffix(".json").partition("~")
    stamp, _, rest = head.partition("-")
    replica, _seq, op = rest.rsplit("-", 2)
    users = None
    if named:
        users = tuple(base64.urlsafe_b64decode(named + "=" * (-len(named) % 4)).decode().split("\n"))
    return int(stamp), replica, op, users
