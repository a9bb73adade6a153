"""The memory layer's error hierarchy.

``MemoryLayerError`` is the root: the HTTP shell catches it to run a chat without memory (and say so in the
headers) instead of failing the chat. ``StoreError`` covers the store (LanceDB + Tantivy);
``EmbedderMismatch`` means the data directory was built with another embedding model and must be reindexed;
``EmbedderError`` covers embedding backends. Input errors (``InvalidUserId``, ``InvalidCursor``) are also
``ValueError`` so that an API layer can map them to 400 without knowing the store.
Other modules raise their own subclasses of ``MemoryLayerError``.
"""

from __future__ import annotations


class MemoryLayerError(Exception):
    """Anything that went wrong inside the memory layer."""


class StoreError(MemoryLayerError):
    """The memory store could not do what was asked."""


# The shipped models' directories by the vector space they write (the former defaults among them), so that a
# store built by one of them says exactly how to keep it.
SHIPPED_MODEL_DIRS = {
    "local/minilm-static-v1": "models/minilm-static",
    "local/all-MiniLM-L6-v2-onnx-fp32": "models/all-MiniLM-L6-v2-int8",
}


class EmbedderMismatch(StoreError):
    """The store was built with another embedding model or dimension than the one configured."""

    def __init__(self, stored_model: str, stored_dim: int, model: str, dim: int) -> None:
        self.stored_model = stored_model
        self.stored_dim = stored_dim
        self.model = model
        self.dim = dim
        shipped = SHIPPED_MODEL_DIRS.get(stored_model)
        again = f" (MEMPROXY_EMBEDDER__MODEL_PATH={shipped})" if shipped else ""
        super().__init__(
            f"the memory store was built with embedding model {stored_model!r} (dim {stored_dim}) but the "
            f"configured embedder is {model!r} (dim {dim}); vectors from different models cannot be mixed. "
            f"Configure the original model again{again}, or run `memproxy reindex` to re-embed every memory "
            "with the new one."
        )


class EmbedderError(MemoryLayerError):
    """An embedding backend failed or returned vectors of the wrong shape."""


class InvalidUserId(StoreError, ValueError):
    """A user id the store refuses: empty, too long, or containing control characters."""


class InvalidCursor(StoreError, ValueError):
    """A paging cursor that this store did not produce."""
