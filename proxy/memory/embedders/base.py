"""What every embedder shares: batching, the vector cache, gathering concurrent queries, and the lifecycle.

``BaseEmbedder`` implements the ``Embedder`` protocol over one abstract call (``_embed_batch``: at most
``batch_size`` texts); implementations are the local ONNX model (``local``) and remote models (``remote``).
"""

from __future__ import annotations

import asyncio
import hashlib
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Sequence
from typing import Self

import numpy as np

from proxy.memory.embedders.protocol import Vectors
from proxy.memory.embedders.settings import EmbedderSettings
from proxy.memory.errors import EmbedderError

DOCUMENT_CACHE_TEXTS = 1024  # documents' own vectors kept beside a separate query side (~1.6 MB)


class QueryCache:
    """LRU of a text (by its digest: a 16,000-character turn costs 16 bytes of key) to its read-only vector;
    size 0 disables it.

    Queries fill it, and so do documents when queries and documents are embedded by the same model: the
    writer's user turn is then usually the text the read path just embedded as the query, and the turn before
    an exchange the reply embedded with the previous one.
    """

    def __init__(self, size: int, max_pinned: int = 16_384) -> None:
        self._size = size
        self._items: OrderedDict[bytes, Vectors] = OrderedDict()
        # Vectors a queued job will ask for (a user turn's is its query's): out of the LRU until the job took
        # them, so that a write backlog longer than the LRU's span does not embed them again. At most
        # ``max_pinned`` (26 MB), the oldest pin dropped first: a pin whose job never comes (a forgotten user,
        # a job run by another replica) costs only its place.
        self._pinned: OrderedDict[bytes, tuple[Vectors, int]] = OrderedDict()
        self._max_pinned = max_pinned if size else 0
        self.hits = 0
        self.misses = 0

    def get(self, text: str) -> Vectors | None:
        """The cached vector, refreshed as most recently used, or None."""
        key = _key(text)
        pinned = self._pinned.get(key)
        if pinned is not None:
            self.hits += 1
            return pinned[0]
        vector = self._items.get(key)
        if vector is None:
            self.misses += 1
            return None
        self.hits += 1
        self._items.move_to_end(key)
        return vector

    @property
    def nbytes(self) -> int:
        """Bytes of the vectors held (LRU and pinned), by their arrays' sizes plus their keys."""
        held = [*self._items.values(), *(vector for vector, _ in self._pinned.values())]
        return sum(_nbytes(vector) + _KEY_BYTES for vector in held)

    def clear(self) -> None:
        """Empty the LRU (pinned vectors stay: their jobs still need them)."""
        self._items.clear()

    def pin(self, text: str) -> None:
        """Keep the text's vector (if cached) until as many ``unpin`` calls as pins."""
        key = _key(text)
        if (pinned := self._pinned.get(key)) is not None:
            self._pinned[key] = (pinned[0], pinned[1] + 1)
            return
        if self._max_pinned == 0 or (vector := self._items.pop(key, None)) is None:
            return
        self._pinned[key] = (vector, 1)
        while len(self._pinned) > self._max_pinned:
            self._pinned.popitem(last=False)

    def unpin(self, text: str) -> None:
        """Undo one ``pin``: the last one returns the vector to the LRU as most recently used."""
        key = _key(text)
        pinned = self._pinned.get(key)
        if pinned is None:
            return
        vector, count = pinned
        if count > 1:
            self._pinned[key] = (vector, count - 1)
            return
        del self._pinned[key]
        self._put_key(key, vector)

    def put(self, text: str, vector: Vectors) -> Vectors:
        """Store a read-only copy, evicting the least recently used beyond the size; returns it."""
        frozen = np.array(vector, dtype=np.float32)
        frozen.setflags(write=False)
        if self._size == 0:
            return frozen
        key = _key(text)
        if (pinned := self._pinned.get(key)) is not None:
            self._pinned[key] = (frozen, pinned[1])
        else:
            self._put_key(key, frozen)
        return frozen

    def _put_key(self, key: bytes, vector: Vectors) -> None:
        self._items[key] = vector
        self._items.move_to_end(key)
        while len(self._items) > self._size:
            self._items.popitem(last=False)

    def __len__(self) -> int:
        return len(self._items) + len(self._pinned)

    @property
    def pinned(self) -> int:
        """Vectors held for queued jobs."""
        return len(self._pinned)


def _key(text: str) -> bytes:
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def batches(texts: Sequence[str], size: int) -> list[list[str]]:
    """``texts`` cut into consecutive lists of at most ``size``."""
    return [list(texts[i : i + size]) for i in range(0, len(texts), size)]


class BaseEmbedder(ABC):
    """Batching, the query cache and the start/close lifecycle shared by every embedder.

    Use as ``async with build_embedder(settings) as embedder``; without ``start()`` the model is loaded
    on first use.
    """

    def __init__(self, settings: EmbedderSettings) -> None:
        self._settings = settings
        self.query_cache = QueryCache(settings.query_cache_size)
        # Documents' own vectors when a separate query side embeds queries: an exchange's "turn before" is most
        # often the previous exchange's reply, embedded a moment ago (one model call of three saved).
        self._document_vectors = QueryCache(min(settings.query_cache_size, DOCUMENT_CACHE_TEXTS))
        self.texts_embedded = 0  # texts that reached the model, cache hits excluded
        self.quick_texts = 0  # documents embedded by the cheap query side instead (``quick_documents``)
        # Documents the model ran, whether or not their caller still waited (a turn whose caller gave up at its
        # deadline, ``quick_vectors_after_s``, is counted here and in ``quick_texts``), and the model threads' CPU
        # seconds on them: what the document model costs the write side.
        self.model_texts = 0
        self.model_cpu_s = 0.0
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

        Texts are batched in order of length, so that a batch pads little, and returned in input order. When
        queries and documents share the model, texts in the vector cache are not embedded again, and the new
        ones are cached.
        """
        await self.start()
        vectors = np.empty((len(texts), self.dim), dtype=np.float32)
        cache = self.document_cache
        todo = []
        for i, text in enumerate(texts):
            cached = cache.get(text) if cache is not None else None
            if cached is None:
                todo.append(i)
            else:
                vectors[i] = cached
        if not todo:
            return vectors
        order = sorted(todo, key=lambda i: len(texts[i]))
        by_length = [texts[i] for i in order]
        parts = [await self._embed_counted(b) for b in batches(by_length, self._settings.batch_size)]
        vectors[order] = np.concatenate(parts, axis=0)
        if cache is not None:
            for i in order:
                cache.put(texts[i], vectors[i])
        return vectors

    async def embed_query(self, text: str) -> Vectors:
        """One unit vector, shape ``(dim,)``, from the cache when the same text was asked before.

        Concurrent queries share model calls (where ``_gathers_queries``): while one batch of queries runs, the
        next ones gather and go together (a batch of 8 short queries costs about twice one), and queries go
        before document batches.
        """
        cached = self.query_cache.get(text)
        if cached is not None:
            return cached
        await self.start()
        if not self._gathers_queries:
            return self.query_cache.put(text, (await self._embed_counted([text], urgent=True))[0])
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
    def _gathers_queries(self) -> bool:
        """Whether concurrent queries wait to share one model call (else each goes as it comes)."""
        return True

    @property
    def document_cache(self) -> QueryCache | None:
        """The vector cache of documents: the query cache when documents and queries share the model (a text's
        vector is then the same on both sides), else a small one of documents only."""
        return self.query_cache if self.query_model_id is None else self._document_vectors

    def background_priority(self, nice: int) -> None:
        """Run the model's own threads at this nice value from now on (the memory writer: its document model
        shares the cores with the chat processes instead of going before them); nothing without such threads."""
        return

    @property
    def embeds_quickly(self) -> bool:
        """Whether ``quick_documents`` has a cheaper model to embed with."""
        return False

    def documents_due_s(self, count: int) -> float:
        """An estimate of how long ``count`` more documents would take to embed, behind what already waits."""
        return 0.0

    def quick_documents(self, texts: Sequence[str]) -> Vectors | None:
        """The texts' vectors by a cheaper model of the same space (a static query side), on the caller's thread,
        for a writer that fell behind; None when there is none."""
        return None

    @property
    def cached_vector_bytes(self) -> int:
        """Bytes of the vectors the embedder's caches hold (queries', and documents' when they are apart)."""
        apart = self.document_cache is not self.query_cache
        return self.query_cache.nbytes + (self._document_vectors.nbytes if apart else 0)

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


_KEY_BYTES = 16 + 100  # a blake2b digest and the dict's slot and objects around it


def _nbytes(vectors: Vectors) -> int:
    return int(vectors.nbytes)
