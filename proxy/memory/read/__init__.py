"""The read path: from a chat request's messages to the memory block injected into it.

Owns the query analysis, the retrieval arms (dense, keyword, entity) and their I/O shell, fusion and its boosts,
the optional rerank, final scoring, the choice of what to inject, the injection itself, the per-user read cache,
and the read path's settings. Data flows one way: query -> arms -> fusion -> (rerank) -> scoring -> injection;
a module imports only from the steps before it (and the shared candidate types), never from one after it.

May import: the store (``proxy.memory.store``), the embedders (``proxy.memory.embedders``) and the modules every
path shares at the root of ``proxy.memory``; never the write path (``proxy.memory.write``), the HTTP shell
(``proxy.*`` outside ``proxy.memory``) or ``insights``.

What the rest of memproxy may use of it is this package's ``__all__`` (imported on first use).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from proxy.memory.lazy import exports_on_first_use

if TYPE_CHECKING:
    from proxy.memory.read.adapter_cache import AdapterCache, adapter_loader
    from proxy.memory.read.block import MemoryItem, month_year
    from proxy.memory.read.candidates import Candidate
    from proxy.memory.read.injection import appended, choose, inject, merge_block
    from proxy.memory.read.placement import (
        BlockPlan,
        CachedBudgets,
        ConversationLedger,
        Placement,
        Planned,
        plan_cached,
        plan_simple,
    )
    from proxy.memory.read.query import content_text, message_text
    from proxy.memory.read.read_cache import NameIndexCache
    from proxy.memory.read.rerank import Reranker, RerankSettings
    from proxy.memory.read.retrieval import RetrievalResult, retrieve
    from proxy.memory.read.retrieval_settings import InjectionSettings, RetrievalSettings
    from proxy.memory.read.tokens import estimate_tokens

# What the face exports, and the module that defines it (imported on first use).
_WHERE = {
    "AdapterCache": "proxy.memory.read.adapter_cache",
    "adapter_loader": "proxy.memory.read.adapter_cache",
    "BlockPlan": "proxy.memory.read.placement",
    "CachedBudgets": "proxy.memory.read.placement",
    "Candidate": "proxy.memory.read.candidates",
    "ConversationLedger": "proxy.memory.read.placement",
    "InjectionSettings": "proxy.memory.read.retrieval_settings",
    "MemoryItem": "proxy.memory.read.block",
    "NameIndexCache": "proxy.memory.read.read_cache",
    "Placement": "proxy.memory.read.placement",
    "Planned": "proxy.memory.read.placement",
    "RerankSettings": "proxy.memory.read.rerank",
    "Reranker": "proxy.memory.read.rerank",
    "RetrievalResult": "proxy.memory.read.retrieval",
    "RetrievalSettings": "proxy.memory.read.retrieval_settings",
    "appended": "proxy.memory.read.injection",
    "choose": "proxy.memory.read.injection",
    "estimate_tokens": "proxy.memory.read.tokens",
    "inject": "proxy.memory.read.injection",
    "merge_block": "proxy.memory.read.injection",
    "content_text": "proxy.memory.read.query",
    "message_text": "proxy.memory.read.query",
    "month_year": "proxy.memory.read.block",
    "plan_cached": "proxy.memory.read.placement",
    "plan_simple": "proxy.memory.read.placement",
    "retrieve": "proxy.memory.read.retrieval",
}
__all__ = [
    "AdapterCache",
    "BlockPlan",
    "CachedBudgets",
    "Candidate",
    "ConversationLedger",
    "InjectionSettings",
    "MemoryItem",
    "NameIndexCache",
    "Placement",
    "Planned",
    "RerankSettings",
    "Reranker",
    "RetrievalResult",
    "RetrievalSettings",
    "adapter_loader",
    "appended",
    "choose",
    "content_text",
    "estimate_tokens",
    "inject",
    "merge_block",
    "message_text",
    "month_year",
    "plan_cached",
    "plan_simple",
    "retrieve",
]

__getattr__ = exports_on_first_use(__name__, _WHERE)
