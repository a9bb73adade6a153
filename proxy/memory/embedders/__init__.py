"""Embedders: text to unit-length float32 vectors, behind one small interface.

Owns the ``Embedder`` protocol and the settings that choose an implementation, the factory, the embedded ONNX
model and its query-side models (static and ONNX), the remote embedders (through litellm), and the lookup of the
shipped model files.

May import: the modules every path shares at the root of ``proxy.memory`` (errors, lazy imports); never the store,
the read or write paths, the HTTP shell (``proxy.*`` outside ``proxy.memory``) or ``insights``.
"""
