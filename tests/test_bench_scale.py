"""The scale benchmark's memory sequence: 100k distinct memories of one user from a few thousand embedded texts."""

from __future__ import annotations

from datetime import timedelta

import numpy as np

from bench.scale import Corpus
from proxy.memory.store.records import Kind, MemoryRecord, utcnow


def _base(n: int) -> list[MemoryRecord]:
    """``n`` turns with random unit vectors, and one insight."""
    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((n + 1, 384)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    now = utcnow()
    turns = [
        MemoryRecord(user_id="template", kind=Kind.TURN, text=f"turn {i}", embedding=vectors[i], created_at=now,
                     conversation_id="c1", role="user")
        for i in range(n)
    ]  # fmt: skip
    return [*turns, MemoryRecord(user_id="template", kind=Kind.INSIGHT, text="insight", embedding=vectors[n])]


def test_variants_are_distinct_unit_vectors_near_their_originals_and_older() -> None:
    """Past the base, every memory has its own text, a unit vector close to its original's, and an older date."""
    base = _base(50)
    records = Corpus(base, seed=1).records("u", 0, 251)
    assert len({r.text for r in records}) == len(records) == 251
    assert {r.user_id for r in records} == {"u"}
    assert len({r.id for r in records}) == 251
    variants = records[len(base) :]
    assert all(r.kind == Kind.TURN for r in variants)  # insights are never copied
    for variant in variants:
        original = next(b for b in base if variant.text.endswith(" " + b.text))
        vector = np.asarray(variant.embedding)
        assert abs(np.linalg.norm(vector) - 1) < 1e-5
        assert 0.9 < float(vector @ np.asarray(original.embedding)) < 0.9999
        assert variant.created_at <= original.created_at - timedelta(days=45)


def test_growing_in_steps_stores_the_same_memories_as_one_fill() -> None:
    """Filling to 40, 1200 then 2500 yields the same texts and vectors as filling to 2500 at once (same seed)."""
    corpus = Corpus(_base(30), seed=3)
    steps = corpus.records("u", 0, 40) + corpus.records("u", 40, 1200) + corpus.records("u", 1200, 2500)
    whole = corpus.records("u", 0, 2500)
    assert [r.text for r in steps] == [r.text for r in whole]
    assert all(np.array_equal(a.embedding, b.embedding) for a, b in zip(steps, whole, strict=True))
