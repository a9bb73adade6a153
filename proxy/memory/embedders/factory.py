"""The embedder the settings describe."""

from __future__ import annotations

from proxy.memory.embedders.base import BaseEmbedder
from proxy.memory.embedders.local import LocalEmbedder
from proxy.memory.embedders.remote import LiteLLMEmbedder
from proxy.memory.embedders.settings import EmbedderSettings


def build_embedder(settings: EmbedderSettings) -> BaseEmbedder:
    """The embedder ``settings`` describe; a missing local model fails here, not on first use."""
    if settings.provider == "litellm":
        return LiteLLMEmbedder(settings)
    return LocalEmbedder(settings)
