"""Embedders: the shipped all-MiniLM-L6-v2 ONNX model through fastembed, and litellm against a fake server."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import shutil
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytest_asyncio
from aiohttp import web

from proxy.memory.embedders.base import QueryCache
from proxy.memory.embedders.factory import build_embedder
from proxy.memory.embedders.local import LocalEmbedder
from proxy.memory.embedders.model_files import ONNX_MODEL_DIR_NAME, STATIC_MODEL_DIR_NAME, default_model_dirs
from proxy.memory.embedders.protocol import Embedder
from proxy.memory.embedders.remote import LiteLLMEmbedder
from proxy.memory.embedders.settings import EmbedderSettings
from proxy.memory.embedders.static import StaticEmbedder, unit_int8
from proxy.memory.errors import EmbedderError
from proxy.memory.pieces import term_vectors_of

pytestmark = pytest.mark.asyncio(loop_scope="module")

MODEL_DIR = default_model_dirs(ONNX_MODEL_DIR_NAME)[0]  # MiniLM int8: the ONNX model these tests exercise
INT8 = EmbedderSettings(model_path=MODEL_DIR, query_model=None)  # queries through the model itself
STATIC_MODEL = EmbedderSettings(model_path=default_model_dirs(STATIC_MODEL_DIR_NAME)[0])  # the static model alone
FAKE_DIM = 8


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def local() -> AsyncIterator[LocalEmbedder]:
    """MiniLM int8 through onnxruntime (queries embedded by the model itself), loaded once for the module."""
    async with LocalEmbedder(INT8) as embedder:
        yield embedder


def _cos(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.dot(a, b))


async def test_similar_sentences_are_closer_than_unrelated(local: LocalEmbedder) -> None:
    """A paraphrase scores higher than an unrelated sentence, so retrieval finds the right memory."""
    query = await local.embed_query("Where does the user live?")
    docs = await local.embed_documents(["The user lives in Berlin.", "The user's cat likes tuna."])
    assert _cos(query, docs[0]) > _cos(query, docs[1]) + 0.1


async def test_vectors_are_unit_float32_of_the_model_dim(local: LocalEmbedder) -> None:
    """Documents and queries come back as float32 unit vectors of 384 dimensions."""
    docs = await local.embed_documents(["one", "two words", "three words here"])
    query = await local.embed_query("a query")
    assert local.dim == 384
    assert docs.shape == (3, 384)
    assert query.shape == (384,)
    assert docs.dtype == np.float32
    assert query.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(docs, axis=1), 1.0, atol=1e-5)
    assert abs(float(np.linalg.norm(query)) - 1.0) < 1e-5


async def test_model_id_names_the_space_and_weights_id_the_weights(local: LocalEmbedder) -> None:
    """The default int8 model writes into the fp32 model's space (one store, no reindex); its weights keep their id."""
    assert local.model_id == "local/all-MiniLM-L6-v2-onnx-fp32"
    assert local.weights_id == "local/all-MiniLM-L6-v2-onnx-int8"
    assert isinstance(local, Embedder)


async def test_embedding_is_deterministic(local: LocalEmbedder) -> None:
    """The same text always gets the same vector, as a document and as a query."""
    first = await local.embed_documents(["I am allergic to peanuts."])
    second = await local.embed_documents(["I am allergic to peanuts."])
    query = await local.embed_query("I am allergic to peanuts.")
    np.testing.assert_array_equal(first, second)
    np.testing.assert_allclose(first[0], query, atol=1e-6)


async def test_query_cache_hit_does_not_recompute(local: LocalEmbedder) -> None:
    """Asking the same query again is served from the cache and cannot be corrupted by the caller."""
    first = await local.embed_query("what did I say about my sister?")
    computed = local.texts_embedded
    again = await local.embed_query("what did I say about my sister?")
    assert local.texts_embedded == computed
    np.testing.assert_array_equal(first, again)
    with pytest.raises(ValueError, match="read-only"):
        again[0] = 1.0


async def test_batches_equal_one_by_one() -> None:
    """Embedding in batches gives the same vectors as embedding each text alone."""
    texts = [f"note number {i}: " + "word " * (i * 5 % 7) for i in range(7)]  # lengths out of order
    async with LocalEmbedder(EmbedderSettings(model_path=MODEL_DIR, batch_size=3, threads=1)) as embedder:
        batched = await embedder.embed_documents(texts)
        alone = np.stack([(await embedder.embed_documents([t]))[0] for t in texts])
    np.testing.assert_allclose(batched, alone, atol=1e-5)


async def test_concurrent_queries_get_their_own_vectors(local: LocalEmbedder) -> None:
    """Many queries at once each get the vector they would get alone."""
    texts = [f"concurrent question {i}" for i in range(12)]
    together = await asyncio.gather(*(local.embed_query(t) for t in texts))
    expected = await local.embed_documents(texts)
    np.testing.assert_allclose(np.stack(together), expected, atol=1e-5)


class CountingLocal(LocalEmbedder):
    """The shipped model, noting the texts of every model call in the order the model ran them."""

    def __init__(self, settings: EmbedderSettings) -> None:
        super().__init__(settings)
        self.calls: list[list[str]] = []

    def _embed_sync(self, texts: list[str]) -> np.ndarray:
        self.calls.append(list(texts))
        return super()._embed_sync(texts)


async def test_a_text_asked_as_a_query_is_not_embedded_again_as_a_document(local: LocalEmbedder) -> None:
    """The writer's user turn is the read path's query: its vector comes from the cache, identical; a document
    embedded once is not embedded again either (the turn before the next exchange)."""
    query = await local.embed_query("I moved to Lisbon for the new job in March")
    before = local.texts_embedded
    vectors = await local.embed_documents(["I moved to Lisbon for the new job in March", "Congratulations!"])
    assert local.texts_embedded == before + 1
    np.testing.assert_array_equal(vectors[0], query)
    again = await local.embed_documents(["Congratulations!", "And how is the flat?"])
    assert local.texts_embedded == before + 2
    np.testing.assert_array_equal(again[0], vectors[1])
    fresh = LocalEmbedder(EmbedderSettings(model_path=MODEL_DIR, query_cache_size=0))
    async with fresh:
        np.testing.assert_allclose(await fresh.embed_documents(["Congratulations!"]), vectors[1:], atol=1e-6)


async def test_a_cancelled_query_does_not_stall_the_others(local: LocalEmbedder) -> None:
    """A caller that gives up (its request timed out) leaves the other queries served."""
    waiting = asyncio.create_task(local.embed_query("a question nobody waits for"))
    await asyncio.sleep(0)
    waiting.cancel()
    answered = await asyncio.wait_for(local.embed_query("a question somebody waits for"), 30)
    assert answered.shape == (local.dim,)
    assert waiting.cancelled()


async def test_cjk_and_emoji_input(local: LocalEmbedder) -> None:
    """Korean, Japanese, Chinese and emoji text embeds to distinct finite unit vectors."""
    texts = ["저는 서울에 살아요", "私は東京で働いています", "我喜欢爬山", "party 🎉🎂 on Saturday 🍕", ""]
    vectors = await local.embed_documents(texts)
    assert np.isfinite(vectors).all()
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    assert len({v.tobytes() for v in vectors}) == len(texts)


async def test_long_text_is_truncated_not_rejected(local: LocalEmbedder) -> None:
    """A text far beyond the model's 256 tokens still embeds."""
    vector = await local.embed_query("a very long memory " * 500)
    assert vector.shape == (384,)


async def test_empty_list(local: LocalEmbedder) -> None:
    """No texts gives an empty (0, dim) matrix."""
    computed = local.texts_embedded
    vectors = await local.embed_documents([])
    assert vectors.shape == (0, 384)
    assert vectors.dtype == np.float32
    assert local.texts_embedded == computed


async def test_missing_model_dir_fails_fast_and_clearly(tmp_path: Path) -> None:
    """A wrong model path fails at once, naming the path and how to produce the model."""
    started = time.monotonic()
    with pytest.raises(EmbedderError, match=r"export_minilm\.py") as info:
        build_embedder(EmbedderSettings(model_path=tmp_path / "absent"))
    assert str(tmp_path / "absent") in str(info.value)
    assert time.monotonic() - started < 1.0


async def test_corrupt_model_fails_fast_at_start(tmp_path: Path) -> None:
    """A model directory with a broken ONNX file fails at start with an EmbedderError, no hub retry."""
    broken = tmp_path / "broken"
    shutil.copytree(MODEL_DIR, broken, ignore=shutil.ignore_patterns("model.onnx"))
    (broken / "model.onnx").write_bytes(b"not an onnx model")
    embedder = LocalEmbedder(EmbedderSettings(model_path=broken, query_model=None))
    started = time.monotonic()
    with pytest.raises(EmbedderError, match="cannot load"):
        await embedder.start()
    assert time.monotonic() - started < 5.0
    await embedder.aclose()


async def test_with_a_static_query_side_the_model_loads_with_the_first_documents(tmp_path: Path) -> None:
    """A static query side answers queries without the ONNX model, which loads (and fails, if broken) with the
    first documents: a process that only reads never holds it."""
    broken = tmp_path / "broken"
    shutil.copytree(MODEL_DIR, broken, ignore=shutil.ignore_patterns("model.onnx"))
    (broken / "model.onnx").write_bytes(b"not an onnx model")
    async with LocalEmbedder(EmbedderSettings(model_path=broken)) as embedder:
        query = await embedder.embed_query("Where does the user live?")
        assert query.shape == (384,)
        assert embedder._model is None
        with pytest.raises(EmbedderError, match="cannot load"):
            await embedder.embed_documents(["The user lives in Berlin."])


async def test_model_dir_for_another_model_is_refused() -> None:
    """Configuring a different model than the directory holds is refused rather than mislabelled."""
    with pytest.raises(EmbedderError, match="holds sentence-transformers/all-MiniLM-L6-v2"):
        LocalEmbedder(EmbedderSettings(model="BAAI/bge-small-en-v1.5", model_path=MODEL_DIR))


async def test_closed_embedder_refuses_work() -> None:
    """After close, embedding raises EmbedderError instead of hanging."""
    embedder = LocalEmbedder(EmbedderSettings(model_path=MODEL_DIR))
    await embedder.aclose()
    with pytest.raises(EmbedderError, match="closed"):
        await embedder.embed_query("anything")


async def test_query_cache_evicts_least_recently_used() -> None:
    """The cache keeps the most recently used queries up to its size."""
    cache = QueryCache(2)
    vector = np.ones(3, dtype=np.float32)
    cache.put("a", vector)
    cache.put("b", vector)
    assert cache.get("a") is not None
    cache.put("c", vector)
    assert cache.get("b") is None
    assert cache.get("a") is not None
    assert cache.get("c") is not None
    assert len(cache) == 2


async def test_pinned_vectors_outlive_the_lru_until_unpinned() -> None:
    """A pinned text survives any number of newer ones, as often pinned as unpinned; then it is an LRU entry
    again; pins beyond the cap drop the oldest; pinning what is not cached does nothing."""
    cache = QueryCache(2, max_pinned=2)
    vector = np.ones(3, dtype=np.float32)
    cache.put("turn", vector)
    cache.pin("turn")
    cache.pin("turn")
    cache.pin("never embedded")
    for i in range(10):
        cache.put(f"other {i}", vector)
    cache.unpin("turn")
    assert cache.get("turn") is not None
    assert cache.get("never embedded") is None
    cache.unpin("turn")  # the last: back in the LRU as most recently used, evicted like any entry after that
    cache.put("newer", vector)
    assert cache.get("turn") is not None
    cache.put("newest", vector)
    cache.put("latest", vector)
    assert cache.get("turn") is None
    for text in ("a", "b", "c"):
        cache.put(text, vector)
        cache.pin(text)
    assert [cache.get(t) is not None for t in ("a", "b", "c")] == [False, True, True]


# --- litellm against a fake OpenAI-compatible embeddings server -------------------------------------------


def _fake_vector(text: str) -> np.ndarray:
    digest = hashlib.sha256(text.encode()).digest()
    return np.frombuffer(digest[: FAKE_DIM * 4], dtype=np.uint32).astype(np.float32) / 1e9 + 0.5


class FakeEmbeddings:
    """POST /v1/embeddings on 127.0.0.1, unnormalised vectors derived from each input; 400 for 'bad'."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self._runner: web.AppRunner | None = None
        self.port = 0

    async def __aenter__(self) -> FakeEmbeddings:
        app = web.Application()
        app.router.add_post("/v1/embeddings", self._embeddings)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = self._runner.addresses[0][1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._runner is not None
        await self._runner.cleanup()

    async def _embeddings(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append({"json": body, "auth": request.headers.get("Authorization")})
        inputs = body["input"] if isinstance(body["input"], list) else [body["input"]]
        if "bad" in inputs:
            error = {"message": "bad input", "type": "invalid_request_error"}
            return web.json_response({"error": error}, status=400)
        data = [
            {"object": "embedding", "index": i, "embedding": self._encode(t, body)}
            for i, t in reversed(list(enumerate(inputs)))
        ]
        usage = {"prompt_tokens": len(inputs), "total_tokens": len(inputs)}
        return web.json_response({"object": "list", "data": data, "model": body["model"], "usage": usage})

    @staticmethod
    def _encode(text: str, body: dict[str, Any]) -> Any:
        vector = _fake_vector(text)
        if body.get("encoding_format") == "base64":
            return base64.b64encode(vector.astype("<f4").tobytes()).decode()
        return vector.tolist()


@pytest_asyncio.fixture(loop_scope="module")
async def fake_server() -> AsyncIterator[FakeEmbeddings]:
    """A fresh fake embeddings server."""
    async with FakeEmbeddings() as server:
        yield server


def _litellm_settings(server: FakeEmbeddings, **overrides: Any) -> EmbedderSettings:
    values: dict[str, Any] = {
        "provider": "litellm",
        "model": "openai/some-model",
        "api_base": f"http://127.0.0.1:{server.port}/v1",
        "api_key": "sk-embed-test",
    }
    return EmbedderSettings(**(values | overrides))


async def test_litellm_embeds_through_the_remote_model(fake_server: FakeEmbeddings) -> None:
    """Remote vectors come back normalised, in input order, batched, with the key sent as a bearer token."""
    embedder = build_embedder(_litellm_settings(fake_server, batch_size=2))
    assert isinstance(embedder, LiteLLMEmbedder)
    texts = ["alpha", "beta", "gamma", "delta", "epsilon"]
    async with embedder:
        vectors = await embedder.embed_documents(texts)
    assert embedder.model_id == "litellm/openai/some-model"
    assert embedder.dim == FAKE_DIM
    expected = np.stack([_fake_vector(t) / np.linalg.norm(_fake_vector(t)) for t in texts])
    np.testing.assert_allclose(vectors, expected, atol=1e-6)
    batch_sizes = [len(r["json"]["input"]) for r in fake_server.requests[1:]]  # [0] is the dim probe
    assert batch_sizes == [2, 2, 1]
    assert {r["json"]["model"] for r in fake_server.requests} == {"some-model"}
    assert {r["auth"] for r in fake_server.requests} == {"Bearer sk-embed-test"}


async def test_litellm_query_cache(fake_server: FakeEmbeddings) -> None:
    """A repeated query is answered from the cache without another remote call."""
    async with build_embedder(_litellm_settings(fake_server, dim=FAKE_DIM)) as embedder:
        first = await embedder.embed_query("remember me")
        second = await embedder.embed_query("remember me")
    assert len(fake_server.requests) == 1
    np.testing.assert_array_equal(first, second)
    assert abs(float(np.linalg.norm(first)) - 1.0) < 1e-6


async def test_litellm_errors_become_embedder_errors(fake_server: FakeEmbeddings) -> None:
    """A provider error surfaces as EmbedderError naming the model, not as a litellm exception."""
    async with build_embedder(_litellm_settings(fake_server, dim=FAKE_DIM)) as embedder:
        with pytest.raises(EmbedderError, match="litellm/openai/some-model"):
            await embedder.embed_documents(["fine", "bad"])


async def test_litellm_wrong_dimension_is_refused(fake_server: FakeEmbeddings) -> None:
    """Vectors of another size than configured are refused, so a store never mixes dimensions."""
    async with build_embedder(_litellm_settings(fake_server, dim=FAKE_DIM + 1)) as embedder:
        with pytest.raises(EmbedderError, match="shape"):
            await embedder.embed_query("x")


# --- query sides: a static model distilled into MiniLM's space, an ONNX copy ----------------------------

STATIC = "minilm-static"


async def test_default_int8_model_lands_in_the_fp32_space_and_embeds_each_text_alone() -> None:
    """The default int8 model's vectors are within ~2% of fp32's, and a text's vector does not depend on its batch."""
    texts = [
        "Where does the user live?",
        "What did I say about my sister's cello lessons?",
        "Caroline: I went to the LGBTQ support group yesterday and it was so powerful, honestly life-changing.",
    ]
    fp32 = EmbedderSettings(model_path=default_model_dirs("all-MiniLM-L6-v2")[0], query_model=None)
    async with LocalEmbedder(INT8) as int8, LocalEmbedder(fp32) as full:
        batched = await int8.embed_documents(texts)
        alone = [await int8.embed_documents([text]) for text in texts]
        queries = await int8.embed_queries(texts)
        reference = await full.embed_documents(texts)
    assert int8.model_id == full.model_id == "local/all-MiniLM-L6-v2-onnx-fp32"
    assert int8.query_model_id is None  # the int8 model answers queries itself
    assert full.query_model_id is None
    np.testing.assert_array_equal(batched, np.concatenate(alone))
    np.testing.assert_allclose(queries, batched, atol=1e-6)
    assert float((batched * reference).sum(axis=1).min()) > 0.97
    assert not np.allclose(batched, reference, atol=1e-4)  # really another model


async def test_former_int8_query_side_name_still_serves_fp32_documents() -> None:
    """``query_model = "all-MiniLM-L6-v2-int8-query"`` (its name before it became the default) still loads."""
    fp32 = EmbedderSettings(
        model_path=default_model_dirs("all-MiniLM-L6-v2")[0], query_model="all-MiniLM-L6-v2-int8-query"
    )
    async with LocalEmbedder(fp32) as embedder:
        query = await embedder.embed_query("Where does the user live?")
        document = await embedder.embed_documents(["Where does the user live?"])
    assert embedder.query_model_id == "local/all-MiniLM-L6-v2-onnx-int8"
    assert float(query @ document[0]) > 0.97


async def test_static_query_side_finds_documents_of_the_model() -> None:
    """Queries embedded by the shipped static model rank the matching MiniLM document first, as unit vectors."""
    documents = ["The user lives in Berlin.", "The user's cat likes tuna.", "My sister Anna plays the cello."]
    async with LocalEmbedder(EmbedderSettings(model_path=MODEL_DIR, query_model=STATIC)) as embedder:
        docs = await embedder.embed_documents(documents)
        queries = [
            await embedder.embed_query(q)
            for q in ("Where does the user live?", "what does my cat eat", "which instrument does my sister play?")
        ]
    assert embedder.model_id == "local/all-MiniLM-L6-v2-onnx-fp32"  # stored vectors: the document model's
    assert embedder.query_model_id == "local/minilm-static-v1"
    for i, query in enumerate(queries):
        assert query.shape == (384,)
        assert query.dtype == np.float32
        assert abs(float(np.linalg.norm(query)) - 1.0) < 1e-5
        assert int(np.argmax(docs @ query)) == i


async def test_static_query_side_makes_no_model_call() -> None:
    """A query on the static side costs no transformer pass: the model runs only for documents."""
    async with CountingLocal(EmbedderSettings(model_path=MODEL_DIR, query_model=STATIC)) as embedder:
        await asyncio.gather(*(embedder.embed_query(f"question {i}") for i in range(5)))
        assert embedder.calls == []
        await embedder.embed_documents(["a document"])
    assert embedder.calls == [["warm-up"], ["a document"]]  # the model loads (and warms up) with the first documents


async def test_onnx_query_side_is_used_for_queries(tmp_path: Path) -> None:
    """An ONNX query side (here a copy of the model itself) answers queries and batches of queries alike."""
    side = tmp_path / "query-side"
    side.mkdir()
    for item in MODEL_DIR.iterdir():
        (side / item.name).symlink_to(item)
    (side / "manifest.json").unlink()
    (side / "manifest.json").write_text(
        '{"model_id": "local/copy-query", "kind": "onnx", "query_for": "local/all-MiniLM-L6-v2-onnx-fp32", "dim": 384}'
    )
    async with LocalEmbedder(EmbedderSettings(model_path=MODEL_DIR, query_model=str(side))) as embedder:
        one = await embedder.embed_query("Where does the user live?")
        batch = await embedder.embed_queries(["Where does the user live?", "and the cat?"])
        document = await embedder.embed_documents(["Where does the user live?"])
    assert embedder.query_model_id == "local/copy-query"
    np.testing.assert_allclose(batch[0], one, atol=1e-5)
    np.testing.assert_allclose(document[0], one, atol=1e-5)


async def test_query_model_of_another_space_is_refused(tmp_path: Path) -> None:
    """A query model trained for other document vectors is refused: query and document spaces never mix."""
    side = tmp_path / "other"
    shutil.copytree(default_model_dirs(STATIC)[0], side)
    (side / "manifest.json").write_text('{"model_id": "x", "kind": "static", "query_for": "local/other", "dim": 384}')
    with pytest.raises(EmbedderError, match="serves local/other"):
        LocalEmbedder(EmbedderSettings(model_path=MODEL_DIR, query_model=str(side)))


async def test_missing_query_model_fails_fast() -> None:
    """A query model name that is not under models/ fails at once, saying how to build one."""
    with pytest.raises(EmbedderError, match=r"distill_static\.py"):
        LocalEmbedder(EmbedderSettings(model_path=MODEL_DIR, query_model="no-such-model"))


async def test_query_model_none_can_be_spelt_as_text() -> None:
    """``none`` or an empty value (as an environment variable says it) means queries use the model itself."""
    assert EmbedderSettings(query_model="none").query_model is None
    assert EmbedderSettings(query_model="").query_model is None


# --- the default: MiniLM int8 for documents, the static model for queries --------------------------------------


async def test_default_embedder_is_minilm_int8_with_the_static_query_side() -> None:
    """Out of the box documents go through MiniLM int8 (the fp32 model's space) and questions through the static
    model distilled from it (``query_model = "auto"``: the side the model's manifest names)."""
    assert EmbedderSettings().label == "models/all-MiniLM-L6-v2-int8"
    async with build_embedder(EmbedderSettings()) as embedder:
        assert isinstance(embedder, LocalEmbedder)
        assert embedder.model_id == "local/all-MiniLM-L6-v2-onnx-fp32"
        assert embedder.weights_id == "local/all-MiniLM-L6-v2-onnx-int8"
        assert embedder.query_model_id == "local/minilm-static-v1"
        assert term_vectors_of(embedder) is not None  # term matching has the static side's word pieces
    async with build_embedder(EmbedderSettings(query_model="none")) as embedder:
        assert embedder.query_model_id is None


async def test_the_static_model_as_the_document_model_loads_no_onnx_model() -> None:
    """``model_path = models/minilm-static``: its own space, queries and documents alike, no thread."""
    async with build_embedder(STATIC_MODEL) as embedder:
        assert isinstance(embedder, StaticEmbedder)
        assert embedder.model_id == embedder.weights_id == "local/minilm-static-v1"
        assert embedder.dim == 384
        assert embedder.query_model_id is None
        query = await embedder.embed_query("I am allergic to peanuts.")
        documents = await embedder.embed_documents(["I am allergic to peanuts.", "x " * 2000])
    assert documents.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(documents, axis=1), 1.0, atol=1e-5)
    np.testing.assert_allclose(query, documents[0], atol=1e-6)  # one model on both sides


async def test_static_model_finds_the_matching_memory_and_spreads_like_minilm(local: LocalEmbedder) -> None:
    """Each question's memory ranks first, and unrelated texts sit far apart as under MiniLM (the thresholds of
    insight clustering and of the writer's "a stored fact is near" were calibrated there)."""
    memories = ["The user lives in Berlin.", "The user's cat likes tuna.", "My sister Anna plays the cello."]
    questions = ["Where does the user live?", "what does my cat eat", "which instrument does my sister play?"]
    unrelated = ["I planted tomatoes in my garden.", "Our CI pipeline keeps failing.", "I ran 10 km this morning."]
    async with build_embedder(STATIC_MODEL) as static:
        docs = await static.embed_documents(memories)
        asked = np.stack([await static.embed_query(q) for q in questions])
        far = await static.embed_documents(unrelated)
    minilm_far = await local.embed_documents(unrelated)
    assert [int(i) for i in np.argmax(asked @ docs.T, axis=1)] == [0, 1, 2]
    off_diagonal = ~np.eye(3, dtype=bool)
    assert float((far @ far.T)[off_diagonal].max()) < 0.3
    assert (
        abs(float((far @ far.T)[off_diagonal].mean()) - float((minilm_far @ minilm_far.T)[off_diagonal].mean())) < 0.15
    )


async def test_static_model_lends_word_piece_vectors_for_term_matching() -> None:
    """The static model's token rows serve term matching: distinct sorted ids per word list, a token's cosine
    with itself 1 (to within the int8 rows' ~0.003), and a word's other form nearer than an unrelated word. None
    before the model is loaded."""
    embedder = build_embedder(STATIC_MODEL)
    assert term_vectors_of(embedder) is None
    async with embedder:
        await embedder.embed_query("warm-up")
        vectors = term_vectors_of(embedder)
    assert vectors is not None
    pieces = vectors.pieces(["research", "research", "adoption"])
    assert pieces.tolist() == sorted(set(pieces.tolist()))
    assert len(pieces) == 2
    assert vectors.pieces([]).tolist() == []
    research, researching, weather = (vectors.pieces([w]) for w in ("research", "researching", "weather"))
    np.testing.assert_allclose(np.diag(vectors.cosines(pieces, pieces)), 1.0, atol=5e-3)
    near, far = vectors.cosines(research, np.concatenate([researching, weather]))[0]
    assert near > 0.6 > 0.2 > far


async def test_static_query_side_lends_word_piece_vectors_too() -> None:
    """An ONNX model with the static query side lends that side's vectors; without one it lends none."""
    async with LocalEmbedder(EmbedderSettings(model_path=MODEL_DIR, query_model=STATIC)) as embedder:
        assert term_vectors_of(embedder) is not None
    async with LocalEmbedder(EmbedderSettings(model_path=MODEL_DIR, query_model=None)) as embedder:
        assert term_vectors_of(embedder) is None


async def test_static_model_refuses_another_query_side_and_an_onnx_loader() -> None:
    """A static model answers its own queries; the ONNX loader refuses its directory rather than failing later."""
    with pytest.raises(EmbedderError, match="answers its own queries"):
        build_embedder(STATIC_MODEL.model_copy(update={"query_model": "all-MiniLM-L6-v2-int8"}))
    with pytest.raises(EmbedderError, match="static model"):
        LocalEmbedder(STATIC_MODEL)
    assert isinstance(build_embedder(STATIC_MODEL.model_copy(update={"query_model": "minilm-static"})), StaticEmbedder)
    assert isinstance(build_embedder(STATIC_MODEL.model_copy(update={"query_model": None})), StaticEmbedder)


async def test_a_large_batch_of_documents_is_embedded_off_the_loop() -> None:
    """Big batches go to a worker thread (the loop keeps serving), small ones and queries stay inline."""
    async with build_embedder(STATIC_MODEL) as embedder:
        assert isinstance(embedder, StaticEmbedder)
        threads: list[str] = []
        model = embedder._model
        assert model is not None
        original = model.embed

        def noting(texts: Any) -> Any:
            threads.append(threading.current_thread().name)
            return original(texts)

        model.embed = noting  # type: ignore[method-assign]
        await embedder.embed_documents([f"memory number {i}" for i in range(StaticEmbedder.INLINE_TEXTS + 1)])
        await embedder.embed_documents(["one memory"])
        await embedder.embed_query("a question")
    main = threading.main_thread().name
    assert threads[0] != main
    assert threads[1:] == [main, main]


async def test_int8_unit_rows_give_cosines_within_half_a_hundredth() -> None:
    """Term matching's int8 copy of a static table: products of its rows (times their scales) are the rows'
    cosines to within 0.005, whatever the rows' lengths; a row of zeros stays zeros."""
    rng = np.random.default_rng(7)
    table = (rng.normal(size=(300, 384)) * rng.uniform(0.01, 3.0, size=(300, 1))).astype(np.float16)
    table[5] = 0.0
    codes, scales = unit_int8(table, chunk=64)
    approx = (codes.astype(np.float32) * scales[:, None]) @ (codes.astype(np.float32) * scales[:, None]).T
    rows = table.astype(np.float64)
    norms = np.linalg.norm(rows, axis=1)
    norms[5] = 1.0
    exact = (rows / norms[:, None]) @ (rows / norms[:, None]).T
    assert np.abs(approx - exact).max() < 0.005
    assert not codes[5].any()
    assert scales[5] == 0.0
