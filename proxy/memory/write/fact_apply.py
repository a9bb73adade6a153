"""One reconciliation plan carried out on the store, its subjects kept linked and the change announced.

Shared by the facts job (facts extracted from chats) and stated facts (``stated``: an agent's ``add_memory``),
so that a fact comes in the same way whoever found it: ``add`` stores it, ``supersede`` stores it in place of
the target (kept as history), ``invalidate`` retires the target; the subject records of its names follow
(``subjects``); each change is announced (``memory.created``, ``memory.updated``, ``memory.deleted``).
"""

from __future__ import annotations

import structlog

from proxy.memory.events import MemoryEvents
from proxy.memory.store.memory_store import MemoryStore
from proxy.memory.store.records import MemoryRecord
from proxy.memory.write.extraction import Plan
from proxy.memory.write.subjects import SubjectLinker

log = structlog.get_logger("memproxy.writer")


async def apply_plan(
    store: MemoryStore, subjects: SubjectLinker, events: MemoryEvents, user_id: str, plan: Plan, record: MemoryRecord
) -> MemoryRecord | None:
    """Carry out ``plan`` for the new fact ``record``; the record stored (None when nothing was stored)."""
    # Subjects are linked before the fact is stored: once a fact can be found, so can its subjects.
    stored: MemoryRecord | None = None
    if plan.action == "add":
        await subjects.link(record)
        [stored] = await store.add([record])
        await events.emit("memory.created", user_id, [stored])
    elif plan.action == "supersede" and plan.target_id is not None:
        await subjects.link(record)
        if await store.get(user_id, plan.target_id) is None:
            [stored] = await store.add([record])  # the target went meanwhile (forgotten, or superseded by a retry)
            await events.emit("memory.created", user_id, [stored])
        else:
            stored = await store.supersede(user_id, plan.target_id, record)
            await subjects.unlink(user_id, plan.target_id)
            await events.emit("memory.updated", user_id, [stored], replaces=plan.target_id)
    elif plan.action == "invalidate" and plan.target_id is not None:
        retired = await store.update(user_id, plan.target_id, valid=False)
        await subjects.unlink(user_id, plan.target_id)
        if retired is not None:
            await events.emit("memory.deleted", user_id, [retired])
    log.info("memory.fact", action=plan.action, fact_id=record.id, target_id=plan.target_id)
    return stored
