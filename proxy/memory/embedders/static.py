"""A static query model: a text's vector is the normalised mean of its tokens' rows (~0.1 ms, no thread)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from proxy.memory.embedders.protocol import Vectors, l2_normalise
from proxy.memory.errors import EmbedderError

MAX_QUERY_TOKENS = 256


class StaticQueryModel:
    """A static model: a text's vector is the normalised mean of its WordPiece tokens' rows (~0.1 ms, no thread).

    Built by ``scripts/distill_static.py`` so that its vectors land in the document model's space.
    """

    def __init__(self, model_dir: Path, dim: int) -> None:
        from tokenizers import Tokenizer  # fastembed's own dependency; loaded only with a static query side

        try:
            self._table = np.load(model_dir / "vectors.npy")
            self._tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        except Exception as exc:  # numpy raises OSError/ValueError, tokenizers a bare Exception
            raise EmbedderError(f"cannot load the static query model from {model_dir}: {exc}") from exc
        if self._table.ndim != 2 or self._table.shape[1] != dim:
            raise EmbedderError(f"{model_dir}/vectors.npy has shape {self._table.shape}, its manifest says dim {dim}")
        self._tokenizer.no_padding()
        self._tokenizer.enable_truncation(MAX_QUERY_TOKENS)

    def embed(self, texts: Sequence[str]) -> Vectors:
        """One unit row per text (a text without tokens gets a zero row)."""
        out = np.zeros((len(texts), self._table.shape[1]), dtype=np.float32)
        for row, encoding in enumerate(self._tokenizer.encode_batch(list(texts), add_special_tokens=False)):
            if encoding.ids:
                out[row] = self._table[encoding.ids].mean(axis=0, dtype=np.float32)
        return l2_normalise(out)
