"""What a write stores beside a record's text: its vector by the store's embedder, and its word pieces."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from proxy.memory.errors import EmbedderError, EmbedderMismatch, StoreError
from proxy.memory.pieces import memory_pieces, term_vectors_of
from proxy.memory.store.records import MemoryRecord
from proxy.memory.store.settings import DocumentEmbedder


class WriteVectors:
    """Vectors and word pieces of the records a write stores, by one embedder."""

    def __init__(self, embedder: DocumentEmbedder) -> None:
        self._embedder = embedder

    async def embedded(self, records: list[MemoryRecord]) -> list[MemoryRecord]:
        """Records with a unit vector of this store's model each (one batched call for the missing)."""
        todo = [i for i, record in enumerate(records) if record.embedding is None]
        vectors = await self.embed([records[i].text for i in todo]) if todo else None
        fresh = dict(zip(todo, vectors if vectors is not None else [], strict=True))
        model, dim = self._embedder.model_id, self._embedder.dim
        out = []
        for i, record in enumerate(records):
            if i not in fresh and record.model_id not in ("", model):
                raise EmbedderMismatch(record.model_id, len(record.embedding or ()), model, dim)
            vector = fresh[i] if i in fresh else np.asarray(record.embedding, dtype=np.float32)
            if vector.shape != (dim,):
                raise StoreError(f"record {record.id} has a vector of shape {vector.shape}")
            same = record.model_id == model and record.embedding is vector
            out.append(record if same else record.replace(embedding=vector, model_id=model))
        return out

    async def embed(self, texts: list[str]) -> npt.NDArray[np.float32]:
        """One unit vector per text, checked for its shape."""
        vectors = np.asarray(await self._embedder.embed_documents(texts), dtype=np.float32)
        if vectors.shape != (len(texts), self._embedder.dim):
            raise EmbedderError(f"embedder returned shape {vectors.shape} for {len(texts)} texts")
        return vectors

    def pieces(self, texts: Sequence[str]) -> list[npt.NDArray[np.int64]] | None:
        """The texts' word pieces by this store's model (``memory.pieces``; None: the model has no term
        vectors). On the event loop, as the read path's term matching: the model's word cache is not shared
        with threads."""
        vectors = term_vectors_of(self._embedder)
        return None if vectors is None else [memory_pieces(vectors, text) for text in texts]
