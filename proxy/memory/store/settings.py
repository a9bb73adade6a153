"""What the store is given: its settings (where it keeps its data, how it batches, compacts and caches) and an
embedder for documents."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import numpy as np
import numpy.typing as npt
from pydantic import BaseModel, ConfigDict, Field


class StoreTuning(BaseModel):
    """``[store]``: how the store batches, compacts and caches (its data directory is ``storage.path``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    flush_max_rows: int = Field(256, ge=1)
    flush_interval_ms: int = Field(20, ge=0)
    optimize_interval_s: float = Field(300.0, gt=0)
    # ...or sooner, after this many appends: each makes a fragment that no index covers until a round, and every
    # read of LanceDB walks each such fragment (at a thousand fragments an append took several times as long).
    # 50 rather than 200 (``bench/writes.py --mode sustained``, 5 minutes each): reads grew slower until each round
    # and fast again after it; the management API's listing p90 1.66 -> 0.98 s, LanceDB's CPU per exchange halved,
    # for 4x the rounds of a quarter the rows each
    optimize_after_commits: int = Field(50, ge=1)
    # Seconds between writes of access times to LanceDB (reads see them at once; a write rewrites the touched
    # rows and marks deletions in their fragments: once a second under load, it held the write lock most of
    # every second).
    touch_flush_s: float = Field(60.0, gt=0)
    # A memory's access time reaches LanceDB at most once per this many seconds (reads see every access at once;
    # recency counts in hours and days, and rewriting the same rows every minute held writes up for seconds). A
    # kill -9 loses at most about this much access-time history (plus touch_flush_s), never a memory.
    touch_granularity_s: float = Field(3600.0, ge=0)
    ann_index_min_rows: int = Field(50_000, ge=1)
    vector_cache_bytes: int = Field(512 * 2**20, ge=0)  # a 100k-memory user fits (~230 MB)
    # Once no read has come for 5 s, a user whose cached vectors no read has used for this many seconds is
    # dropped (their next read loads them again); 0 keeps every user until the byte budget evicts them.
    vector_cache_idle_s: float = Field(20.0, ge=0)
    # Bytes of local disk (the data directory's ``vector-spill``, per process) for users the vector cache evicts
    # for room or releases idle: their next read maps the file back (~1-2 ms) instead of loading them from LanceDB
    # (~11 ms of CPU for 1,000 memories). 0 turns it off.
    vector_spill_bytes: int = Field(2**30, ge=0)
    # LanceDB's own caches (opened indexes, file metadata and manifests). Its default (6 GB + 1 GB) kept the
    # metadata of every version a busy write side made: 275 MB after 3,000 commits, growing without end.
    lance_cache_bytes: int = Field(64 * 2**20, ge=1 * 2**20)


class StoreSettings(StoreTuning):
    """Where the store keeps its data, and how it batches, compacts and caches."""

    path: Path


class DocumentEmbedder(Protocol):
    """What the store needs of an embedder (any ``proxy.memory.embedders`` embedder is one): documents in."""

    @property
    def model_id(self) -> str: ...

    @property
    def dim(self) -> int: ...

    async def embed_documents(self, texts: Sequence[str]) -> npt.NDArray[np.float32]:
        """One unit vector per text, shape ``(len(texts), dim)``."""
        ...
