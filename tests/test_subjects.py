"""Tests of subject records: created from the names facts carry, linked to those facts, kept current."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from proxy.memory.read.names import NameIndex
from proxy.memory.store.memory_store import MemoryStore, StoreSettings
from proxy.memory.store.records import Kind, MemoryRecord
from proxy.memory.write.subjects import SubjectLinker, subject_id, subject_names
from tests.support.embedder import HashingEmbedder


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[MemoryStore]:
    """A real store (LanceDB and Tantivy on disk) with the deterministic test embedder."""
    async with MemoryStore(StoreSettings(path=tmp_path / "data"), HashingEmbedder()) as opened:
        yield opened


def _fact(text: str, *entities: str, user: str = "ann", category: str = "relationship") -> MemoryRecord:
    return MemoryRecord(user_id=user, kind=Kind.FACT, text=text, entities=entities, category=category)


async def _stored_fact(store: MemoryStore, linker: SubjectLinker, fact: MemoryRecord) -> MemoryRecord:
    """A fact as the writer stores it: subjects linked, then the fact added."""
    await linker.link(fact)
    await store.add([fact])
    return fact


async def _subjects(store: MemoryStore, user: str) -> dict[str, MemoryRecord]:
    page = await store.list(user, [Kind.SUBJECT], limit=100, include_invalid=True)
    return {s.text: s for s in page.data}


def test_names_worth_a_subject_skip_pronouns_and_single_letters() -> None:
    """ "Sam Okafor" and "Lisbon" become subjects; "I", "user" and "x" do not; spacing is tidied."""
    fact = _fact("...", "Sam  Okafor", "Lisbon", "I", "user", "x", "sam okafor")
    assert subject_names(fact) == {"sam okafor": "Sam Okafor", "lisbon": "Lisbon"}


async def test_facts_naming_a_person_share_one_subject_linked_to_both(store: MemoryStore) -> None:
    """Two facts about Sam create one "Sam" subject (a person) linked to both; another user's Sam is separate."""
    linker = SubjectLinker(store)
    first = await _stored_fact(store, linker, _fact("Sam is my brother", "Sam"))
    second = await _stored_fact(store, linker, _fact("Sam lives in Oslo", "Sam", "Oslo", category="location"))
    other = await _stored_fact(store, linker, _fact("Sam is my boss", "Sam", user="ben"))
    subjects = await _subjects(store, "ann")
    assert set(subjects) == {"Sam", "Oslo"}
    assert subjects["Sam"].source_ids == (first.id, second.id)
    assert subjects["Sam"].subject_kind == "person"
    assert subjects["Oslo"].source_ids == (second.id,)
    assert (await _subjects(store, "ben"))["Sam"].source_ids == (other.id,)
    assert subjects["Sam"].id == subject_id("ann", "sam") != subject_id("ben", "Sam")


async def test_linking_twice_changes_nothing(store: MemoryStore) -> None:
    """A replayed job links the same fact again: the subject still lists it once."""
    linker = SubjectLinker(store)
    fact = await _stored_fact(store, linker, _fact("Sam is my brother", "Sam"))
    await linker.link(fact)
    assert (await _subjects(store, "ann"))["Sam"].source_ids == (fact.id,)


async def test_a_retired_fact_is_unlinked_and_an_empty_subject_turns_invalid(store: MemoryStore) -> None:
    """Superseding "lives in Oslo" by "lives in Bergen" moves the link; Oslo, left with no fact, is invalid."""
    linker = SubjectLinker(store)
    oslo = await _stored_fact(store, linker, _fact("Sam lives in Oslo", "Sam", "Oslo"))
    bergen = _fact("Sam lives in Bergen", "Sam", "Bergen")
    await linker.link(bergen)
    await store.supersede("ann", oslo.id, bergen)
    await linker.unlink("ann", oslo.id)
    subjects = await _subjects(store, "ann")
    assert subjects["Sam"].source_ids == (bergen.id,)
    assert subjects["Oslo"].valid is False
    assert subjects["Bergen"].valid is True


async def test_the_name_index_finds_facts_through_their_subjects(store: MemoryStore) -> None:
    """The read path's name index, built from the stored subjects, maps "sam" to the facts about Sam."""
    linker = SubjectLinker(store)
    fact = await _stored_fact(store, linker, _fact("My brother plays chess", "Sam"))
    page = await store.list("ann", [Kind.SUBJECT], limit=100)
    index = NameIndex.build(page.data)
    assert index.names["sam"] == (fact.id,)
    assert index.subjects == 1
