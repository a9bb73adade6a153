"""The embedder the settings describe."""

from __future__ import annotations

from proxy.memory.embedders.base import BaseEmbedder
from proxy.memory.embedders.local import LocalEmbedder
from proxy.memory.embedders.model_files import is_static_model, resolve_model_dir
from proxy.memory.embedders.remote import LiteLLMEmbedder
from proxy.memory.embedders.settings import EmbedderSettings
from proxy.memory.embedders.static import StaticEmbedder


def build_embedder(settings: EmbedderSettings) -> BaseEmbedder:
    """The embedder ``settings`` describe; a missing local model fails here, not on first use."""
    if settings.provider == "litellm":
        return LiteLLMEmbedder(settings)
    model_dir = resolve_model_dir(settings.model_path)
    if is_static_model(model_dir):
        return StaticEmbedder(settings, model_dir)
    return LocalEmbedder(settings)
