"""Remote embedders: any embedding model litellm supports (``openai/text-embedding-3-small``, ``ollama/...``)."""

from __future__ import annotations

from typing import Any

from proxy.memory.embedders.base import BaseEmbedder
from proxy.memory.embedders.protocol import Vectors, l2_normalise
from proxy.memory.embedders.settings import EmbedderSettings
from proxy.memory.errors import EmbedderError
from proxy.memory.lazy import import_litellm


class LiteLLMEmbedder(BaseEmbedder):
    """Any remote embedding model litellm supports (``openai/text-embedding-3-small``, ``ollama/...``)."""

    def __init__(self, settings: EmbedderSettings) -> None:
        super().__init__(settings)
        self._dim = settings.dim

    @property
    def model_id(self) -> str:
        return f"litellm/{self._settings.model}"

    @property
    def dim(self) -> int:
        if self._dim is None:
            raise EmbedderError(f"{self.model_id}: dimension unknown before start(); set embedder.dim")
        return self._dim

    async def aclose(self) -> None:
        """Nothing to release: litellm owns its HTTP clients."""

    async def _load(self) -> None:
        if self._dim is None:
            self._dim = int((await self._embed_batch(["dimension probe"])).shape[1])

    async def _embed_batch(self, texts: list[str], *, urgent: bool = False) -> Vectors:
        litellm = import_litellm()
        import openai  # litellm's own dependency; its exceptions all derive from openai.OpenAIError

        key = self._settings.api_key
        try:
            response = await litellm.aembedding(
                model=self._settings.model,
                input=texts,
                api_base=self._settings.api_base,
                api_key=key.get_secret_value() if key is not None else None,
                timeout=self._settings.request_timeout_s,
            )
        except openai.OpenAIError as exc:
            raise EmbedderError(f"{self.model_id} failed to embed {len(texts)} texts: {exc}") from exc
        return l2_normalise(_response_rows(response, len(texts)))


def _response_rows(response: Any, expected: int) -> list[list[float]]:
    """The embeddings of an OpenAI-style response in input order."""
    items = sorted(response.data, key=lambda item: item["index"])
    if len(items) != expected:
        raise EmbedderError(f"the embedding service returned {len(items)} vectors for {expected} texts")
    return [item["embedding"] for item in items]
