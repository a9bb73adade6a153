"""Memories' word pieces kept by the store: written with each memory by the shipped model, loaded with the user,
the same as the read path would compute from the text, and ranking exactly as the computed ones do."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import pytest

from proxy.memory.embedders.base import BaseEmbedder
from proxy.memory.pieces import MAX_TEXT_TERMS, TermVectors, memory_pieces, term_vectors_of
from proxy.memory.read.retrieval import retrieve
from proxy.memory.read.retrieval_settings import RetrievalSettings
from proxy.memory.store.memory_store import MemoryStore, StoreSettings
from proxy.memory.store.records import Kind, MemoryRecord
from proxy.memory.store.write_vectors import WriteVectors

T0 = datetime(2026, 3, 1, 12, tzinfo=UTC)
TEXTS = [
    "Caroline went to the LGBTQ support group on 7 May 2023",
    "Melanie is researching adoption agencies for her two kids",
    "I painted a sunrise over the lake last summer",
    "東京で寿司を食べました and then we walked home",
    "Remind me: the passport renewal is due in March",
    " ".join(f"word{i}" for i in range(2 * MAX_TEXT_TERMS)),  # a long pasted turn: its first terms only
    "",
]
QUESTIONS = ["What did Melanie research about adoption?", "When did Caroline go to the support group?", "passport"]


pytestmark = pytest.mark.asyncio(loop_scope="module")  # the shipped embedder (``local``) is loaded once


def memories(user: str) -> list[MemoryRecord]:
    return [
        MemoryRecord(user_id=user, kind=Kind.TURN, text=text or "ok", created_at=T0 + timedelta(minutes=i))
        for i, text in enumerate(TEXTS)
    ]


def vectors_of(embedder: BaseEmbedder) -> TermVectors:
    vectors = term_vectors_of(embedder)
    assert vectors is not None
    return vectors


async def load(store: MemoryStore, user: str) -> None:
    """Bring the user into the vector cache (any vector search does)."""
    await store.vector_search(user, await store.embedder.embed_query("anything"), 1)


async def test_each_memory_keeps_the_pieces_the_read_path_would_compute(local: BaseEmbedder, tmp_path: Path) -> None:
    """Loaded with the user: the same ids as ``memory_pieces`` of the text; none for an unknown id, nor for
    another model's vectors."""
    vectors = vectors_of(local)
    async with MemoryStore(StoreSettings(path=tmp_path / "data"), local) as store:
        records = await store.add(memories("maya"))
        await load(store, "maya")
        ids = [r.id for r in records]
        kept = store.term_pieces("maya", [*ids, "no-such-id"], vectors)
        for record, pieces in zip(records, kept, strict=False):
            assert pieces is not None
            assert pieces.tolist() == memory_pieces(vectors, record.text).tolist()
        assert kept[-1] is None
        assert store.term_pieces("maya", ids, object()) == [None] * len(ids)  # type: ignore[arg-type]
        assert store.term_pieces("bob", ids, vectors) == [None] * len(ids)  # another user's: never


async def test_an_edit_and_a_memory_written_after_the_load_keep_their_own(local: BaseEmbedder, tmp_path: Path) -> None:
    vectors = vectors_of(local)
    async with MemoryStore(StoreSettings(path=tmp_path / "data"), local) as store:
        first, *_ = await store.add(memories("maya"))
        await load(store, "maya")
        await store.update("maya", first.id, text="Caroline adopted a puppy called Oscar")
        [late] = await store.add([MemoryRecord(user_id="maya", kind=Kind.FACT, text="Maya's sister is Ana")])
        for record_id, text in ((first.id, "Caroline adopted a puppy called Oscar"), (late.id, "Maya's sister is Ana")):
            [pieces] = store.term_pieces("maya", [record_id], vectors)
            assert pieces is not None
            assert pieces.tolist() == memory_pieces(vectors, text).tolist()
    async with MemoryStore(StoreSettings(path=tmp_path / "data"), local) as store:  # and from disk again
        await load(store, "maya")
        [pieces] = store.term_pieces("maya", [first.id], vectors)
        assert pieces is not None
        assert pieces.tolist() == memory_pieces(vectors, "Caroline adopted a puppy called Oscar").tolist()


async def test_ranking_is_the_same_with_kept_pieces_and_without(
    local: BaseEmbedder, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store whose rows have no pieces (written before they were kept) ranks the same: the read path computes
    them from the texts."""
    settings = RetrievalSettings()
    now = T0 + timedelta(days=1)
    async with MemoryStore(StoreSettings(path=tmp_path / "kept"), local) as kept:
        await kept.add(memories("maya"))
        with_kept = [await retrieve(kept, local, [{"role": "user", "content": q}], "maya", settings, now)
                     for q in QUESTIONS]  # fmt: skip
        assert any(kept.term_pieces("maya", [c.record.id], vectors_of(local))[0] is not None
                   for result in with_kept for c in result.candidates)  # fmt: skip
    monkeypatch.setattr(WriteVectors, "pieces", lambda self, texts: None)
    async with MemoryStore(StoreSettings(path=tmp_path / "bare"), local) as bare:
        await bare.add(memories("maya"))
        without = [await retrieve(bare, local, [{"role": "user", "content": q}], "maya", settings, now)
                   for q in QUESTIONS]  # fmt: skip
        assert bare.term_pieces("maya", [c.record.id for c in without[0].candidates], vectors_of(local)) == [
            None
        ] * len(without[0].candidates)
    assert any("terms" in c.boosts for result in with_kept for c in result.candidates)  # term matching ran
    for a, b in zip(with_kept, without, strict=True):
        assert [c.record.text for c in a.candidates] == [c.record.text for c in b.candidates]
        assert np.allclose([c.fused for c in a.candidates], [c.fused for c in b.candidates])
        assert [c.boosts for c in a.candidates] == [c.boosts for c in b.candidates]
