"""Imports on first use: litellm (one place that sets what the import must see), and the faces' exports.

Importing litellm takes seconds, so no module imports it at the top; every user (the litellm upstream routes,
the memory-side model client, the remote embedder, the reranker) calls ``import_litellm``, off the event loop
where it can. The bundled cost map is used so that the import makes no network request, and telemetry is off.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any


def import_litellm() -> Any:
    """The litellm module, configured to make no request of its own."""
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    module = importlib.import_module("litellm")
    setattr(module, "telemetry", False)  # noqa: B010 - a module attribute mypy does not know
    return module


def exports_on_first_use(package: str, where: Mapping[str, str]) -> Callable[[str], Any]:
    """A package's module ``__getattr__`` (PEP 562): each name of ``where`` imported from the module it maps to on
    first use, then kept in the package, so that a cheap import from a face (an id rule, a settings model) does not
    pull in what its heavier neighbours need (LanceDB, Tantivy, onnxruntime, aiohttp)."""

    def load(name: str) -> Any:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)
        return value

    return load
