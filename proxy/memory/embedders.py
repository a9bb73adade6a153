"""Embedders: text to unit-length float32 vectors, behind one small interface.

``Embedder`` is what the store, retrieval and insights use. Implementations: ``LocalEmbedder`` (the
default, all-MiniLM-L6-v2 as ONNX shipped in the repository) and ``LiteLLMEmbedder`` (any remote
embedding model litellm supports). Vectors are always L2-normalised so that a dot product is a cosine.
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
