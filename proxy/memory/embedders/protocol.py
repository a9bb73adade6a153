"""The ``Embedder`` interface: text to unit-length float32 vectors, one vector space per ``model_id``.

``Embedder`` is what the store, the read path, the write path and insights use; ``Vectors`` is the array type of
its answers. Vectors are always L2-normalised (``l2_normalise``) so that a dot product is a cosine.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

Vectors = npt.NDArray[np.float32]


@runtime_checkable
class Embedder(Protocol):
    """Turns text into unit vectors. ``model_id`` names the vector space; spaces never mix."""

    @property
    def model_id(self) -> str: ...

    @property
    def dim(self) -> int: ...

    async def embed_documents(self, texts: Sequence[str]) -> Vectors:
        """One row per text, shape ``(len(texts), dim)``."""
        ...

    async def embed_query(self, text: str) -> Vectors:
        """One vector, shape ``(dim,)``."""
        ...


def l2_normalise(matrix: npt.ArrayLike) -> Vectors:
    """Rows scaled to unit length as float32; an all-zero row stays zero rather than becoming NaN."""
    rows = np.asarray(matrix, dtype=np.float64)
    norms = np.linalg.norm(rows, axis=-1, keepdims=True)
    return (rows / np.where(norms == 0.0, 1.0, norms)).astype(np.float32)
