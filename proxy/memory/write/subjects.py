"""Subject records: the people, places and projects a user's facts name, each linked to those facts.

The write path already knows what a fact is about: the extraction model lists the named entities of every
fact ("Sam", "Lisbon", "the Atlas project"). Each usable name becomes one subject record of the user (kind
``subject``, text = the name as first written, ``source_ids`` = the valid facts that name it), with a stable
id (uuid5 of the user and the normalised name), so that a replayed job finds the same subject. The entity
arm's name index reads subjects' links, and subject fusion lifts the facts of the subjects nearest the query.

Kept current as facts change: a stored fact is linked to its names' subjects; a fact that is superseded or
invalidated is unlinked, and a subject left without valid facts is marked invalid (kept as history like the
facts). ``subject_kind`` is a coarse type read from the fact's category (``person`` for relationships,
``place`` for locations, ``project`` for work and education, else ``entity``); the first fact decides it.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence
from typing import Protocol

import structlog

from proxy.memory.store.records import Kind, MemoryRecord
from proxy.memory.words import normalise_name

log = structlog.get_logger("memproxy.subjects")

ID_NAMESPACE = uuid.UUID("0c7a3f1e-5d2b-4e8a-9f61-2b7d4c9e1a35")
KIND_OF_CATEGORY = {"relationship": "person", "location": "place", "work": "project", "education": "project"}
_NOT_NAMES = frozenset({"i", "me", "my", "we", "us", "you", "he", "she", "it", "they", "the", "a", "an", "user"})


class SubjectStore(Protocol):
    """What subject upkeep needs of the store (``MemoryStore`` has this shape)."""

    async def add(self, records: Sequence[MemoryRecord]) -> list[MemoryRecord]: ...

    async def get(self, user_id: str, id: str) -> MemoryRecord | None: ...

    async def update(self, user_id: str, id: str, **changes: object) -> MemoryRecord | None: ...


def subject_id(user_id: str, name: str) -> str:
    """The stable record id of one user's subject of this (normalised) name."""
    return uuid.uuid5(ID_NAMESPACE, f"{user_id}/{normalise_name(name)}").hex


def subject_names(fact: MemoryRecord) -> dict[str, str]:
    """Normalised name -> name as written, for the fact's entities worth a subject (not pronouns, not 1 letter)."""
    out: dict[str, str] = {}
    for entity in fact.entities:
        key = normalise_name(entity)
        if key and key not in _NOT_NAMES and not (len(key) < 2 and key.isascii()):
            out.setdefault(key, " ".join(entity.split()))
    return out


def new_subject(fact: MemoryRecord, name: str) -> MemoryRecord:
    """A subject record for ``name``, linked to ``fact``."""
    return MemoryRecord(
        user_id=fact.user_id,
        kind=Kind.SUBJECT,
        text=name,
        id=subject_id(fact.user_id, name),
        subject_kind=KIND_OF_CATEGORY.get(fact.category or "", "entity"),
        source_ids=(fact.id,),
    )


def relinked(subject: MemoryRecord, add: str | None = None, remove: str | None = None) -> tuple[str, ...]:
    """The subject's linked fact ids with ``add`` appended (once) and ``remove`` left out, order kept."""
    ids = [i for i in subject.source_ids if i != remove]
    if add is not None and add not in ids:
        ids.append(add)
    return tuple(ids)


class SubjectLinker:
    """Keeps one store's subject records linked to the valid facts that name them.

    One lock serialises the read-modify-write of subjects, so that two facts naming the same person at
    once both end up linked.
    """

    def __init__(self, store: SubjectStore) -> None:
        self._store = store
        self._lock = asyncio.Lock()

    async def link(self, fact: MemoryRecord) -> int:
        """Link a stored, valid fact to the subjects of its names (creating them); returns how many."""
        names = subject_names(fact)
        async with self._lock:
            for name in names.values():
                await self._link_one(fact, name)
        return len(names)

    async def _link_one(self, fact: MemoryRecord, name: str) -> None:
        current = await self._store.get(fact.user_id, subject_id(fact.user_id, name))
        if current is None:
            await self._store.add([new_subject(fact, name)])
            log.info("memory.subject", action="created", subject_id=subject_id(fact.user_id, name), facts=1)
            return
        ids = relinked(current, add=fact.id)
        if ids != current.source_ids or not current.valid:
            await self._store.update(fact.user_id, current.id, source_ids=ids, valid=True)

    async def unlink(self, user_id: str, fact_id: str) -> None:
        """Unlink a fact that is no longer valid from its subjects; a subject left without facts turns invalid."""
        fact = await self._store.get(user_id, fact_id)
        if fact is None:
            return
        async with self._lock:
            for name in subject_names(fact).values():
                current = await self._store.get(user_id, subject_id(user_id, name))
                if current is None or fact_id not in current.source_ids:
                    continue
                ids = relinked(current, remove=fact_id)
                await self._store.update(user_id, current.id, source_ids=ids, valid=bool(ids))
