"""litellm, imported on first use: one place that sets what the import must see.

Importing litellm takes seconds, so no module imports it at the top; every user (the litellm upstream routes,
the memory-side model client, the remote embedder, the reranker) calls ``import_litellm``, off the event loop
where it can. The bundled cost map is used so that the import makes no network request, and telemetry is off.
"""

from __future__ import annotations

import importlib
import os
from typing import Any


def import_litellm() -> Any:
    """The litellm module, configured to make no request of its own."""
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    module = importlib.import_module("litellm")
    setattr(module, "telemetry", False)  # noqa: B010 - a module attribute mypy does not know
    return module
