"""Embedders: text to unit-length float32 vectors, behind one small interface.

Owns the ``Embedder`` protocol and the settings that choose an implementation, the factory, the embedded ONNX
model and its query-side models (static and ONNX), the remote embedders (through litellm), and the lookup of the
shipped model files.

May import: the modules every path shares at the root of ``proxy.memory`` (errors, lazy imports); never the store,
the read or write paths, the HTTP shell (``proxy.*`` outside ``proxy.memory``) or ``insights``.

What the rest of memproxy may use of it is this package's ``__all__`` (imported on first use).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from proxy.memory.lazy import exports_on_first_use

if TYPE_CHECKING:
    from proxy.memory.embedders.base import BaseEmbedder
    from proxy.memory.embedders.factory import build_embedder
    from proxy.memory.embedders.settings import EmbedderSettings

# What the face exports, and the module that defines it (imported on first use).
_WHERE = {
    "BaseEmbedder": "proxy.memory.embedders.base",
    "EmbedderSettings": "proxy.memory.embedders.settings",
    "build_embedder": "proxy.memory.embedders.factory",
}
__all__ = [
    "BaseEmbedder",
    "EmbedderSettings",
    "build_embedder",
]

__getattr__ = exports_on_first_use(__name__, _WHERE)
