"""The management seam with every change announced: what the management API and the MCP server call.

``AnnouncedAdmin`` is the engine's ``MemoryAdmin``: its operations (``engine_admin.EngineAdmin``, passed in)
plus the events of what they change (``proxy.memory.events``: ``memory.created`` for added memories,
``memory.updated`` for edits, ``memory.deleted``, ``user.forgotten``) and ``remember``, which takes a fact the way
the write path does (``proxy.memory.write.stated``). Reads pass straight through. ``settle``: in ``memproxy
serve``'s memory writer, waits until every chat process has applied what a change wrote (``Mirror.settled``), so
the change answers only once the next chat, whichever process serves it, reads it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from datetime import datetime
from typing import Any, Protocol

from proxy.memory import MemoryEvents, MemoryOperations, RecordPage, SearchPreview
from proxy.memory.store import Kind, MemoryRecord
from proxy.memory.write import Stated, StatedFacts


class RecordReader(Protocol):
    """What the announcements read of the store: a record as it is before its delete."""

    async def get(self, user_id: str, id: str) -> MemoryRecord | None: ...


class AnnouncedAdmin:
    """The management operations of ``inner``, each change announced through ``events``."""

    def __init__(
        self, inner: MemoryOperations, store: RecordReader, events: MemoryEvents, stated: StatedFacts,
        settle: Callable[[], Awaitable[object]] | None = None,
    ) -> None:  # fmt: skip
        self._inner = inner
        self._store = store
        self._events = events
        self._stated = stated
        self._settle = settle

    async def _settled(self) -> None:
        if self._settle is not None:
            await self._settle()

    # --- changes, announced ----------------------------------------------------------------------------

    async def add_fact(
        self, user_id: str, text: str, importance: int | None = None, category: str | None = None,
        expires_at: datetime | None = None,
    ) -> MemoryRecord:  # fmt: skip
        """A fact stated directly (as written: an operator's word), announced as ``memory.created``."""
        record = await self._inner.add_fact(user_id, text, importance, category, expires_at)
        await self._settled()
        await self._events.emit("memory.created", user_id, [record])
        return record

    async def remember(self, user_id: str, text: str, expires_at: datetime | None = None) -> Stated:
        """A fact stated by an agent: screened, reconciled and linked like an extracted one (announced there)."""
        stated = await self._stated.add(user_id, text, expires_at)
        await self._settled()
        return stated

    async def add_many(self, user_id: str, records: Sequence[MemoryRecord]) -> list[str]:
        """Bulk add, idempotent by id; the new records other than turns announced as ``memory.created``."""
        new = set(await self._inner.add_many(user_id, records))
        await self._settled()
        announced = [r for r in records if r.id in new and r.kind is not Kind.TURN]
        if announced:
            await self._events.emit("memory.created", user_id, announced)
        return [r.id for r in records if r.id in new]

    async def edit(
        self, user_id: str, id: str, text: str | None = None, importance: int | None = None,
        expires_at: datetime | None = None,
    ) -> MemoryRecord | None:  # fmt: skip
        """The edited record, announced as ``memory.updated`` (with the id it replaces when the text changed)."""
        record = await self._inner.edit(user_id, id, text, importance, expires_at)
        await self._settled()
        if record is not None:
            extra = {"replaces": id} if record.id != id else {}
            await self._events.emit("memory.updated", user_id, [record], **extra)
        return record

    async def delete(self, user_id: str, id: str) -> bool:
        """Delete one record for good, announced as ``memory.deleted`` with the text it had."""
        record = await self._store.get(user_id, id)
        deleted = await self._inner.delete(user_id, id)
        await self._settled()
        if deleted and record is not None:
            await self._events.emit("memory.deleted", user_id, [record.replace(embedding=None)])
        return deleted

    async def forget_user(self, user_id: str) -> dict[str, int]:
        """Every trace of the user, then ``user.forgotten`` with the counts (after: the forget drops the user's
        pending deliveries with the rest of their jobs)."""
        counts = await self._inner.forget_user(user_id)
        await self._settled()
        await self._events.emit("user.forgotten", user_id, counts=counts)
        return counts

    # --- the rest, as the engine does it ---------------------------------------------------------------

    async def user_ids(self) -> list[str]:
        """Every user with at least one record."""
        return await self._inner.user_ids()

    async def get_memory(self, user_id: str, id: str) -> MemoryRecord | None:
        """One record of the user (history included), or None."""
        return await self._inner.get_memory(user_id, id)

    async def list_memories(
        self,
        user_id: str,
        kinds: Sequence[Kind] | None = None,
        *,
        limit: int = 50,
        cursor: str | None = None,
        include_invalid: bool = False,
    ) -> RecordPage:
        """The user's records, newest first, ``limit`` at a time."""
        return await self._inner.list_memories(
            user_id, kinds, limit=limit, cursor=cursor, include_invalid=include_invalid
        )

    def export_user(self, user_id: str) -> AsyncIterator[str]:
        """Every record of the user, history included, as JSON lines."""
        return self._inner.export_user(user_id)

    async def search(self, user_id: str, query: str, k: int = 10) -> SearchPreview:
        """What would be injected for a conversation whose last user message is ``query``."""
        return await self._inner.search(user_id, query, k)

    async def regenerate_insights(self, user_id: str) -> str:
        """Queue an insight regeneration (announced as ``insights.regenerated`` when it has run)."""
        return await self._inner.regenerate_insights(user_id)

    async def dead_letters(self, limit: int = 100) -> list[dict[str, Any]]:
        """Memory jobs (webhook deliveries included) that failed every attempt, the most recently failed first."""
        return await self._inner.dead_letters(limit)

    async def requeue_dead_letter(self, job_id: str) -> bool:
        """Give a dead job a fresh set of attempts; whether there was one."""
        return await self._inner.requeue_dead_letter(job_id)

    async def job(self, job_id: str) -> dict[str, Any] | None:
        """One job's row, or None."""
        return await self._inner.job(job_id)
