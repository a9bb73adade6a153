"""A deterministic embedder for unit tests of pure code: hashed bag of words, no model."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence

import numpy as np

from proxy.memory.embedders.protocol import Vectors

_TOKEN = re.compile(r"\w+", re.UNICODE)


class HashingEmbedder:
    """Texts sharing words get similar vectors; the same text always gets the same vector."""

    def __init__(self, dim: int = 64, model_id: str = "test/hashing-64") -> None:
        self._dim = dim
        self._model_id = model_id
        self.calls = 0

    @property
    def model_id(self) -> str:
        return self._model_id

    @property
    def dim(self) -> int:
        return self._dim

    def _one(self, text: str) -> np.ndarray:
        vec = np.zeros(self._dim, dtype=np.float32)
        for token in _TOKEN.findall(text.lower()):
            digest = hashlib.blake2b(token.encode(), digest_size=8).digest()
            slot = int.from_bytes(digest[:4], "little") % self._dim
            sign = 1.0 if digest[4] & 1 else -1.0
            vec[slot] += sign
        norm = float(np.linalg.norm(vec))
        if norm == 0.0:
            vec[0] = 1.0
            return vec
        return vec / norm

    async def embed_documents(self, texts: Sequence[str]) -> Vectors:
        self.calls += 1
        if not texts:
            return np.zeros((0, self._dim), dtype=np.float32)
        return np.stack([self._one(t) for t in texts]).astype(np.float32)

    async def embed_query(self, text: str) -> Vectors:
        self.calls += 1
        return self._one(text)
