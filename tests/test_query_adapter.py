"""The per-user query adapter: its model, its training, its pairs, and its life in the store and on the read path."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np

from proxy.memory.adapter_pairs import PairRules, Remembered, Said, answered, drawn_on
from proxy.memory.adapter_training import Bank, FitSettings, Pairs, fit, hard_negatives
from proxy.memory.query_adapter import QueryAdapter
from proxy.memory.read.adapter_cache import AdapterCache, adapter_loader
from proxy.memory.read.retrieval import retrieve
from proxy.memory.read.retrieval_settings import RetrievalSettings
from proxy.memory.store.memory_store import MemoryStore, StoreSettings
from proxy.memory.store.records import Kind, MemoryRecord
from proxy.memory.write.adapter_job import AdapterJobs
from proxy.memory.write.job_types import JobQueueSettings
from proxy.memory.write.queue import JobQueue
from proxy.state import STATE
from tests.conftest import ProxyFactory
from tests.support.embedder import HashingEmbedder

T0 = datetime(2025, 1, 1, tzinfo=UTC)


def _unit(rows: np.ndarray) -> np.ndarray:
    return (rows / np.linalg.norm(rows, axis=-1, keepdims=True)).astype(np.float32)


def _shifted_task(seed: int = 0, n: int = 400, m: int = 300, dim: int = 32) -> tuple[Pairs, Bank]:
    """Queries that sit away from their answers by one systematic shift (what a user's way of asking does)."""
    rng = np.random.default_rng(seed)
    bank = _unit(rng.standard_normal((m, dim)))
    shift = rng.standard_normal((dim, dim)).astype(np.float32) * 0.6
    gold = rng.integers(0, m, n)
    queries = _unit(bank[gold] @ shift + 0.3 * rng.standard_normal((n, dim)))
    return Pairs(queries, gold.astype(np.int64), np.arange(n, dtype=np.int64)), Bank(bank)


def test_an_untrained_adapter_leaves_the_query_as_it_is() -> None:
    """The output layer starts at zero: before training, the adapter is the identity."""
    pairs, bank = _shifted_task()
    adapter = fit(pairs, bank, "m", FitSettings(max_epochs=0)).adapter
    assert np.allclose(adapter.apply(pairs.queries), pairs.queries, atol=1e-6)


def test_training_helps_where_the_queries_are_shifted() -> None:
    """On a task where every query is moved away from its answer the same way, the fitted adapter ranks the
    held-out answers clearly better than the query alone."""
    pairs, bank = _shifted_task()
    found = fit(pairs, bank, "m")
    assert found.held_out > found.baseline + 0.05
    assert found.adapter.held_out == round(found.held_out, 4)


def test_training_is_deterministic() -> None:
    """The same pairs and seed give the same weights, byte for byte."""
    pairs, bank = _shifted_task()
    first, second = fit(pairs, bank, "m").adapter, fit(pairs, bank, "m").adapter
    assert first.to_bytes() == second.to_bytes()


def test_weights_survive_a_round_trip_through_bytes() -> None:
    """What the store keeps is what the read path applies."""
    pairs, bank = _shifted_task()
    adapter = fit(pairs, bank, "m", FitSettings(max_epochs=2)).adapter
    again = QueryAdapter.from_bytes(adapter.to_bytes())
    assert again.model_id == "m"
    assert np.array_equal(again.apply(pairs.queries), adapter.apply(pairs.queries))


def test_a_query_of_another_size_passes_through() -> None:
    """An adapter of another vector space never breaks a query."""
    pairs, bank = _shifted_task()
    adapter = fit(pairs, bank, "m", FitSettings(max_epochs=1)).adapter
    query = np.ones(8, dtype=np.float32)
    assert adapter.apply(query) is query


def test_hard_negatives_come_from_the_subject_graph_and_skip_near_answers() -> None:
    """The answer's subject siblings come first; a memory almost as close to the query as the answer is dropped."""
    answer, sibling, near_copy, other = np.eye(4, dtype=np.float32)
    bank = Bank(
        _unit(np.stack([answer, 0.2 * answer + sibling, 0.99 * answer + 0.01 * near_copy, other])),
        subjects=np.eye(4, dtype=np.float32)[:1],
        subjects_of=[[0], [0], [], []],
    )
    pairs = Pairs(answer[None, :], np.array([0]), np.array([0]))
    negatives = hard_negatives(pairs, bank, FitSettings(hard_k=3))[0].tolist()
    assert negatives[0] == 1
    assert 2 not in negatives
    assert 3 in negatives


def test_pairs_are_questions_with_their_answers_and_replies_that_drew_on_the_past() -> None:
    """A question and the other side's answer make a pair; so do a message and the earlier chat its reply
    echoes, but not a reply that echoes nothing rare."""
    said = [
        Said("We adopted a beagle called Biscuit last spring", "user", "c1", T0),
        Said("Lovely, congratulations!", "assistant", "c1", T0 + timedelta(seconds=1)),
        Said("What should I feed him?", "user", "c2", T0 + timedelta(days=3)),
        Said("Biscuit the beagle will do well on puppy food", "assistant", "c2", T0 + timedelta(days=3, seconds=1)),
    ]
    memories = [Remembered(s.text, s.conversation, s.at) for s in said]
    assert answered(said) == [(2, 3)]
    assert drawn_on(said, memories, PairRules()) == [(2, 0)]


def _chat() -> list[MemoryRecord]:
    """A user who asks about five topics in words that never appear in the answers (many conversations)."""
    topics = [
        ("where did I travel", "flew visited city"),
        ("what pet do I own", "animal adopted shelter"),
        ("which food do I cook", "recipe kitchen dinner"),
        ("what sport do I play", "match team league"),
        ("what music do I like", "band concert album"),
    ]
    out, at = [], T0
    for i in range(30):
        for t, (question, answer) in enumerate(topics):
            conversation = f"c{i}-{t}"
            for role, text in (("user", f"{question} n{i}?"), ("assistant", f"You {answer} n{i}")):
                at += timedelta(minutes=1)
                out.append(MemoryRecord(user_id="u", kind=Kind.TURN, text=text, created_at=at,
                                        conversation_id=conversation, role=role))  # fmt: skip
    return out


async def test_a_refit_ships_to_the_store_is_applied_on_reads_and_is_forgotten(tmp_path: Path) -> None:
    """Through the store: the job fits on the user's chats and stores the adapter (it beats no adapter), the read
    path's dense arm then finds a topic's answer for a new question, and forgetting the user deletes it."""
    embedder = HashingEmbedder()
    queue = JobQueue(JobQueueSettings(path=tmp_path / "jobs.db"))
    async with MemoryStore(StoreSettings(path=tmp_path / "data"), embedder) as store, queue:
        await store.add(_chat())
        jobs = AdapterJobs(store, embedder, queue, refit_s=86_400, min_pairs=50)
        outcome = await jobs.refit("u")
        assert outcome.action == "shipped"
        assert outcome.held_out > outcome.baseline
        cache = AdapterCache(adapter_loader(store.adapters, embedder.model_id), max_bytes=2**20)
        adapter = await cache.get("u")
        assert adapter is not None
        dense = RetrievalSettings(dense_weight=1.0, bm25_weight=0.0, entity_k=0, term_match_weight=0.0,
                                  neighbour_weight=0.0, conversation_weight=0.0, turn_window_days=None,
                                  recent_messages=0, max_insights=0, dense_k=400, max_candidates=400)  # fmt: skip
        messages = [{"role": "user", "content": "what pet do I own n99?"}]
        plain = await retrieve(store, embedder, messages, "u", dense, T0 + timedelta(days=9))
        adapted = await retrieve(store, embedder, messages, "u", dense, T0 + timedelta(days=9), adapter=adapter)
        assert _answer_rank(adapted) == 0 < _answer_rank(plain)
        await store.add([MemoryRecord(user_id="v", kind=Kind.FACT, text="another user")])
        await store.adapters.put("v", embedder.model_id, T0, adapter.to_bytes())
        await store.forget_user("u")
        assert await store.adapters.get("u") is None
        assert await store.adapters.get("v") is not None
        await store.forget_user("v")
    for file in (p for p in (tmp_path / "data" / "adapters").rglob("*") if p.is_file()):
        assert b"user_id = 'u'" not in file.read_bytes()
        assert b"user_id = 'v'" not in file.read_bytes()


def _answer_rank(result: object) -> int:
    """Where the first answer about pets is among the answers ranked."""
    texts = [c.record.text for c in result.candidates if c.record.role == "assistant"]  # type: ignore[attr-defined]
    return next((i for i, text in enumerate(texts) if "adopted" in text), len(texts))


async def test_the_cache_holds_adapters_within_its_bytes() -> None:
    """Loaded adapters stay within the byte bound, the least recently used leaving first."""
    pairs, bank = _shifted_task()
    adapter = fit(pairs, bank, "m", FitSettings(max_epochs=1)).adapter
    loads: list[str] = []

    async def load(user_id: str) -> QueryAdapter | None:
        loads.append(user_id)
        return adapter

    cache = AdapterCache(load, max_bytes=int(adapter.nbytes * 2.5))
    for user in ("a", "b", "a", "c", "a"):
        await cache.get(user)
    assert loads == ["a", "b", "c"]
    assert cache.cached_bytes <= adapter.nbytes * 2.5


async def test_a_user_gets_one_refit_job_per_period(tmp_path: Path) -> None:
    """Every exchange asks for a refit; within one period they all name the same job, another user gets theirs."""
    async with JobQueue(JobQueueSettings(path=tmp_path / "jobs.db")) as queue:
        jobs = AdapterJobs(None, HashingEmbedder(), queue, refit_s=86_400, min_pairs=50)  # type: ignore[arg-type]
        first, again, other = await jobs.request("u"), await jobs.request("u"), await jobs.request("w")
        assert first == again
        assert other != first


class _BrokenTable:
    """An adapter table whose stored blob is damaged."""

    async def get(self, user_id: str) -> tuple[str, bytes]:
        return "m", b"not an npz"


async def test_an_unreadable_adapter_means_none() -> None:
    """A damaged adapter never fails a request: the query goes on as embedded."""
    load = adapter_loader(_BrokenTable(), "m")  # type: ignore[arg-type]
    assert await load("u") is None


async def test_with_adapters_on_a_chat_queues_a_refit_and_reads_still_serve(make_proxy: ProxyFactory) -> None:
    """Through the proxy with ``query_adapter`` on: an exchange queues the user's refit, which ends (too few pairs
    for a new user), and the next request is served by the dense arm as before."""
    proxy = await make_proxy(retrieval={"query_adapter": True})
    headers = {"X-Memory-User": "fay", "X-Memory-Conversation": "c1"}
    body = {"model": "fake-echo", "messages": [{"role": "user", "content": "My cat Miso is twelve."}]}
    assert (await proxy.post("/v1/chat/completions", json=body, headers=headers)).status == 200
    engine = proxy.app[STATE].memory
    job_id = await engine.adapter_jobs.request("fay")  # type: ignore[attr-defined]
    job = await _finished(engine.jobs, job_id)  # type: ignore[attr-defined]
    assert job["state"] == "done"
    asked = await proxy.post("/v1/chat/completions", json=body, headers={**headers, "X-Memory-Conversation": "c2"})
    assert asked.status == 200
    assert "dense" in asked.headers["X-Memory-Arms"]
    assert await engine.store.adapters.get("fay") is None  # type: ignore[attr-defined]


async def _finished(queue: JobQueue, job_id: str, wait_s: float = 20.0) -> dict[str, Any]:
    """The job's row once it is no longer pending or running."""
    deadline = asyncio.get_running_loop().time() + wait_s
    while asyncio.get_running_loop().time() < deadline:
        row = await queue.get(job_id)
        if row is not None and row["state"] not in ("pending", "running"):
            return row
        await asyncio.sleep(0.05)
    raise AssertionError("the adapter job did not finish")
