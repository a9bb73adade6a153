"""Which embedding model to use and how to run it (``[embedder]`` of the config).

``provider = "local"`` (the default) is all-MiniLM-L6-v2 as ONNX shipped with the package (by default its int8
copy, ``models/all-MiniLM-L6-v2-int8``, which writes into the fp32 model's vector space); ``"litellm"`` is any
remote embedding model litellm supports. A local embedder may answer queries with its own *query side*
(``query_model``, a directory under ``models/`` whose manifest says which document space it serves): stored
vectors stay the document model's, so switching the query side needs no reindex; switching the document model
to another space does (``memproxy reindex``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator

DEFAULT_QUERY_MODEL: str | None = None  # the int8 document model answers queries itself


class EmbedderSettings(BaseModel):
    """Which embedding model to use and how to run it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    provider: Literal["local", "litellm"] = "local"
    model: str = "sentence-transformers/all-MiniLM-L6-v2"
    model_path: Path | None = None  # local only; None = the shipped models/all-MiniLM-L6-v2-int8
    batch_size: int = Field(default=64, ge=1)
    threads: int | None = Field(default=1, ge=1)  # onnxruntime threads; 1 measured 2x faster on 2 busy cores
    query_cache_size: int = Field(default=4096, ge=0)  # texts; ~1.6 kB each (vector + key)
    # local only: a query-side model under models/ (or a path) for the documents' space; None = the model itself
    query_model: str | None = DEFAULT_QUERY_MODEL
    api_base: str | None = None
    api_key: SecretStr | None = None
    dim: int | None = Field(default=None, ge=1)  # litellm only; None = learnt from one probe at start
    request_timeout_s: float = Field(default=30.0, gt=0)

    @field_validator("query_model", mode="before")
    @classmethod
    def _none_when_empty(cls, value: object) -> object:
        """``""`` or ``"none"`` (as an environment variable can say it) means no separate query side."""
        return None if isinstance(value, str) and value.strip().lower() in ("", "none") else value
