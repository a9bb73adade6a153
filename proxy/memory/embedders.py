"""Embedders: text to unit-length float32 vectors, behind one small interface.

``Embedder`` is what the store, retrieval and insights use. Implementations: ``LocalEmbedder`` (the
default, all-MiniLM-L6-v2 as ONNX shipped in the repository) and ``LiteLLMEmbedder`` (any remote
embedding model litellm supports). Vectors are always L2-normalised so that a dot product is a cosine.

The default local model is MiniLM quantised to int8 (``models/all-MiniLM-L6-v2-int8``). Its manifest says its
vectors live in the fp32 model's *space* (``space``): an embedder's ``model_id``, which stores record and
check, names that space, so the int8 and fp32 models write into one store without a reindex (LoCoMo R@10
0.726 with int8 documents and queries against 0.727 with fp32 documents; ~2x less CPU per text).
``weights_id`` names the weights themselves. A dynamically quantised model scales its activations per call,
so it embeds each text alone (``per_text``): a text's vector never depends on the texts it was batched with.

A local embedder may answer queries with its own *query side* (``embedder.query_model``, a directory under
``models/`` whose manifest says which document space it serves): a static model distilled into MiniLM's
space (``kind = "static"``, a mean of token vectors, ~0.1 ms on the caller's thread) or a lighter ONNX copy
(``kind = "onnx"``, e.g. int8 for fp32 documents). Stored vectors stay the document model's, so switching the
query side needs no reindex; switching the document model to another space does (``memproxy reindex``).
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import importlib.resources
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
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator

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
    "QueryManifest",
    "StaticQueryModel",
    "Vectors",
    "batches",
    "build_embedder",
    "default_model_dirs",
    "l2_normalise",
    "read_manifest",
    "resolve_model_dir",
    "resolve_query_model_dir",
]

Vectors = npt.NDArray[np.float32]
T = TypeVar("T")
_Manifest = TypeVar("_Manifest", bound=BaseModel)


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


DEFAULT_QUERY_MODEL: str | None = None  # the int8 document model answers queries itself


class EmbedderSettings(BaseModel):
    """Which embedding model to use and how to run it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    provider: Literal["local", "litellm"] = "local"
    model: str = "sentence-transformers/all-MiniLM-L6-v2"
    model_path: Path | None = None  # local only; None = the shipped models/all-MiniLM-L6-v2-int8
    batch_size: int = Field(default=64, ge=1)
    threads: int | None = Field(default=1, ge=1)  # onnxruntime threads; 1 measured 2x faster on 2 busy cores
    query_cache_size: int = Field(default=2048, ge=0)
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


MODEL_DIR_NAME = "all-MiniLM-L6-v2-int8"
# Query-side names that were renamed: the int8 copy was a query side before it became the default model.
QUERY_MODEL_ALIASES = {"all-MiniLM-L6-v2-int8-query": "all-MiniLM-L6-v2-int8"}
MODEL_FILES = ("manifest.json", "model.onnx", "tokenizer.json", "tokenizer_config.json")
EXPORT_HINT = "produce it with scripts/export_minilm.py or set embedder.model_path"


def default_model_dirs(name: str = MODEL_DIR_NAME) -> list[Path]:
    """Where a shipped model (``models/<name>``) is looked for: inside the installed package (``proxy/models``,
    package data of the wheel), beside the package (a checkout or editable install), then the cwd. Every model
    lookup goes through here."""
    packaged = Path(str(importlib.resources.files(proxy).joinpath("models", name)))
    return [
        *([packaged] if packaged.is_dir() else []),
        Path(proxy.__file__).resolve().parents[1] / "models" / name,
        Path.cwd() / "models" / name,
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
    space: str | None = None  # the model whose vector space this one writes into (a quantised copy); None = its own
    per_text: bool = False  # embed each text alone: its vector would depend on its batch (dynamic quantisation)


def read_manifest(model_dir: Path) -> ModelManifest:
    """Parse the manifest, turning a broken one into an ``EmbedderError``."""
    return _parse_manifest(model_dir, ModelManifest, EXPORT_HINT)


def _parse_manifest(model_dir: Path, kind: type[_Manifest], hint: str) -> _Manifest:
    path = model_dir / "manifest.json"
    try:
        return kind.model_validate_json(path.read_bytes())
    except (OSError, ValidationError) as exc:
        raise EmbedderError(f"unreadable model manifest {path}: {exc}; {hint}") from exc


class QueryManifest(BaseModel):
    """``manifest.json`` of a query-side model: its kind and the document space (``model_id``) it serves."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    model_id: str
    kind: Literal["static", "onnx"]
    query_for: str
    dim: int = Field(ge=1)


def resolve_query_model_dir(name: str) -> Path:
    """A query-side model: ``models/<name>`` as every model is looked up, or a directory path."""
    path = Path(name)
    candidates = [path] if len(path.parts) > 1 else default_model_dirs(QUERY_MODEL_ALIASES.get(name, name))
    for candidate in candidates:
        if (candidate / "manifest.json").is_file() and (candidate / "tokenizer.json").is_file():
            return candidate
    tried = ", ".join(str(c) for c in candidates)
    raise EmbedderError(f"no query model {name!r} found (tried {tried}); {QUERY_HINT}")


QUERY_HINT = "build it with scripts/distill_static.py or scripts/quantize_query.py, or set embedder.query_model to none"


def read_query_manifest(model_dir: Path) -> QueryManifest:
    """Parse a query-side model's manifest, turning a broken one into an ``EmbedderError``."""
    return _parse_manifest(model_dir, QueryManifest, QUERY_HINT)


class StaticQueryModel:
    """A static model: a text's vector is the normalised mean of its WordPiece tokens' rows (~0.1 ms, no thread).

    Built by ``scripts/distill_static.py`` so that its vectors land in the document model's space.
    """

    def __init__(self, model_dir: Path, dim: int) -> None:
        from tokenizers import Tokenizer  # fastembed's own dependency; loaded only with a static query side

        try:
            self._table = np.load(model_dir / "vectors.npy")
            self._tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        except Exception as exc:  # numpy raises OSError/ValueError, tokenizers a bare Exception
            raise EmbedderError(f"cannot load the static query model from {model_dir}: {exc}") from exc
        if self._table.ndim != 2 or self._table.shape[1] != dim:
            raise EmbedderError(f"{model_dir}/vectors.npy has shape {self._table.shape}, its manifest says dim {dim}")
        self._tokenizer.no_padding()
        self._tokenizer.enable_truncation(MAX_QUERY_TOKENS)

    def embed(self, texts: Sequence[str]) -> Vectors:
        """One unit row per text (a text without tokens gets a zero row)."""
        out = np.zeros((len(texts), self._table.shape[1]), dtype=np.float32)
        for row, encoding in enumerate(self._tokenizer.encode_batch(list(texts), add_special_tokens=False)):
            if encoding.ids:
                out[row] = self._table[encoding.ids].mean(axis=0, dtype=np.float32)
        return l2_normalise(out)


MAX_QUERY_TOKENS = 256


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

    async def embed_queries(self, texts: Sequence[str]) -> Vectors:
        """Unit rows of ``texts`` embedded as queries (the query side), ``batch_size`` at a time, no cache."""
        await self.start()
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        parts = [await self._embed_counted(b, urgent=True) for b in batches(texts, self._settings.batch_size)]
        return np.concatenate(parts, axis=0)

    @property
    def query_model_id(self) -> str | None:
        """The query side's own model id when queries are not embedded by the document model, else None."""
        return None

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
        self._query_dir = resolve_query_model_dir(settings.query_model) if settings.query_model else None
        if self._query_dir is not None and self._query_dir.resolve() == self.model_dir.resolve():
            self._query_dir = None  # the query side is the document model itself
        self._query_manifest = read_query_manifest(self._query_dir) if self._query_dir else None
        if self._query_manifest is not None and (
            self._query_manifest.query_for != self.model_id or self._query_manifest.dim != self.dim
        ):
            raise EmbedderError(
                f"query model {self._query_dir} serves {self._query_manifest.query_for} "
                f"({self._query_manifest.dim} dims), not {self.model_id} ({self.dim} dims)"
            )
        self._model: Any = None
        self._query_onnx: Any = None  # an ONNX query side (kind "onnx"), run in the worker like the model
        self._static: StaticQueryModel | None = None  # a static query side, run on the caller's thread
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="embedder")
        self._turns = Turns()
        self._closed = False

    @property
    def model_id(self) -> str:
        """The vector space this embedder writes into: what stores record and check."""
        return self._manifest.space or self._manifest.model_id

    @property
    def weights_id(self) -> str:
        """The model weights themselves (an int8 copy has its own, in its original's space)."""
        return self._manifest.model_id

    @property
    def dim(self) -> int:
        return self._manifest.dim

    @property
    def query_model_id(self) -> str | None:
        return self._query_manifest.model_id if self._query_manifest else None

    async def embed_query(self, text: str) -> Vectors:
        """As ``BaseEmbedder.embed_query``; a static query side answers at once, on this thread."""
        if self._static is None:
            return await super().embed_query(text)
        cached = self.query_cache.get(text)
        if cached is not None:
            return cached
        self.texts_embedded += 1
        return self.query_cache.put(text, self._static.embed([text])[0])

    async def _load(self) -> None:
        await self._in_worker(self._load_sync)
        probe = await self._embed_batch(["warm-up"])  # the first run allocates: not on a user's request
        if probe.shape != (1, self.dim):
            raise EmbedderError(f"{self.model_dir} makes vectors of shape {probe.shape[1:]}, its manifest "
                                f"says ({self.dim},)")

    def _load_sync(self) -> None:
        self._model = self._onnx(self.model_dir)
        if self._query_manifest is not None and self._query_dir is not None:
            if self._query_manifest.kind == "static":
                self._static = StaticQueryModel(self._query_dir, self.dim)
            else:
                self._query_onnx = self._onnx(self._query_dir)

    def _onnx(self, model_dir: Path) -> Any:
        fastembed = _import_fastembed()
        try:
            return fastembed.TextEmbedding(
                model_name=self._settings.model,
                specific_model_path=str(model_dir),
                cache_dir=str(model_dir),  # else fastembed creates /tmp/fastembed_cache, unused here
                threads=self._settings.threads,
                # no arena: onnxruntime's keeps its peak (a batch of long texts: +350 MB) for good
                enable_cpu_mem_arena=False,
            )
        except Exception as exc:  # onnxruntime's errors derive from Exception only
            raise EmbedderError(f"cannot load the embedding model from {model_dir}: {exc}") from exc

    async def _embed_batch(self, texts: list[str], *, urgent: bool = False) -> Vectors:
        if urgent and self._static is not None:  # queries, on the static query side
            return self._static.embed(texts)
        if urgent and self._query_onnx is not None:  # queries, on the ONNX query side, one at a time
            return await self._in_worker(self._run_each, self._query_onnx, texts, urgent=True)
        return await self._in_worker(self._embed_sync, texts, urgent=urgent)

    def _embed_sync(self, texts: list[str]) -> Vectors:
        if self._manifest.per_text:
            return self._run_each(self._model, texts)
        return self._run_model(self._model, texts)

    def _run_each(self, model: Any, texts: list[str]) -> Vectors:
        """Each text alone: a dynamically quantised model scales activations per batch, so a query's vector
        would depend on the queries it happened to share a call with."""
        return np.concatenate([self._run_model(model, [text]) for text in texts])

    def _run_model(self, model: Any, texts: list[str]) -> Vectors:
        try:
            rows = list(model.embed(texts, batch_size=len(texts)))
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
            self._model = self._query_onnx = self._static = None
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
