"""The memory engine's management operations: what operators may see and do with what memory keeps.

``EngineAdmin`` is the engine's ``MemoryAdmin`` over its store and job queue; ``announced.AnnouncedAdmin`` wraps
it with the events of each change. A change here drops what the read side keeps of the user (``changed``: the
read cache and what their conversations carry); an add only drops the read cache (nothing carried is wrong).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from datetime import datetime
from typing import Any

from insights.scheduler import request_insights
from proxy.memory import SearchPreview
from proxy.memory.store import Kind, MemoryRecord, MemoryStore, Page, new_id, utcnow
from proxy.memory.write import JobQueue, LatestChats


class EngineAdmin:
    """The management operations over one store and one job queue."""

    def __init__(
        self,
        store: MemoryStore,
        jobs: JobQueue,
        latest: LatestChats,
        search: Callable[[str, str, int], Awaitable[SearchPreview]],
        changed: Callable[[str], None],
        added: Callable[[str], None],
    ) -> None:
        self._store = store
        self._jobs = jobs
        self._latest = latest
        self._search = search
        self._changed = changed  # a memory of the user was edited or deleted
        self._added = added  # a memory of the user was added

    async def search(self, user_id: str, query: str, k: int = 10) -> SearchPreview:
        """What would be injected for a conversation whose last user message is ``query``."""
        return await self._search(user_id, query, k)

    async def user_ids(self) -> list[str]:
        """Every user with at least one record."""
        return await self._store.user_ids()

    async def get_memory(self, user_id: str, id: str) -> MemoryRecord | None:
        """One record of the user (history included), or None."""
        return await self._store.get(user_id, id)

    async def list_memories(
        self,
        user_id: str,
        kinds: Sequence[Kind] | None = None,
        *,
        limit: int = 50,
        cursor: str | None = None,
        include_invalid: bool = False,
    ) -> Page:
        """The user's records, newest first, ``limit`` at a time (``ValueError`` for a bad cursor)."""
        return await self._store.list(user_id, kinds, limit=limit, cursor=cursor, include_invalid=include_invalid)

    def export_user(self, user_id: str) -> AsyncIterator[str]:
        """Every record of the user, history included, oldest first, as JSON lines."""
        return self._store.export(user_id)

    async def add_fact(
        self, user_id: str, text: str, importance: int | None = None, category: str | None = None,
        expires_at: datetime | None = None,
    ) -> MemoryRecord:  # fmt: skip
        """A fact the user (or an operator) states directly: embedded, indexed and searchable at once."""
        record = MemoryRecord(
            user_id=user_id,
            kind=Kind.FACT,
            text=text,
            importance=importance or 5,
            category=category,
            meta='{"source": "manual"}',
            expires_at=expires_at,
        )
        [stored] = await self._store.add([record])
        self._added(user_id)
        return stored

    async def add_many(self, user_id: str, records: Sequence[MemoryRecord]) -> list[str]:
        """Bulk add of the user's records, idempotent by id (one store submission); returns the ids that were new."""
        present = {record.id for record in await self._store.get_many(user_id, [r.id for r in records])}
        new = [record for record in records if record.id not in present]
        if new:
            await self._store.add(new)
            self._added(user_id)
        return [record.id for record in new]

    async def edit(
        self, user_id: str, id: str, text: str | None = None, importance: int | None = None,
        expires_at: datetime | None = None,
    ) -> MemoryRecord | None:  # fmt: skip
        """Edit a memory; a text edit keeps the old version as history (superseded by the new one)."""
        current = await self._store.get(user_id, id)
        if current is None or not current.valid:
            return None
        if text is None or text == current.text:
            changes = {"importance": importance, "expires_at": expires_at}
            changes = {name: value for name, value in changes.items() if value is not None}
            return await self._store.update(user_id, id, **changes) if changes else current
        new = current.replace(
            expires_at=expires_at or current.expires_at,
            id=new_id(),
            text=text,
            embedding=None,
            importance=importance or current.importance,
            created_at=utcnow(),
            updated_at=utcnow(),
            superseded_by=None,
        )
        stored = await self._store.supersede(user_id, id, new)
        self._changed(user_id)
        return stored

    async def delete(self, user_id: str, id: str) -> bool:
        """Delete one memory for good."""
        deleted = await self._store.delete(user_id, id)
        self._changed(user_id)
        return deleted

    async def forget_user(self, user_id: str) -> dict[str, int]:
        """Every trace of the user: queued jobs first (so none writes after), then the store and caches."""
        jobs = await self._jobs.forget_user(user_id)
        self._latest.forget(user_id)
        counts = await self._store.forget_user(user_id)
        self._changed(user_id)
        return {**counts, "jobs": jobs}

    async def regenerate_insights(self, user_id: str) -> str:
        """Queue an insight regeneration for the user now (collapses with pending triggers)."""
        return await request_insights(self._jobs, user_id, reason="manual")

    async def dead_letters(self, limit: int = 100) -> list[dict[str, Any]]:
        """Memory jobs that failed every attempt, the most recently failed first."""
        return await self._jobs.dead_letters(limit)

    async def requeue_dead_letter(self, job_id: str) -> bool:
        """Give a dead job a fresh set of attempts; whether there was one."""
        return await self._jobs.requeue(job_id)

    async def job(self, job_id: str) -> dict[str, Any] | None:
        """One job's row, or None."""
        return await self._jobs.get(job_id)
