"""all-MiniLM-L6-v2 (or another fastembed model) as ONNX from a local directory (``model_path``).

The default document model: MiniLM quantised to int8 (``models/all-MiniLM-L6-v2-int8``; fp32 ships too,
``models/all-MiniLM-L6-v2``), with the static model distilled from it (``embedders.static``) as its query side.
The int8 model's manifest says its vectors live in the fp32 model's *space* (``space``): ``model_id``, which
stores record and check, names that space, so the int8 and fp32 models write into one store without a reindex
(LoCoMo R@10 0.728 with int8 documents and queries against 0.727 with fp32 documents; less CPU per text).
``weights_id`` names the weights themselves. A dynamically quantised model scales its activations per call, so
it embeds each text alone (``per_text``): a text's vector never depends on the texts it was batched with.

The model runs off the event loop in threads of its own (``worker``, one per core by default, ``concurrency``:
queries first, documents their share); queries may go to a lighter query side of the same vector space: a
static model (``kind = "static"``, cheap enough for the caller's thread) or another ONNX copy (``kind = "onnx"``,
e.g. int8), named by ``embedder.query_model`` (``"auto"``: the side the model's manifest names). With a static
query side the ONNX model loads with the first documents: a chat process, which only reads, never holds it.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from proxy.memory.embedders.base import BaseEmbedder
from proxy.memory.embedders.model_files import (
    is_static_model,
    read_manifest,
    read_query_manifest,
    resolve_model_dir,
    resolve_query_model_dir,
)
from proxy.memory.embedders.protocol import Vectors, l2_normalise
from proxy.memory.embedders.settings import AUTO_QUERY_MODEL, EmbedderSettings
from proxy.memory.embedders.static import StaticModel
from proxy.memory.embedders.worker import ModelWorker
from proxy.memory.errors import EmbedderError


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

    One thread owns onnxruntime (``ModelWorker``): callers queue there (cancellable), queries first.
    """

    def __init__(self, settings: EmbedderSettings) -> None:
        super().__init__(settings)
        self.model_dir = resolve_model_dir(settings.model_path)
        if is_static_model(self.model_dir):
            raise EmbedderError(f"{self.model_dir} holds a static model, not an ONNX export: build_embedder loads it")
        self._manifest = read_manifest(self.model_dir)
        if self._manifest.fastembed_model != settings.model:
            raise EmbedderError(
                f"{self.model_dir} holds {self._manifest.fastembed_model}, but the embedder is configured "
                f"for {settings.model}"
            )
        query_model = self._manifest.query_side if settings.query_model == AUTO_QUERY_MODEL else settings.query_model
        self._query_dir = resolve_query_model_dir(query_model) if query_model else None
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
        self._static: StaticModel | None = None  # a static query side, run on the caller's thread
        self._worker: ModelWorker | None = None  # started by ``_load``
        self._documents_task: asyncio.Future[None] | None = None  # the document model's one load
        self._nice: int | None = None  # ``background_priority``
        self._seconds_per_text = 0.005  # wall time of one document text at the model, a moving average
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

    @property
    def _gathers_queries(self) -> bool:
        """A static query side answers at once on the caller's thread, and a model that embeds each text alone
        takes each query as it comes: gathering would only make it wait."""
        return self._static is None and not self._per_text(urgent=True)

    def _per_text(self, *, urgent: bool) -> bool:
        return bool(urgent and self._query_dir is not None) or self._manifest.per_text

    async def _load(self) -> None:
        """The query side now; the document model too, unless a static query side answers every query: then it
        loads with the first documents, so that a process that only reads (a chat process) never holds it."""
        if self._closed:
            raise EmbedderError("the embedder is closed")
        self._worker = ModelWorker(threads=self._settings.concurrency or os.cpu_count() or 1)
        if self._nice is not None:
            self._worker.renice(self._nice)
        await asyncio.to_thread(self._load_query_side)
        if self._static is None:
            await self._load_documents()

    async def _load_documents(self) -> None:
        """Load the document model once: concurrent callers wait for the one load, and a caller that gives up
        (the writer's deadline) does not stop it; a failed load is tried again by the next caller."""
        task = self._documents_task
        if task is None or (task.done() and (task.cancelled() or task.exception() is not None)):
            task = self._documents_task = asyncio.ensure_future(self._load_model())
        await asyncio.shield(task)

    async def _load_model(self) -> None:
        if self._closed:
            raise EmbedderError("the embedder is closed")
        model = await asyncio.to_thread(self._onnx, self.model_dir)
        if self._closed:
            raise EmbedderError("the embedder is closed")
        self._model = model
        probe = await self._embed_batch(["warm-up"])  # the first run allocates: not on a user's request
        if probe.shape != (1, self.dim):
            self._model = None
            raise EmbedderError(
                f"{self.model_dir} makes vectors of shape {probe.shape[1:]}, its manifest says ({self.dim},)"
            )

    def _load_query_side(self) -> None:
        if self._query_manifest is not None and self._query_dir is not None:
            if self._query_manifest.kind == "static":
                self._static = StaticModel(self._query_dir, self.dim)
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
        """At the model's thread; a dynamically quantised model scales activations per call, so it takes each
        text alone (``per_text``): a query's vector never depends on the queries it happened to share a call with."""
        if urgent and self._static is not None:  # queries, on the static query side
            return self._static.embed(texts)
        if self._worker is None:
            raise EmbedderError("the embedder is closed")
        run = self._run_query if urgent and self._query_onnx is not None else self._embed_sync
        if run == self._embed_sync and self._model is None:
            await self._load_documents()
        return await self._worker.submit(run, texts, urgent=urgent, per_text=self._per_text(urgent=urgent))

    def _embed_sync(self, texts: list[str]) -> Vectors:
        started, cpu = time.perf_counter(), time.thread_time()
        vectors = self._run_model(self._model, texts)
        # a moving average of the wall time per text, and the counts (two threads updating them at once lose a
        # sample at most)
        per_text = (time.perf_counter() - started) / max(1, len(texts))
        self._seconds_per_text += 0.1 * (per_text - self._seconds_per_text)
        self.model_texts += len(texts)
        self.model_cpu_s += time.thread_time() - cpu
        return vectors

    def _run_query(self, texts: list[str]) -> Vectors:
        return self._run_model(self._query_onnx, texts)

    def _run_model(self, model: Any, texts: list[str]) -> Vectors:
        if model is None:
            raise EmbedderError("the embedder is closed")
        try:
            rows = list(model.embed(texts, batch_size=len(texts)))
        except Exception as exc:  # onnxruntime's errors derive from Exception only
            raise EmbedderError(f"{self.model_id} failed to embed {len(texts)} texts: {exc}") from exc
        return l2_normalise(np.stack(rows))

    def background_priority(self, nice: int) -> None:
        self._nice = nice
        if self._worker is not None:
            self._worker.renice(nice)

    @property
    def embeds_quickly(self) -> bool:
        return self._static is not None

    @property
    def queries_inline(self) -> bool:
        """A static query side embeds a query on the event loop, at once: a read waits on nothing."""
        return self._static is not None

    def documents_due_s(self, count: int) -> float:
        """``count`` more documents behind the texts waiting for the model's threads, at the model's recent wall
        time per text (its threads may share the cores with the chat: ``background_priority``)."""
        worker = self._worker
        if worker is None or self._model is None:
            return 0.0
        return (worker.waiting_texts + count) * self._seconds_per_text / worker.threads

    def quick_documents(self, texts: Sequence[str]) -> Vectors | None:
        """Documents by the static query side (~0.1 ms a text against ~4 for int8 MiniLM), None without one."""
        if self._static is None:
            return None
        self.quick_texts += len(texts)
        return self._static.embed(list(texts))

    def term_vectors(self) -> StaticModel | None:
        """The static query side's word piece vectors for the read path's term matching (None without one)."""
        return self._static

    async def aclose(self) -> None:
        """Finish the piece in flight, fail what waits, then stop the model's thread."""
        self._closed = True
        worker, self._worker = self._worker, None
        if worker is not None:
            await asyncio.to_thread(worker.close)
        self._model = self._query_onnx = self._static = None
