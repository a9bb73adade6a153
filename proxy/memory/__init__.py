"""The memory core: what the HTTP shell and ``insights`` may use of it, in one face per part.

The shell imports the core only through these faces: this package (the seam, errors, events, features and the
modules every path shares), ``proxy.memory.read``, ``proxy.memory.store``, ``proxy.memory.write`` and
``proxy.memory.embedders`` (``tests/test_import_boundaries.py`` holds it). Each face names what it exports in
``__all__`` and imports it on first use, so that a cheap import (an id rule, a settings model) does not pull
LanceDB, Tantivy or onnxruntime in with it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from proxy.memory.lazy import exports_on_first_use

if TYPE_CHECKING:
    from proxy.memory.errors import MemoryLayerError, StoreError
    from proxy.memory.events import MemoryEvents, NoEvents, memory_dict
    from proxy.memory.features import FEATURES, FeatureBoard, FeatureState, ReportingLLM, guard_handlers
    from proxy.memory.lazy import import_litellm
    from proxy.memory.retention import RetentionSweeper
    from proxy.memory.service import (
        Exchange,
        Injection,
        MemoryAdmin,
        MemoryOperations,
        MemoryService,
        NullMemory,
        ReadRequest,
        RecordPage,
        SearchPreview,
    )
    from proxy.memory.text_cap import cap_text

# What the face exports, and the module that defines it (imported on first use).
_WHERE = {
    "Exchange": "proxy.memory.service",
    "FEATURES": "proxy.memory.features",
    "FeatureBoard": "proxy.memory.features",
    "FeatureState": "proxy.memory.features",
    "Injection": "proxy.memory.service",
    "MemoryAdmin": "proxy.memory.service",
    "MemoryEvents": "proxy.memory.events",
    "MemoryLayerError": "proxy.memory.errors",
    "MemoryOperations": "proxy.memory.service",
    "MemoryService": "proxy.memory.service",
    "NoEvents": "proxy.memory.events",
    "NullMemory": "proxy.memory.service",
    "ReadRequest": "proxy.memory.service",
    "RecordPage": "proxy.memory.service",
    "ReportingLLM": "proxy.memory.features",
    "RetentionSweeper": "proxy.memory.retention",
    "SearchPreview": "proxy.memory.service",
    "StoreError": "proxy.memory.errors",
    "cap_text": "proxy.memory.text_cap",
    "guard_handlers": "proxy.memory.features",
    "import_litellm": "proxy.memory.lazy",
    "memory_dict": "proxy.memory.events",
}
__all__ = [
    "FEATURES",
    "Exchange",
    "FeatureBoard",
    "FeatureState",
    "Injection",
    "MemoryAdmin",
    "MemoryEvents",
    "MemoryLayerError",
    "MemoryOperations",
    "MemoryService",
    "NoEvents",
    "NullMemory",
    "ReadRequest",
    "RecordPage",
    "ReportingLLM",
    "RetentionSweeper",
    "SearchPreview",
    "StoreError",
    "cap_text",
    "exports_on_first_use",
    "guard_handlers",
    "import_litellm",
    "memory_dict",
]

__getattr__ = exports_on_first_use(__name__, _WHERE)
