"""Tests of term matching: soft coverage of the query's word pieces among the fused candidates."""

from __future__ import annotations

import math
from collections.abc import Sequence
from datetime import UTC, datetime

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.memory.pieces import MAX_TEXT_TERMS, term_vectors_of
from proxy.memory.read.candidates import BM25, DENSE, ArmHit
from proxy.memory.read.fusion import fuse
from proxy.memory.read.query import build_query
from proxy.memory.read.retrieval_settings import RetrievalSettings
from proxy.memory.read.term_match import (
    MATCH_FLOOR,
    _distinct,
    soft_coverage,
    term_match_lifts,
    text_pieces,
)
from proxy.memory.store.records import Kind, MemoryRecord

T0 = datetime(2026, 3, 1, 12, tzinfo=UTC)

# A toy vocabulary: one token per word, 2-d unit vectors; "research" and "researching" are near (cos 0.96).
WORDS = ("caroline", "research", "researching", "adoption", "painting", "weather")
ANGLES = {"caroline": 0.0, "research": 1.6, "researching": 1.88, "adoption": 3.2, "painting": 4.7, "weather": 5.6}


class ToyVectors:
    """``TermVectors`` over ``WORDS``: word i is token i, its row the unit vector at ``ANGLES[word]``."""

    def __init__(self) -> None:
        self.table = np.array([[np.cos(ANGLES[w]), np.sin(ANGLES[w])] for w in WORDS], dtype=np.float32)

    def pieces(self, words: Sequence[str]) -> npt.NDArray[np.int64]:
        return np.unique(np.array([WORDS.index(w) for w in words if w in WORDS], dtype=np.int64))

    def cosines(self, first: npt.NDArray[np.int64], second: npt.NDArray[np.int64]) -> npt.NDArray[np.float32]:
        return self.table[first] @ self.table[second].T


def _ids(*words: str) -> npt.NDArray[np.int64]:
    return np.array(sorted(WORDS.index(w) for w in words), dtype=np.int64)


def _rec(text: str, rid: str) -> MemoryRecord:
    return MemoryRecord(user_id="u", kind=Kind.TURN, text=text, id=rid, created_at=T0)


def test_soft_coverage_is_one_for_every_piece_and_zero_for_none() -> None:
    """A doc holding all the query's pieces scores 1; one with only unrelated pieces (or none) scores 0."""
    toy = ToyVectors()
    query = _ids("research", "adoption")
    scores = soft_coverage(query, [_ids("research", "adoption", "painting"), _ids("weather"), _ids()], toy.cosines)
    assert scores.tolist() == pytest.approx([1.0, 0.0, 0.0])


def _coverage_by_definition(query: list[int], docs: list[list[int]], toy: ToyVectors) -> list[float]:
    """``soft_coverage`` as its docstring defines it, one doc and one query piece at a time."""
    idf = [math.log1p(len(docs) / max(1, sum(q in d for d in docs))) for q in query]
    out = []
    for doc in docs:
        if not doc:
            out.append(0.0)
            continue
        best = [max(min(max((float(toy.cosines(np.array([q]), np.array([p]))[0, 0]) - MATCH_FLOOR)
                               / (1 - MATCH_FLOOR), 0.0), 1.0) for p in doc) for q in query]  # fmt: skip
        out.append(sum(w * b for w, b in zip(idf, best, strict=True)) / sum(idf))
    return out


@settings(max_examples=200, deadline=None)
@given(
    query=st.lists(st.integers(0, len(WORDS) - 1), min_size=1, max_size=4, unique=True),
    docs=st.lists(st.lists(st.integers(0, len(WORDS) - 1), max_size=5, unique=True), min_size=1, max_size=8),
)
def test_soft_coverage_is_its_definition(query: list[int], docs: list[list[int]]) -> None:
    toy = ToyVectors()
    got = soft_coverage(np.array(sorted(query)), [np.array(sorted(d), dtype=np.int64) for d in docs], toy.cosines)
    assert np.allclose(got, _coverage_by_definition(sorted(query), [sorted(d) for d in docs], toy), atol=1e-6)


def test_a_near_form_counts_partly_and_a_far_word_not_at_all() -> None:
    """ "researching" for "research" is a partial match (cosine rescaled from the floor); "painting" is none."""
    toy = ToyVectors()
    cosine = float(np.cos(ANGLES["researching"] - ANGLES["research"]))
    scores = soft_coverage(_ids("research"), [_ids("researching"), _ids("painting")], toy.cosines)
    assert scores[0] == pytest.approx((cosine - MATCH_FLOOR) / (1 - MATCH_FLOOR))
    assert 0.0 < scores[0] < 1.0
    assert scores[1] == 0.0


def test_a_piece_every_candidate_holds_weighs_less() -> None:
    """IDF among the candidates: the doc holding the rare piece beats the one holding the common one."""
    toy = ToyVectors()
    query = _ids("caroline", "adoption")
    docs = [_ids("caroline", "adoption"), _ids("caroline"), _ids("caroline", "weather"), _ids("adoption")]
    scores = soft_coverage(query, docs, toy.cosines)
    assert scores[0] == pytest.approx(1.0)
    assert scores[3] > 0.5 > scores[1] == scores[2] > 0.0


def test_a_query_without_pieces_scores_nothing() -> None:
    """No query pieces (only stop words, or words the model does not know): every doc scores 0."""
    assert soft_coverage(_ids(), [_ids("research")], ToyVectors().cosines).tolist() == [0.0]
    assert soft_coverage(_ids("research"), [], ToyVectors().cosines).tolist() == []


def test_lifts_go_to_the_best_candidates_only() -> None:
    """Only the ``depth`` best fused memories by fused score are scored; a candidate without a match gets no lift."""
    toy = ToyVectors()
    good, other, deep = (_rec(t, rid) for t, rid in (("Caroline: researching adoption", "a"), ("weather", "b"),
                                                      ("adoption", "c")))  # fmt: skip
    fused = {"a": 1.0, "b": 0.9, "c": 0.1}
    lifts = term_match_lifts([good, other, deep], fused, ("research", "adoption"), toy, 0.5, depth=2)
    assert set(lifts) == {"a"}
    assert 0.0 < lifts["a"] < 0.5


def test_fuse_ranks_the_turn_that_holds_the_query_words_first() -> None:
    """With term matching, a turn holding the question's words outranks one the arms liked a little more."""
    toy = ToyVectors()
    chatty, answer = _rec("weather painting", "chatty"), _rec("researching adoption", "answer")
    arms = {DENSE: [ArmHit(chatty, 0.6), ArmHit(answer, 0.5)], BM25: [ArmHit(chatty, 2.0), ArmHit(answer, 1.5)]}
    query = build_query([{"role": "user", "content": "What did she research about adoption?"}])
    assert query is not None
    settings = RetrievalSettings(neighbour_weight=0, date_weight=0, day_weight=0)
    without = fuse(arms, query, settings)
    with_terms = fuse(arms, query, settings, term_vectors=toy)
    assert [c.id for c in without.candidates] == ["chatty", "answer"]
    assert [c.id for c in with_terms.candidates] == ["answer", "chatty"]
    assert with_terms.candidates[0].boosts["terms"] > 0
    assert [c.id for c in fuse(arms, query, settings.model_copy(update={"term_match_weight": 0.0}), term_vectors=toy)
            .candidates] == ["chatty", "answer"]  # fmt: skip


def test_term_vectors_of_an_embedder_without_them_is_none() -> None:
    """Embedders that lend no static model (ONNX without a static query side, remote, fakes) give None."""

    class Lending:
        def term_vectors(self) -> ToyVectors:
            return ToyVectors()

    assert term_vectors_of(object()) is None
    assert isinstance(term_vectors_of(Lending()), ToyVectors)


def test_only_a_long_memorys_first_words_count() -> None:
    """A long pasted memory is matched on its first ``MAX_TEXT_TERMS`` content words (a bounded cost)."""
    toy = ToyVectors()
    long_text = " ".join(["weather"] * MAX_TEXT_TERMS + [f"w{i}" for i in range(MAX_TEXT_TERMS)] + ["adoption"])
    assert text_pieces[toy, "Caroline: adoption weather"].tolist() == _ids("caroline", "adoption", "weather").tolist()
    assert text_pieces[toy, long_text].tolist() == _ids("weather").tolist()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 30_521), min_size=1, max_size=300))
def test_distinct_pieces_are_numpys_unique_with_inverse(pieces: list[int]) -> None:
    """Term matching's table-based distinct pieces equal np.unique's (sorted vocabulary, inverse)."""
    array = np.array(pieces, dtype=np.int64)
    vocab, column = _distinct(array)
    want_vocab, want_column = np.unique(array, return_inverse=True)
    assert vocab.tolist() == want_vocab.tolist()
    assert vocab.dtype == array.dtype
    assert column.tolist() == want_column.tolist()
