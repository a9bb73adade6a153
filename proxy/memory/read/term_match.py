"""Term matching: how much of the query's vocabulary a memory holds, softly (pure functions).

BM25 counts exact stems only and the dense arm compares whole texts, so a turn that holds every word the
question asks about, a few of them in another form ("researching" for "research", "children" for "kids"),
can rank below one that only shares its common words. Term matching scores the best fused candidates by soft
coverage: for each content word piece of the query, the best cosine between it and any piece of the memory
(token rows of the static embedding model, whose rows are word vectors: ``TermVectors``), rescaled from
``[MATCH_FLOOR, 1]`` to ``[0, 1]``, averaged with IDF weights taken among the candidates themselves (a piece
that nearly every candidate holds, such as a name the question and every turn of that person share, says
little). Only candidates are scored (``max_candidates`` texts), never the whole store.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np
import numpy.typing as npt

from proxy.memory.pieces import FloatArray, IntArray, TermVectors, memory_pieces
from proxy.memory.read.boosts import Lifts
from proxy.memory.read.byte_cache import MIB, byte_cache, text_bytes
from proxy.memory.store.records import MemoryRecord

# Cosines below this count as no match (LoCoMo tune split: 0.2, 0.3 and 0.4 within 0.004 R@10 of each other).
MATCH_FLOOR = 0.3
CACHED_BYTES = 16 * MIB  # memories' piece sets kept (a few hundred bytes each, and their texts): candidates recur
StoredPieces = Callable[[Sequence[str]], Sequence[IntArray | None]]  # memory ids -> the pieces the store keeps


def soft_coverage(
    query: IntArray,
    docs: Sequence[IntArray],
    cosines: Callable[[IntArray, IntArray], FloatArray],
    floor: float = MATCH_FLOOR,
) -> npt.NDArray[np.float64]:
    """Per doc, in [0, 1]: the IDF-weighted mean over the query's pieces of their best match in the doc.

    A piece's match is its highest cosine to any of the doc's pieces, mapped from ``[floor, 1]`` onto
    ``[0, 1]`` (1: the piece itself). Its weight is ``log(1 + n / df)``, ``df`` the number of the ``n`` docs
    that hold the piece itself (at least 1). A doc without pieces scores 0. Each doc's pieces are distinct, as
    ``TermVectors.pieces`` gives them.
    """
    out = np.zeros(len(docs), dtype=np.float64)
    lengths = np.fromiter(map(len, docs), dtype=np.intp, count=len(docs))
    held = np.flatnonzero(lengths)
    if not len(query) or not held.size:
        return out
    pieces = np.concatenate(docs)  # the docs' pieces, one doc after another (empty docs add nothing)
    vocab, column = _distinct(pieces)
    scaled = cosines(query, vocab)  # mapped from [floor, 1] onto [0, 1] in place (np.clip costs more at this size)
    scaled -= floor
    scaled *= 1.0 / (1.0 - floor)
    np.maximum(scaled, 0.0, out=scaled)
    np.minimum(scaled, 1.0, out=scaled)
    matches = scaled[:, column]  # query x all pieces
    starts = np.zeros(held.size, dtype=np.intp)
    np.cumsum(lengths[held][:-1], out=starts[1:])
    best = np.maximum.reduceat(matches, starts, axis=1)  # query pieces x docs
    idf = np.log1p(len(docs) / np.maximum(_doc_counts(query, vocab, column), 1))
    out[held] = idf @ best / idf.sum()
    return out


def _distinct(pieces: IntArray) -> tuple[IntArray, npt.NDArray[np.int32]]:
    """``np.unique(pieces, return_inverse=True)`` for piece ids (small non-negative integers: rows of the
    model's table) through a table as long as the largest id: a table lookup instead of a sort (int32 slots:
    30,522 of them stay below the 128 KiB past which the server maps an allocation)."""
    size = int(pieces.max()) + 1
    seen = np.zeros(size, dtype=np.bool_)
    seen[pieces] = True
    vocab = np.flatnonzero(seen)
    slot = np.empty(size, dtype=np.int32)
    slot[vocab] = np.arange(len(vocab), dtype=np.int32)
    return vocab.astype(pieces.dtype, copy=False), slot[pieces]


def _doc_counts(query: IntArray, vocab: IntArray, column: npt.NDArray[np.int32]) -> npt.NDArray[np.intp]:
    """How many docs hold each query piece: its occurrences among the docs' pieces (``vocab[column]``), since
    no doc holds a piece twice."""
    counts = np.bincount(column, minlength=len(vocab))
    at = np.minimum(np.searchsorted(vocab, query), len(vocab) - 1)
    return np.where(vocab[at] == query, counts[at], 0)


def term_match_lifts(
    records: Sequence[MemoryRecord],
    fused: Mapping[str, float],
    query_terms: Sequence[str],
    vectors: TermVectors,
    weight: float,
    depth: int,
    stored: StoredPieces | None = None,
) -> Lifts:
    """``weight`` x the soft coverage of the query's content words (``Query.terms``), for the ``depth`` best
    fused memories by ``fused`` (the others get nothing). ``stored``: the memories' pieces as the store wrote
    them (by ``vectors``' model; None where it has none), else they are computed from the texts
    (``text_pieces``)."""
    query = vectors.pieces(query_terms)
    if not len(query) or weight <= 0:
        return {}
    scores = [fused[r.id] for r in records]
    pool = [records[i] for i in sorted(range(len(scores)), key=scores.__getitem__, reverse=True)[:depth]]
    ids = [r.id for r in pool]
    known = stored(ids) if stored is not None else [None] * len(pool)
    docs = [text_pieces[vectors, r.text] if k is None else k for r, k in zip(pool, known, strict=True)]
    coverage = soft_coverage(query, docs, vectors.cosines).tolist()
    return {rid: weight * s for rid, s in zip(ids, coverage, strict=True) if s > 0.0}


@byte_cache(CACHED_BYTES, lambda key, pieces: text_bytes(key[1]) + pieces.nbytes)
def text_pieces(key: tuple[TermVectors, str]) -> IntArray:
    """A memory's pieces (``memory_pieces``) by a model's vectors, for a (vectors, text) key; cached (read-only):
    for memories the store wrote without them."""
    vectors, text = key
    pieces = memory_pieces(vectors, text)
    pieces.setflags(write=False)
    return pieces
