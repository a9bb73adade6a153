"""Embedders: text to unit-length float32 vectors, behind one small interface.

``Embedder`` is what the store, retrieval and insights use. Implementations: ``LocalEmbedder`` (the
default, all-MiniLM-L6-v2 as ONNX shipped in the repository) and ``LiteLLMEmbedder`` (any remote
embedding model litellm supports). Vectors are always L2-normalised so that a dot product is a cosine.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import os
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal, Protocol, Self, TypeVar, runtime_checkable

import numpy as np
import numpy.typing as npt
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError

import proxy
from proxy.lazy import import_litellm
from proxy.memory.errors import EmbedderError

__all__ = [
    "BaseEmbedder",
    "Embedder",
    "EmbedderError",
    "EmbedderSettings",
    "LiteLLMEmbedder",
    "LocalEmbedder",
    "ModelManifest",
    "QueryCache",
    "Vectors",
    "batches",
    "build_embedder",
    "default_model_dirs",
    "l2_normalise",
    "read_manifest",
    "resolve_model_dir",
]

Vectors = npt.NDArray[np.float32]
T = TypeVar("T")


@runtime_checkable
class Embedder(Protocol):
    """Turns text into unit vectors. ``model_id`` names the vector space; spaces never mix."""

    @property
    def model_id(self) -> str: ...

    @property
    def dim(self) -> int: ...

    async def embed_documents(self, texts: Sequence[str]) -> Vectors:
        """One row per text, shape ``(len(texts), dim)``."""
        ...

    async def embed_query(self, text: str) -> Vectors:
        """One vector, shape ``(dim,)``."""
        ...


class EmbedderSettings(BaseModel):
    """Which embedding model to use and how to run it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    provider: Literal["local", "litellm"] = "local"
    model: str = "sentence-transformers/all-MiniLM-L6-v2"
    model_path: Path | None = None  # local only; None = the repository's models/all-MiniLM-L6-v2
    batch_size: int = Field(default=64, ge=1)
    threads: int | None = Field(default=1, ge=1)  # onnxruntime threads; 1 measured 2x faster on 2 busy cores
    query_cache_size: int = Field(default=2048, ge=0)
    api_base: str | None = None
    api_key: SecretStr | None = None
    dim: int | None = Field(default=None, ge=1)  # litellm only; None = learnt from one probe at start
    request_timeout_s: float = Field(default=30.0, gt=0)


MODEL_DIR_NAME = "all-MiniLM-L6-v2"
MODEL_FILES = ("manifest.json", "model.onnx", "tokenizer.json", "tokenizer_config.json")
EXPORT_HINT = "produce it with scripts/export_minilm.py or set embedder.model_path"


def default_model_dirs() -> list[Path]:
    """Where the shipped model is looked for: beside the package (editable install), then the cwd."""
    return [
        Path(proxy.__file__).resolve().parents[1] / "models" / MODEL_DIR_NAME,
        Path.cwd() / "models" / MODEL_DIR_NAME,
    ]


def resolve_model_dir(model_path: Path | None) -> Path:
    """The model directory to load, checked to hold every file the local embedder needs."""
    candidates = [model_path] if model_path is not None else default_model_dirs()
    for candidate in candidates:
        if all((candidate / name).is_file() for name in MODEL_FILES):
            return candidate
    tried = ", ".join(str(c) for c in candidates)
    raise EmbedderError(
        f"no embedding model found (tried {tried}); a model directory needs {', '.join(MODEL_FILES)}: "
        f"{EXPORT_HINT}"
    )


class ModelManifest(BaseModel):
    """``manifest.json`` of an exported model directory: what the vectors are and how big."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    model_id: str
    fastembed_model: str
    variant: str
    dim: int = Field(ge=1)


def read_manifest(model_dir: Path) -> ModelManifest:
    """Parse the manifest, turning a broken one into an ``EmbedderError``."""
    path = model_dir / "manifest.json"
    try:
        return ModelManifest.model_validate_json(path.read_bytes())
    except (OSError, ValidationError) as exc:
        raise EmbedderError(f"unreadable model manifest {path}: {exc}; {EXPORT_HINT}") from exc


def l2_normalise(matrix: npt.ArrayLike) -> Vectors:
    """Rows scaled to unit length as float32; an all-zero row stays zero rather than becoming NaN."""
    rows = np.asarray(matrix, dtype=np.float64)
    norms = np.linalg.norm(rows, axis=-1, keepdims=True)
    return (rows / np.where(norms == 0.0, 1.0, norms)).astype(np.float32)


class QueryCache:
    """LRU of query text to its (read-only) vector; size 0 disables it."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._items: OrderedDict[str, Vectors] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def get(self, text: str) -> Vectors | None:
        """The cached vector, refreshed as most recently used, or None."""
        vector = self._items.get(text)
        if vector is None:
            self.misses += 1
            return None
        self.hits += 1
        self._items.move_to_end(text)
        return vector

    def put(self, text: str, vector: Vectors) -> Vectors:
        """Store a read-only copy, evicting the least recently used beyond the size; returns it."""
        frozen = np.array(vector, dtype=np.float32)
        frozen.setflags(write=False)
        if self._size == 0:
            return frozen
        self._items[text] = frozen
        self._items.move_to_end(text)
        while len(self._items) > self._size:
            self._items.popitem(last=False)
        return frozen

    def __len__(self) -> int:
        return len(self._items)


def batches(texts: Sequence[str], size: int) -> list[list[str]]:
    """``texts`` cut into consecutive lists of at most ``size``."""
    return [list(texts[i : i + size]) for i in range(0, len(texts), size)]


class Turns:
    """One model call at a time, in order, except that waiting urgent calls (queries) go before the others.

    A chat request's query must not wait behind a queue of document batches from the write path; but after
    ``urgent_run`` urgent turns in a row, a waiting document batch goes next, so that a steady stream of
    queries never starves the write path (turns would stop becoming searchable).
    """

    def __init__(self, urgent_run: int = 4) -> None:
        self._busy = False
        self._waiting: list[tuple[int, int, asyncio.Future[None]]] = []
        self._order = itertools.count()
        self._urgent_run = urgent_run
        self._urgent_streak = 0

    @contextlib.asynccontextmanager
    async def turn(self, *, urgent: bool) -> AsyncIterator[None]:
        """Hold the one turn for the body of the ``async with``."""
        if self._busy:
            handed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            heapq.heappush(self._waiting, (0 if urgent else 1, next(self._order), handed))
            try:
                await handed
            except asyncio.CancelledError:
                if handed.done() and not handed.cancelled():  # the turn was ours: pass it on
                    self._release()
                raise
        else:
            self._busy = True
        try:
            yield
        finally:
            self._release()

    def _release(self) -> None:
        while self._waiting:
            rank, _, handed = self._next_waiting()
            if not handed.done():
                self._urgent_streak = self._urgent_streak + 1 if rank == 0 else 0
                handed.set_result(None)  # the turn passes straight on; still busy
                return
        self._busy = False

    def _next_waiting(self) -> tuple[int, int, asyncio.Future[None]]:
        """The most urgent waiter, or the oldest other one once urgent turns had ``urgent_run`` in a row."""
        if self._urgent_streak >= self._urgent_run:
            others = [entry for entry in self._waiting if entry[0] != 0]
            if others:
                oldest = min(others)
                self._waiting.remove(oldest)
                heapq.heapify(self._waiting)
                return oldest
        return heapq.heappop(self._waiting)


class BaseEmbedder(ABC):
    """Batching, the query cache and the start/close lifecycle shared by every embedder.

    Use as ``async with build_embedder(settings) as embedder``; without ``start()`` the model is loaded
    on first use.
    """

    def __init__(self, settings: EmbedderSettings) -> None:
        self._settings = settings
        self.query_cache = QueryCache(settings.query_cache_size)
        self.texts_embedded = 0  # texts that reached the model, cache hits excluded
        self._started = False
        self._start_lock = asyncio.Lock()
        self._queries: list[tuple[str, asyncio.Future[Vectors]]] = []
        self._query_batches: asyncio.Task[None] | None = None  # owned: stopped by ``__aexit__``

    @property
    @abstractmethod
    def model_id(self) -> str: ...

    @property
    @abstractmethod
    def dim(self) -> int: ...

    @abstractmethod
    async def _load(self) -> None:
        """Make the model ready to embed."""

    @abstractmethod
    async def _embed_batch(self, texts: list[str], *, urgent: bool = False) -> Vectors:
        """Unit vectors for at most ``batch_size`` texts (``urgent``: queries, waiting on a chat request)."""

    async def start(self) -> None:
        """Load the model now rather than on first use; idempotent."""
        async with self._start_lock:
            if not self._started:
                await self._load()
                self._started = True

    @abstractmethod
    async def aclose(self) -> None:
        """Release what the embedder holds."""

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self._query_batches is not None:
            self._query_batches.cancel()
            await asyncio.gather(self._query_batches, return_exceptions=True)
        await self.aclose()

    async def embed_documents(self, texts: Sequence[str]) -> Vectors:
        """One unit row per text, shape ``(len(texts), dim)``, embedded ``batch_size`` at a time.

        Texts are batched in order of length, so that a batch pads little, and returned in input order.
        """
        await self.start()
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        by_length = [texts[i] for i in order]
        parts = [await self._embed_counted(b) for b in batches(by_length, self._settings.batch_size)]
        vectors = np.empty((len(texts), self.dim), dtype=np.float32)
        vectors[order] = np.concatenate(parts, axis=0)
        return vectors

    async def embed_query(self, text: str) -> Vectors:
        """One unit vector, shape ``(dim,)``, from the cache when the same text was asked before.

        Concurrent queries share model calls: while one batch of queries runs, the next ones gather and go
        together (a batch of 8 short queries costs about twice one), and queries go before document batches.
        """
        cached = self.query_cache.get(text)
        if cached is not None:
            return cached
        await self.start()
        future: asyncio.Future[Vectors] = asyncio.get_running_loop().create_future()
        self._queries.append((text, future))
        if self._query_batches is None or self._query_batches.done():
            self._query_batches = asyncio.create_task(self._run_queries())
        return self.query_cache.put(text, await future)

    async def _run_queries(self) -> None:
        """Embed the waiting queries, ``batch_size`` at a time, until none wait (callers gone are skipped)."""
        try:
            await self._drain_queries()
        finally:  # stopped (the embedder closes): nobody is left waiting forever
            for _, future in self._queries:
                if not future.done():
                    future.set_exception(EmbedderError("the embedder is closed"))
            self._queries = []

    async def _drain_queries(self) -> None:
        while self._queries:
            waiting = [(text, future) for text, future in self._queries if not future.done()]
            batch, self._queries = waiting[: self._settings.batch_size], waiting[self._settings.batch_size :]
            if not batch:
                continue
            try:
                vectors = await self._embed_counted([text for text, _ in batch], urgent=True)
            except Exception as error:  # each caller gets the error (a cancelled caller is skipped)
                for _, future in batch:
                    if not future.done():
                        future.set_exception(error)
                continue
            for (_, future), vector in zip(batch, vectors, strict=True):
                if not future.done():
                    future.set_result(vector)

    async def _embed_counted(self, texts: list[str], *, urgent: bool = False) -> Vectors:
        vectors = await self._embed_batch(texts, urgent=urgent)
        self.texts_embedded += len(texts)
        if vectors.shape != (len(texts), self.dim):
            expected = (len(texts), self.dim)
            raise EmbedderError(f"{self.model_id} returned vectors of shape {vectors.shape}, not {expected}")
        return vectors


def _import_fastembed() -> Any:
    """fastembed, imported only once offline mode is set so that it never tries the model hub.

    Imported here rather than at the top: the variable must be set first, and the import (onnxruntime,
    huggingface_hub) is too heavy for every user of the ``Embedder`` protocol to pay.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import fastembed

    return fastembed


class LocalEmbedder(BaseEmbedder):
    """all-MiniLM-L6-v2 (or another fastembed model) as ONNX from a local directory, run off the loop.

    One worker thread owns onnxruntime, and a lock lets one batch at a time reach it, so concurrent
    callers queue in asyncio (cancellable) instead of piling work onto the thread.
    """

    def __init__(self, settings: EmbedderSettings) -> None:
        super().__init__(settings)
        self.model_dir = resolve_model_dir(settings.model_path)
        self._manifest = read_manifest(self.model_dir)
        if self._manifest.fastembed_model != settings.model:
            raise EmbedderError(
                f"{self.model_dir} holds {self._manifest.fastembed_model}, but the embedder is configured "
                f"for {settings.model}"
            )
        self._model: Any = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="embedder")
        self._turns = Turns()
        self._closed = False

    @property
    def model_id(self) -> str:
        return self._manifest.model_id

    @property
    def dim(self) -> int:
        return self._manifest.dim

    async def _load(self) -> None:
        await self._in_worker(self._load_sync)
        probe = await self._embed_batch(["warm-up"])  # the first run allocates: not on a user's request
        if probe.shape != (1, self.dim):
            raise EmbedderError(f"{self.model_dir} makes vectors of shape {probe.shape[1:]}, its manifest "
                                f"says ({self.dim},)")

    def _load_sync(self) -> None:
        fastembed = _import_fastembed()
        try:
            self._model = fastembed.TextEmbedding(
                model_name=self._settings.model,
                specific_model_path=str(self.model_dir),
                cache_dir=str(self.model_dir),  # else fastembed creates /tmp/fastembed_cache, unused here
                threads=self._settings.threads,
            )
        except Exception as exc:  # onnxruntime's errors derive from Exception only
            raise EmbedderError(f"cannot load the embedding model from {self.model_dir}: {exc}") from exc

    async def _embed_batch(self, texts: list[str], *, urgent: bool = False) -> Vectors:
        return await self._in_worker(self._embed_sync, texts, urgent=urgent)

    def _embed_sync(self, texts: list[str]) -> Vectors:
        try:
            rows = list(self._model.embed(texts, batch_size=len(texts)))
        except Exception as exc:  # onnxruntime's errors derive from Exception only
            raise EmbedderError(f"{self.model_id} failed to embed {len(texts)} texts: {exc}") from exc
        return l2_normalise(np.stack(rows))

    async def _in_worker(self, func: Callable[..., T], *args: Any, urgent: bool = False) -> T:
        async with self._turns.turn(urgent=urgent):
            if self._closed:
                raise EmbedderError("the embedder is closed")
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._executor, func, *args)

    async def aclose(self) -> None:
        """Wait for the batch in flight, then stop the worker thread."""
        async with self._turns.turn(urgent=True):
            self._closed = True
            self._model = None
        self._executor.shutdown(wait=False)


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


def build_embedder(settings: EmbedderSettings) -> BaseEmbedder:
    """The embedder ``settings`` describe; a missing local model fails here, not on first use."""
    if settings.provider == "litellm":
        return LiteLLMEmbedder(settings)
    return LocalEmbedder(settings)
