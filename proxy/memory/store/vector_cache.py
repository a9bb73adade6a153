"""A bounded in-RAM cache of each user's vectors for exact search, evicted by SIEVE within a byte budget.

Exact numpy search over one user's vectors is far cheaper than LanceDB's filtered search, so the store keeps
recently searched users here, each as a ``user_vectors.UserVectors`` entry. The store applies every write, edit
and delete to the cache right after LanceDB commits it; the writes that land while a user is being loaded are
replayed onto the loaded entry before it is kept (each replaces or deletes whole records by id, so replaying one
the load already saw changes nothing), so the cache never serves a state older than LanceDB's. Discarding such a
load instead made a busy user's load start over and over under sustained chat.

Eviction is SIEVE (Zhang et al., NSDI 2024), not LRU: entries queue in the order they came in, a read marks its
entry, and the eviction hand walks from the oldest towards the newest, unmarking marked ones and evicting the first
unmarked, leaving the survivors where they are. When the users who chat need more RAM than the budget, which is
what a deployment meets (issue 47), LRU keeps the most recent ones and a user's next request finds them gone:
every read misses (``bench/load.py``'s 40 users in 12 MiB a chat process: 93% of requests read their user back).
SIEVE keeps a steady set of those read again and sends a user seen once out first (a simulation of that bench's
order of users: 15% of reads find their user against LRU's 4%, of the 25% the budget's share of the users allows).

One read of the chat path (``holding``) looks its user up two or three times (the dense arm, the keyword arm,
the newest records), often at once: the first lookup's answer serves the others (they wait for it), whether or
not the cache kept the entry, and only the first counts as a use and as a lookup
(``memproxy_vector_cache_lookups_total``). Otherwise a user the cache could not keep would be read back once per
arm, every user would look used again at each read, and the lookups counted would be arms, not reads.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from contextvars import ContextVar
from typing import Any, cast

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import structlog

from proxy.memory.store.records import MemoryRecord
from proxy.memory.store.user_vectors import UserVectors
from proxy.memory.store.vector_spill import Spilled, VectorSpill, touch_bytes, upsert_bytes

log = structlog.get_logger("memproxy.store")

_UNREADABLE = (OSError, ValueError, pa.ArrowException)  # a spilled file that cannot be read back

READS_IDLE_S = 5.0  # ``release_idle`` drops nothing while a read came this recently
RELEASE_WRITE_BYTES = 64 * 2**20  # users ``release_idle`` writes to the spill at most, by their entries' bytes
INLINE_READ_BYTES = 4 * 2**20  # a spilled file up to this size (~2,000 memories) is read back on the event loop
MAX_REPLAYED_WRITES = 10_000  # writes kept for one user's load in flight; past it the load is not kept

# The entries one read has looked up (``holding``): (the cache's id, user) -> (the cache's ``_drops`` then, the
# first lookup's answer: an entry, None, or ``_FAILED``)
_Held = dict[tuple[int, str], tuple[int, "asyncio.Future[object]"]]
_HELD: ContextVar[_Held | None] = ContextVar("vector_cache_held", default=None)
_FAILED = object()  # the first lookup raised (a deadline, a failed load): the others look up for themselves


@contextlib.contextmanager
def holding() -> Iterator[None]:
    """Within this block (one read of the chat path, its arms' tasks included), a user's lookups after the first
    return what the first one got (waiting for it when the arms look up at once), without marking it used or
    counting a lookup again; an entry not in the cache is looked up again once a delete or drop came since. What
    the read does after its arms (term matching's stored word pieces, the access times it notes) sees the same
    entry (``VectorCache.current``). A block within a block is the outer one's."""
    if _HELD.get() is not None:
        yield
        return
    held: _Held = {}
    token = _HELD.set(held)
    try:
        yield
    finally:
        _HELD.reset(token)
        held.clear()  # a task started inside keeps the dict: it pins no entry past the read


class _Node:
    __slots__ = ("key", "marked", "newer", "older")

    def __init__(self, key: str, older: _Node | None) -> None:
        self.key = key
        self.marked = False
        self.older = older
        self.newer: _Node | None = None


class _Sieve:
    """SIEVE's queue of keys: ``add`` puts a key in as the newest, ``mark`` notes a use, ``victim`` moves the hand
    (oldest to newest, then round again), unmarking marked keys, to the first unmarked one, which the caller
    ``remove``s. Every operation is O(1) but ``victim``'s walk, which unmarks what it passes."""

    __slots__ = ("_hand", "_newest", "_nodes", "_oldest")

    def __init__(self) -> None:
        self._nodes: dict[str, _Node] = {}
        self._oldest: _Node | None = None
        self._newest: _Node | None = None
        self._hand: _Node | None = None  # None: start from the oldest

    def __len__(self) -> int:
        return len(self._nodes)

    def add(self, key: str) -> None:
        if key in self._nodes:
            return
        node = self._nodes[key] = _Node(key, self._newest)
        if self._newest is not None:
            self._newest.newer = node
        self._newest = node
        if self._oldest is None:
            self._oldest = node

    def mark(self, key: str) -> None:
        node = self._nodes.get(key)
        if node is not None:
            node.marked = True

    def victim(self) -> str:
        node = self._hand or self._oldest
        if node is None:
            raise KeyError("no keys")
        while node.marked:
            node.marked = False
            node = node.newer or cast(_Node, self._oldest)
        self._hand = node  # its ``remove`` moves the hand on to the next newer
        return node.key

    def remove(self, key: str) -> None:
        node = self._nodes.pop(key, None)
        if node is None:
            return
        if self._hand is node:
            self._hand = node.newer
        if node.older is None:
            self._oldest = node.newer
        else:
            node.older.newer = node.newer
        if node.newer is None:
            self._newest = node.older
        else:
            node.newer.older = node.older


class VectorCache:
    """Users' ``UserVectors`` under one byte budget, evicted by SIEVE (the module's docstring)."""

    def __init__(
        self, max_bytes: int, clock: Callable[[], float] = time.monotonic, spill: VectorSpill | None = None
    ) -> None:
        self.max_bytes = max_bytes
        self._clock = clock
        # Where users evicted for room (or released idle) go, for their next read to read back rather than
        # load from LanceDB (None: nowhere). Every write below reaches it too.
        self.spill = spill
        self._entries: dict[str, UserVectors] = {}
        self._order = _Sieve()  # the entries' users, in SIEVE's queue
        self._bytes: dict[str, int] = {}
        self._read_at: dict[str, float] = {}  # ``clock()`` at each entry's last read
        self._last_read = float("-inf")  # ``clock()`` at the last read of any entry
        self._drops = 0  # entries dropped, removed from or cleared: a read's held entry is looked up again
        self._total = 0
        # user -> the writes to replay onto the entry being loaded (None: dropped meanwhile, discard the load)
        self._loading: dict[str, list[Callable[[UserVectors], object]] | None] = {}
        self._inflight: dict[str, asyncio.Event] = {}
        # A load runs in its own task so that a caller's deadline cannot cancel it: a user whose first load
        # is slower than the read-path deadline would otherwise never get cached and never get memory.
        self._loads: dict[str, asyncio.Task[UserVectors | None]] = {}
        self._too_big: OrderedDict[str, None] = OrderedDict()
        # Told of every write applied here (``upsert``, ``patch``, ``remove``, ``drop``, ``clear`` and their
        # arguments), not of evictions: the memory writer mirrors them to the chat processes' caches.
        self.mirror: Callable[[str, tuple[Any, ...]], object] | None = None
        # Told of each read's lookup: "hit", "spilled" (read back from the spill), "miss" (the user's vectors
        # loaded from LanceDB) or "too_big" (searched on disk):
        # ``memproxy_vector_cache_lookups_total{result}``, by which an operator sizes ``store.vector_cache_bytes``.
        self.observe: Callable[[str], object] | None = None

    @property
    def nbytes(self) -> int:
        """Bytes currently held, by the entries' own estimate."""
        return self._total

    async def aclose(self) -> None:
        """Stop the loads in flight (the store closes; nothing would use them) and remove the spilled files."""
        await _cancel_all(self._loads.values())
        if self.spill is not None:
            self.spill.close()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, user_id: object) -> bool:
        return user_id in self._entries

    def peek(self, user_id: str) -> UserVectors | None:
        """The user's entry if cached, without marking it used: what the write side and the management API
        read must not keep a user the read side left in the cache (``release_idle``)."""
        return self._entries.get(user_id)

    def current(self, user_id: str) -> UserVectors | None:
        """The user's entry this read looked up (``holding``), even if the cache has let it go since (with more
        users than fit, another read's miss often evicts it before this read's fusion asks for its word pieces:
        those were then made again from the texts), else the cached one; neither marked used."""
        held = _HELD.get()
        kept = None if held is None else held.get((id(self), user_id))
        if kept is not None and kept[1].done():
            drops, first = kept
            found = first.result()
            if isinstance(found, UserVectors) and self._still_current(user_id, drops, found):
                return found
        return self._entries.get(user_id)

    def _still_current(self, user_id: str, drops: int, found: UserVectors) -> bool:
        """Whether an entry a read looked up (when ``_drops`` was ``drops``) is the user's still: the cached
        entry itself is (writes apply to it); another one is unless a delete or drop came since."""
        return self._entries.get(user_id) is found or drops == self._drops

    def get(self, user_id: str) -> UserVectors | None:
        """The user's entry if cached (and mark it used)."""
        entry = self._entries.get(user_id)
        if entry is not None:
            self._order.mark(user_id)
            self._read_at[user_id] = self._last_read = self._clock()
        return entry

    async def get_or_load(self, user_id: str, load: Callable[[], Awaitable[UserVectors | None]]) -> UserVectors | None:
        """The cached entry, else one loaded by ``load`` (None: the user does not fit, search elsewhere); within
        ``holding``, what this read's first lookup of the user got (awaited if it is still under way; not counted
        as a lookup again)."""
        held = _HELD.get()
        if held is None:
            return await self._get_or_load(user_id, load)
        key = (id(self), user_id)
        kept = held.get(key)
        if kept is not None:
            drops, first = kept
            found = await asyncio.shield(first)  # (a caller's deadline cancels its wait, not the first lookup)
            if found is None or (isinstance(found, UserVectors) and self._still_current(user_id, drops, found)):
                return found
        first = asyncio.get_running_loop().create_future()
        held[key] = (self._drops, first)
        try:
            entry = await self._get_or_load(user_id, load)
        except BaseException:
            held.pop(key, None)
            first.set_result(_FAILED)  # the others look up for themselves
            raise
        first.set_result(entry)
        return entry

    async def _get_or_load(self, user_id: str, load: Callable[[], Awaitable[UserVectors | None]]) -> UserVectors | None:
        while (event := self._inflight.get(user_id)) is not None:
            await event.wait()
        entry = self.get(user_id)
        if entry is not None:
            self._observed("hit")
            return entry
        if user_id in self._too_big:
            self._observed("too_big")
            return None
        if self.spill is not None and (spilled := self.spill.get(user_id)) is not None:
            self._observed("spilled")
            if spilled.nbytes > INLINE_READ_BYTES:
                return await self._load(user_id, functools.partial(self._read_spilled, user_id, load))
            # A small file is read back here, on the event loop: it is mapped, not copied
            # (``vector_spill.read_parts``), so the read is mostly the ids' index, well under a millisecond, less
            # than the hop to a thread and back, whose thread would then compete with the loop for the interpreter.
            try:
                entry = spilled.read(user_id, len(spilled.patches))
            except _UNREADABLE as exc:
                self._unreadable(user_id, spilled, exc)
                return await self._load(user_id, load)
            self._put(user_id, entry)
            return entry
        self._observed("miss")
        return await self._load(user_id, load)

    async def _read_spilled(
        self, user_id: str, load: Callable[[], Awaitable[UserVectors | None]]
    ) -> UserVectors | None:
        """The user's entry from their spilled file with the patches it has now (a write since dropped it, later
        patches are replayed by ``_loading``), read in a thread, else from ``load``."""
        spill = self.spill
        spilled = spill.get(user_id) if spill is not None else None
        if spilled is None:
            return await load()
        try:
            return await asyncio.to_thread(spilled.read, user_id, len(spilled.patches))
        except _UNREADABLE as exc:
            self._unreadable(user_id, spilled, exc)
            return await load()

    def _unreadable(self, user_id: str, spilled: Spilled, error: Exception) -> None:
        """A file removed or cut short: told, and dropped (LanceDB has it all) unless the user has another now."""
        log.warning("store.vector_spill_unreadable", error=type(error).__name__)
        if self.spill is not None and self.spill.get(user_id) is spilled:
            self.spill.discard(user_id)

    def _observed(self, result: str) -> None:
        if self.observe is not None:
            self.observe(result)

    async def _load(self, user_id: str, load: Callable[[], Awaitable[UserVectors | None]]) -> UserVectors | None:
        task = self._loads.get(user_id)
        if task is None:
            event = self._inflight[user_id] = asyncio.Event()
            self._loading[user_id] = []  # writes from now on are replayed onto what the load returns
            task = self._loads[user_id] = asyncio.create_task(self._load_and_keep(user_id, load, event))
            task.add_done_callback(lambda _: self._loads.pop(user_id, None))
        return await asyncio.shield(task)

    async def _load_and_keep(
        self, user_id: str, load: Callable[[], Awaitable[UserVectors | None]], event: asyncio.Event
    ) -> UserVectors | None:
        try:
            entry = await load()
            replay = self._loading.pop(user_id, None)
            if entry is not None and replay is not None:
                for write in replay:
                    write(entry)
        finally:
            self._loading.pop(user_id, None)
            del self._inflight[user_id]
            event.set()
        if entry is None:
            self._mark_too_big(user_id)
        elif replay is not None:
            self._put(user_id, entry)
        return entry

    def _mark_too_big(self, user_id: str) -> None:
        self._too_big[user_id] = None
        while len(self._too_big) > 1024:
            self._too_big.popitem(last=False)

    def _put(self, user_id: str, entry: UserVectors) -> None:
        if entry.nbytes > self.max_bytes:
            self._mark_too_big(user_id)
            return
        self._entries[user_id] = entry
        self._order.add(user_id)  # (unmarked: a user read once goes first)
        self._read_at[user_id] = self._last_read = self._clock()
        self._account(user_id)

    def _account(self, user_id: str) -> None:
        size = self._entries[user_id].nbytes
        self._total += size - self._bytes.get(user_id, 0)
        self._bytes[user_id] = size
        if size > self.max_bytes:
            self._evict(user_id)
            self._mark_too_big(user_id)
            return
        while self._total > self.max_bytes:
            self._evict(self._order.victim(), spill=True)

    def upsert(
        self,
        records: Sequence[MemoryRecord],
        vectors: npt.NDArray[np.float32],
        pieces: Sequence[npt.NDArray[np.int64] | None] | None = None,
    ) -> None:
        """Apply added or changed records (already durable in LanceDB) to cached users, with their word pieces
        (None: none kept)."""
        if self.mirror is not None:
            self.mirror("upsert", (records, vectors, pieces))
        touched: set[str] = set()
        for i, (record, vector) in enumerate(zip(records, vectors, strict=True)):
            held = None if pieces is None else pieces[i]
            user_id = record.user_id
            if self._loading.get(user_id) is not None or (self.spill is not None and user_id in self.spill):
                write = functools.partial(UserVectors.upsert, record=record, vector=vector.copy(), pieces=held)
                self._note_write(user_id, write)
                if self.spill is not None:  # replayed onto the file's entry when it is read (a turn a chat adds)
                    self.spill.patch(user_id, write, upsert_bytes(record, vector, held))
            entry = self._entries.get(user_id)
            if entry is not None:
                entry.upsert(record, vector, held)
                touched.add(user_id)
        for user_id in touched:
            if user_id in self._entries:
                self._account(user_id)

    def patch(self, user_id: str, ids: Sequence[str], **changes: object) -> None:
        """Apply a field change that leaves vectors and filters alone (``last_accessed_at``: ahead of LanceDB)."""
        if self.mirror is not None:
            self.mirror("patch", (user_id, ids, changes))
        self._note_write(user_id, lambda loaded: loaded.patch(ids, **changes))
        if self.spill is not None:
            self.spill.patch(user_id, lambda spilled: spilled.patch(ids, **changes), touch_bytes(ids))
        entry = self._entries.get(user_id)
        if entry is not None:
            entry.patch(ids, **changes)

    def remove(self, user_id: str, ids: Sequence[str]) -> None:
        """Apply deletes (already durable in LanceDB)."""
        ids = list(ids)
        if self.mirror is not None:
            self.mirror("remove", (user_id, ids))
        self._note_write(user_id, lambda loaded: loaded.remove(ids))
        self._drops += 1
        if self.spill is not None:
            self.spill.discard(user_id)
        self._too_big.pop(user_id, None)
        entry = self._entries.get(user_id)
        if entry is not None:
            entry.remove(ids)
            self._account(user_id)

    def release_idle(self, idle_s: float, now: float | None = None) -> list[str]:
        """Once no read has come for ``READS_IDLE_S``, drop the entries no read has used for ``idle_s`` seconds
        (writes do not count: they keep an entry current, not useful); returns their users. Their next read
        reads them back from the spill if their file there still holds them or one is written here (for the most
        recently read ones, up to ``RELEASE_WRITE_BYTES``), else loads them again from LanceDB. While reads keep
        coming, only the byte budget evicts."""
        now = self._clock() if now is None else now
        if not self._entries or now - self._last_read < READS_IDLE_S:
            return []
        cutoff = now - idle_s
        idle = sorted((u for u, at in self._read_at.items() if at <= cutoff), key=self._read_at.__getitem__)
        room = RELEASE_WRITE_BYTES  # files written here, the most recently read users first: the event loop is
        for user_id in reversed(idle):  # quiet, but hundreds of users at once would hold it up for seconds
            size = self._bytes.get(user_id, 0)
            self._evict(user_id, spill=True, write=size <= room)
            room -= size
        return idle

    def drop(self, user_id: str) -> None:
        """Forget everything cached about the user (their records changed in a way the cache cannot follow)."""
        if self.mirror is not None:
            self.mirror("drop", (user_id,))
        self._drops += 1
        self._evict(user_id)
        if self.spill is not None:
            self.spill.discard(user_id)

    def _evict(self, user_id: str, *, spill: bool = False, write: bool = True) -> None:
        """Forget the user's entry (``spill``: evicted for room or released idle, kept in the spill if any;
        ``write``: written to a file if it has none that still holds it)."""
        entry = self._entries.pop(user_id, None)
        self._order.remove(user_id)
        if spill and entry is not None and self.spill is not None:
            self.spill.put(user_id, entry, write=write)
        self._read_at.pop(user_id, None)
        self._total -= self._bytes.pop(user_id, 0)
        self._too_big.pop(user_id, None)
        self._discard_load(user_id)

    def clear(self) -> None:
        """Empty the cache (after a reindex, say)."""
        if self.mirror is not None:
            self.mirror("clear", ())
        self._drops += 1
        for user_id in list(self._entries):
            self._evict(user_id)
        for user_id in self._loading:
            self._loading[user_id] = None
        self._too_big.clear()
        if self.spill is not None:
            self.spill.clear()

    def _note_write(self, user_id: str, write: Callable[[UserVectors], object]) -> None:
        """Keep a write for the load of this user in flight, if any (too many: the load is discarded)."""
        replay = self._loading.get(user_id)
        if replay is None:
            return
        if len(replay) >= MAX_REPLAYED_WRITES:
            self._loading[user_id] = None
        else:
            replay.append(write)

    def _discard_load(self, user_id: str) -> None:
        if user_id in self._loading:
            self._loading[user_id] = None


async def _cancel_all(tasks: Iterable[asyncio.Task[Any]]) -> None:
    """Cancel these tasks and wait until they have finished."""
    pending = list(tasks)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
