"""Touch buffering: access times noted at once in memory and written to LanceDB now and then.

Every read that returns a record notes that it was used. Writing each note would cost a LanceDB commit per
read, so notes wait here (the latest time per record) until the store's ``memory-touch`` ticker writes them;
meanwhile every read shows the pending times (the store's cache holds them; records read from LanceDB get
them here). A record whose access time was written less than ``granularity`` ago is not noted again and keeps
the written time, in the cache as on disk: recency is
measured in hours and days, and rewriting the same rows every minute held the store's writes up for a good
part of every minute under a busy chat.

An access within ``granularity`` of the record's creation (``young``) is shown to reads but never written: it
says what ``created_at`` already says, to within the granularity, and writing it rewrote the row (its vector
included) of nearly every new memory once more, since a chat's new memories are the ones its next requests use
(``make bench-writes``: a sixth of the writer's LanceDB work). Shown times are kept ``granularity`` long.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping
from datetime import datetime, timedelta

from proxy.memory.store.records import MemoryRecord

Pending = dict[str, dict[str, datetime]]  # user id -> record id -> access time
SHOWN_STEP = timedelta(minutes=1)  # a pending access time moves by at least this much (recency counts hours)


class TouchBuffer:
    """The access times noted since the last write, per user and record."""

    def __init__(self, granularity: timedelta = timedelta(0)) -> None:
        self.granularity = granularity
        self._pending: Pending = {}
        self._written: Pending = {}  # access times written within the last ``granularity``
        self._shown: Pending = {}  # young records' access times: shown to reads, never written
        self._last_write: datetime | None = None
        self._pruned: datetime | None = None  # when ``_shown`` last lost what is older than the granularity

    def __bool__(self) -> bool:
        return bool(self._pending)

    def note(self, user_id: str, ids: Iterable[str], when: datetime, young: Collection[str] = ()) -> list[str]:
        """Note that the user's records ``ids`` were used at ``when`` (a later note wins); returns the ids whose
        shown access time should move to ``when``: noted ones that were not pending, or pending since at least
        ``SHOWN_STEP``. Records whose access time was written within the granularity are not noted (they
        keep the written one); a record used again within the step keeps showing its first time (the
        store's cache then copies no record for it: under a busy chat, the same memories are used many
        times a minute). Those of ``young`` (created within the granularity before ``when``) are shown only."""
        written = self._written.get(user_id, {})
        ids = [i for i in ids if (at := written.get(i)) is None or when - at >= self.granularity]
        if not ids:  # no empty entry: the writer takes the latest time of what is pending
            return ids
        if self._pruned is None or when - self._pruned >= self.granularity:  # once per granularity
            self._shown, self._pruned = _since(self._shown, when - self.granularity), when
        shown = []
        for record_id in ids:
            kept = (self._shown if record_id in young else self._pending).setdefault(user_id, {})
            before = kept.get(record_id)
            if before is None or when - before >= SHOWN_STEP:
                shown.append(record_id)
                kept[record_id] = when if before is None else max(when, before)
        return shown

    def pending_of(self, user_id: str) -> Mapping[str, datetime]:
        """The user's access times not on disk: pending, or shown only (record id -> time; read-only)."""
        pending, shown = self._pending.get(user_id), self._shown.get(user_id)
        return {**shown, **pending} if pending and shown else pending or shown or {}

    def take(self) -> Pending:
        """Every pending note, leaving none (``restore`` them if writing fails); writes older than the
        granularity are forgotten here, once a flush (``wrote`` runs once per chunk of it)."""
        pending, self._pending = self._pending, {}
        if self._last_write is not None:
            self._written = _since(self._written, self._last_write - self.granularity)
        return pending

    def wrote(self, pending: Pending, at: datetime) -> None:
        """Note that ``pending`` reached LanceDB at ``at``."""
        if self.granularity <= timedelta(0):
            return
        for user_id, ids in pending.items():
            self._written.setdefault(user_id, {}).update(dict.fromkeys(ids, at))
        self._last_write = at

    def restore(self, pending: Pending) -> None:
        """Put notes that could not be written back, for the next round."""
        for user_id, ids in pending.items():
            self._pending.setdefault(user_id, {}).update(ids)

    def drop_user(self, user_id: str) -> None:
        """Forget the user's notes (the user is being forgotten)."""
        for kept in (self._pending, self._written, self._shown):
            kept.pop(user_id, None)

    def drop(self, user_id: str, record_id: str) -> None:
        """Forget the note of one record (it is being deleted)."""
        for kept in (self._pending, self._written, self._shown):
            kept.get(user_id, {}).pop(record_id, None)

    def toucher(self, user_id: str) -> Callable[[MemoryRecord], MemoryRecord]:
        """Applies the user's pending (and shown) access times to their records; identity when there are none."""
        touches = self.pending_of(user_id)
        if not touches:
            return _same

        def touched(record: MemoryRecord) -> MemoryRecord:
            at = touches.get(record.id)
            if at is None or (record.last_accessed_at is not None and record.last_accessed_at >= at):
                return record
            return record.replace(last_accessed_at=at)

        return touched

    def touched(self, record: MemoryRecord) -> MemoryRecord:
        """``record`` with its pending access time applied."""
        return self.toucher(record.user_id)(record)


def _same(record: MemoryRecord) -> MemoryRecord:
    return record


def _since(times: Pending, horizon: datetime) -> Pending:
    """``times`` without the entries at or before ``horizon``."""
    kept = {user: {i: t for i, t in ids.items() if t > horizon} for user, ids in times.items()}
    return {user: ids for user, ids in kept.items() if ids}


def touch_chunks(pending: Pending, size: int) -> list[Pending]:
    """``pending`` split into parts of at most ``size`` records (a user's records may span parts)."""
    chunks: list[Pending] = []
    current: Pending = {}
    count = 0
    for user_id, ids in pending.items():
        for record_id, when in ids.items():
            if count == size:
                chunks.append(current)
                current, count = {}, 0
            current.setdefault(user_id, {})[record_id] = when
            count += 1
    if current:
        chunks.append(current)
    return chunks
