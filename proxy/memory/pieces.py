"""Word pieces of memories: the token ids term matching compares (``read.term_match``), made once per memory.

A static embedding model's token rows are word vectors (``TermVectors``). Term matching scores a memory by the
pieces of its first ``MAX_TEXT_TERMS`` content words (``memory_pieces``). The store computes them when it writes
a memory, beside its vector, and keeps them in the table (``pieces`` column), so that no request pays for them
(a tokenisation for each of the dozens of memories first seen as candidates) and a user loaded again after
idling has them at once; the read path computes (and caches) them only for memories written without them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, cast

import numpy as np
import numpy.typing as npt

from proxy.memory.words import terms

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float32]

MAX_TEXT_TERMS = 128  # a memory's first content words that count (of its first 16 x this many characters): bounds the
# cost of a long pasted turn; the static model's own vector reads no more than its first 256 tokens either


class TermVectors(Protocol):
    """Word piece vectors of a static embedding model (``StaticModel`` has this shape; hashable, since memories'
    piece sets are cached per model)."""

    def __hash__(self) -> int: ...

    def pieces(self, words: Sequence[str]) -> IntArray:
        """The distinct token ids of ``words``, sorted."""
        ...

    def cosines(self, first: IntArray, second: IntArray) -> FloatArray:
        """The cosine of every token of ``first`` with every token of ``second`` (shape ``(len(first),
        len(second))``): a new array, the caller's to change."""
        ...


def term_vectors_of(embedder: object) -> TermVectors | None:
    """The word piece vectors ``embedder`` lends from its ``term_vectors()`` method (a static document model, or a
    static query side: the default); None when it has no such method, none to lend, or has not loaded them yet.
    Looked up by name: an ``isinstance`` check against a runtime protocol walks the protocol's members on every
    call (and it is called twice a read)."""
    lend = getattr(embedder, "term_vectors", None)
    return cast("TermVectors | None", lend()) if callable(lend) else None


def memory_pieces(vectors: TermVectors, text: str) -> IntArray:
    """The distinct token ids of a memory's first ``MAX_TEXT_TERMS`` content words (``words.terms``), sorted."""
    return vectors.pieces(terms(text[: 16 * MAX_TEXT_TERMS])[:MAX_TEXT_TERMS])
