"""The per-user query adapter (seed 001): a small residual MLP that moves a query vector towards the memories
that user's questions turn out to be about.

``adapted(q) = normalize(q + alpha * (relu(q W1 + b1) W2 + b2))``: a ``dim x hidden`` and a ``hidden x dim``
matmul per query. The output layer starts at zero, so an untrained adapter is the identity, and the residual
keeps every adapted query close to the model's own. An adapter belongs to one vector space (``model_id``): a
query embedded by another model passes through unchanged. Weights travel as one ``.npz`` blob
(``to_bytes`` / ``from_bytes``), which the store keeps per user; training is ``adapter_training``.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

Matrix = npt.NDArray[np.float32]
ALPHA = 0.3  # the residual's scale (seed 001)
HIDDEN = 128  # the bottleneck (seed 001)


@dataclass(frozen=True, eq=False)
class QueryAdapter:
    """One user's adapter weights, for queries of the vector space ``model_id``.

    ``held_out``: its MRR on the user's held-out pairs when it was fitted (what a refit must beat);
    ``baseline``: the same pairs' MRR without an adapter; ``pairs``: how many pairs trained it.
    """

    w1: Matrix
    b1: Matrix
    w2: Matrix
    b2: Matrix
    model_id: str
    alpha: float = ALPHA
    held_out: float = 0.0
    baseline: float = 0.0
    pairs: int = 0
    fitted_at: str = ""
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def dim(self) -> int:
        """The dimension of the vectors it adapts."""
        return int(self.w1.shape[0])

    @property
    def nbytes(self) -> int:
        """Memory its weights hold."""
        return sum(int(a.nbytes) for a in (self.w1, self.b1, self.w2, self.b2))

    def apply(self, query: Matrix) -> Matrix:
        """The adapted query (one vector or a batch of rows), unit length; a vector of another size passes
        through unchanged."""
        if query.shape[-1] != self.dim:
            return query
        return residual(query, self.w1, self.b1, self.w2, self.b2, self.alpha)

    def to_bytes(self) -> bytes:
        """The weights and their description as one ``.npz`` blob."""
        meta = {
            "model_id": self.model_id,
            "alpha": self.alpha,
            "held_out": self.held_out,
            "baseline": self.baseline,
            "pairs": self.pairs,
            "fitted_at": self.fitted_at,
            "info": self.info,
        }
        out = io.BytesIO()
        np.savez(out, w1=self.w1, b1=self.b1, w2=self.w2, b2=self.b2, meta=np.array(json.dumps(meta)))
        return out.getvalue()

    @classmethod
    def from_bytes(cls, blob: bytes) -> QueryAdapter:
        """The adapter ``to_bytes`` wrote."""
        with np.load(io.BytesIO(blob), allow_pickle=False) as saved:
            meta = json.loads(str(saved["meta"]))
            arrays = {name: saved[name].astype(np.float32) for name in ("w1", "b1", "w2", "b2")}
        return cls(**arrays, **meta)

    def describe(self) -> dict[str, Any]:
        """What an export or an operator sees of it: everything but the weights."""
        return {
            "model_id": self.model_id,
            "dim": self.dim,
            "hidden": int(self.w1.shape[1]),
            "alpha": self.alpha,
            "held_out_mrr": self.held_out,
            "baseline_mrr": self.baseline,
            "pairs": self.pairs,
            "fitted_at": self.fitted_at,
            **self.info,
        }


def residual(query: Matrix, w1: Matrix, b1: Matrix, w2: Matrix, b2: Matrix, alpha: float) -> Matrix:
    """``normalize(q + alpha * MLP(q))`` over the last axis."""
    hidden = np.maximum(query @ w1 + b1, 0.0)
    moved = query + alpha * (hidden @ w2 + b2)
    norm = np.linalg.norm(moved, axis=-1, keepdims=True)
    out: Matrix = (moved / np.maximum(norm, 1e-12)).astype(np.float32)
    return out
