"""Which embedding model to use and how to run it (``[embedder]`` of the config).

``provider = "local"`` (the default) is a model shipped with the package: by default all-MiniLM-L6-v2 quantised
to int8 (``models/all-MiniLM-L6-v2-int8``) embeds what is stored, and its *query side*, ``models/minilm-static``
(a static model distilled from it: a text's vector is the mean of its tokens' rows, a table lookup, no
transformer pass), embeds questions into the same space. With ``model_path`` the document model is another
directory (``models/all-MiniLM-L6-v2`` for fp32, or ``models/minilm-static`` itself, which answers its own
queries); ``"litellm"`` is any remote embedding model litellm supports. The query side (``query_model``, a
directory under ``models/`` whose manifest says which document space it serves) can change without a reindex;
the document model, for another space, cannot (``memproxy reindex``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator

from proxy.memory.embedders.model_files import MODEL_DIR_NAME

AUTO_QUERY_MODEL = "auto"  # the query side the document model's manifest names (``query_side``), if any
DEFAULT_QUERY_MODEL: str | None = AUTO_QUERY_MODEL


class EmbedderSettings(BaseModel):
    """Which embedding model to use and how to run it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    provider: Literal["local", "litellm"] = "local"
    model: str = "sentence-transformers/all-MiniLM-L6-v2"  # litellm's model, or the ONNX export's (checked)
    model_path: Path | None = None  # local only; None = the shipped models/all-MiniLM-L6-v2-int8
    batch_size: int = Field(default=64, ge=1)
    threads: int | None = Field(default=1, ge=1)  # onnxruntime threads; 1 avoids threads contending for busy cores
    # ONNX models only: model calls run at once (threads sharing the model); None = one per core
    concurrency: int | None = Field(default=None, ge=1)
    query_cache_size: int = Field(default=4096, ge=0)  # texts; ~1.6 kB each (vector + key)
    # local only: a query-side model under models/ (or a path) for the documents' space; "auto" = the one the
    # document model's manifest names (the shipped MiniLM's: minilm-static); None ("none") = the model itself
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
