"""Which embedding model to use and how to run it (``[embedder]`` of the config).

``provider = "local"`` (the default) is a model shipped with the package: by default ``models/minilm-static``, a
static model distilled from all-MiniLM-L6-v2 (a text's vector is the mean of its tokens' rows: a table lookup a
text, no transformer pass, at LoCoMo retrieval equal to MiniLM's), or, with ``model_path``, MiniLM itself as ONNX
(``models/all-MiniLM-L6-v2-int8`` or ``models/all-MiniLM-L6-v2``); ``"litellm"`` is any remote embedding model
litellm supports. An ONNX model may answer queries with its own *query side* (``query_model``, a directory
under ``models/`` whose manifest says which document space it serves): stored vectors stay the document
model's, so switching the query side needs no reindex; switching the document model to another space does
(``memproxy reindex``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator

from proxy.memory.embedders.model_files import MODEL_DIR_NAME

DEFAULT_QUERY_MODEL: str | None = None  # the document model answers queries itself


class EmbedderSettings(BaseModel):
    """Which embedding model to use and how to run it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    provider: Literal["local", "litellm"] = "local"
    model: str = "sentence-transformers/all-MiniLM-L6-v2"  # litellm's model, or the ONNX export's (checked)
    model_path: Path | None = None  # local only; None = the shipped static model, models/minilm-static
    batch_size: int = Field(default=64, ge=1)
    threads: int | None = Field(default=1, ge=1)  # onnxruntime threads; 1 avoids threads contending for busy cores
    query_cache_size: int = Field(default=4096, ge=0)  # texts; ~1.6 kB each (vector + key)
    # local only: a query-side model under models/ (or a path) for the documents' space; None = the model itself
    query_model: str | None = DEFAULT_QUERY_MODEL
    api_base: str | None = None
    api_key: SecretStr | None = None
    dim: int | None = Field(default=None, ge=1)  # litellm only; None = learnt from one probe at start
    request_timeout_s: float = Field(default=30.0, gt=0)

    @property
    def label(self) -> str:
        """The configured model as logs and reports name it."""
        if self.provider == "litellm":
            return self.model
        return str(self.model_path) if self.model_path is not None else f"models/{MODEL_DIR_NAME}"

    @field_validator("query_model", mode="before")
    @classmethod
    def _none_when_empty(cls, value: object) -> object:
        """``""`` or ``"none"`` (as an environment variable can say it) means no separate query side."""
        return None if isinstance(value, str) and value.strip().lower() in ("", "none") else value
