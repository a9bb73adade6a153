"""The write-side job that refits a user's query adapter (``proxy.memory.query_adapter``) now and then.

The pairs come from what the product stored (``adapter_pairs``): a question in a chat and the reply that
answered it, and a message and the earlier memory its reply drew on. The bank is the user's valid memories
(facts, turns, summaries) with their stored vectors, and their subjects for the subject term and the hard
negatives. The adapter is fitted off the event loop (``adapter_training.fit``) and stored only when it ranks
the newest pairs' answers better than both no adapter and the user's current adapter, with confidence
(``adapter_training.beats``).

Triggered by ``request`` (the engine calls it for each recorded exchange while adapters are on): at most one
job per user per ``adapter_refit_s``, its id naming the period so that repeated requests add nothing.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import numpy as np
import structlog

from proxy.memory.adapter_pairs import PairRules, Remembered, Said, answered, drawn_on
from proxy.memory.adapter_training import Bank, FitSettings, Pairs, beats, fit, reciprocal_ranks, split
from proxy.memory.embedders.protocol import Embedder
from proxy.memory.query_adapter import QueryAdapter
from proxy.memory.store.memory_store import MemoryStore
from proxy.memory.store.records import Kind, MemoryRecord
from proxy.memory.write.job_kinds import ADAPTER_JOB
from proxy.memory.write.queue import Job, JobQueue

log = structlog.get_logger("memproxy.adapter")

_BANK_KINDS = (Kind.FACT, Kind.TURN, Kind.SUMMARY)
MAX_BANK = 20_000  # the newest memories a fit looks at (their vectors and the pairs' scores stay in RAM)


@dataclass(frozen=True)
class Outcome:
    """What one refit did: ``shipped`` (stored), ``kept`` (the current one stays) or ``skipped`` (too few pairs)."""

    action: str
    pairs: int = 0
    held_out: float = 0.0
    current: float = 0.0
    baseline: float = 0.0


def training_set(records: Sequence[MemoryRecord], rules: PairRules) -> tuple[list[tuple[str, int]], Bank]:
    """The (message text, bank index) pairs of a user's records, and their bank (see the module docstring)."""
    usable = [r for r in records if r.kind in _BANK_KINDS and r.valid and not r.flagged and r.embedding is not None]
    bank = sorted(usable, key=lambda r: r.created_at)[-MAX_BANK:]
    where = {r.id: i for i, r in enumerate(bank)}
    turns = [r for r in bank if r.kind is Kind.TURN]
    said = [Said(t.text, t.role or "", t.conversation_id or "", t.created_at) for t in turns]
    memories = [Remembered(r.text, r.conversation_id, r.created_at) for r in bank]
    found = {(m, where[turns[a].id]) for m, a in answered(said)}
    found |= {(m, g) for m, g in drawn_on(said, memories, rules)}
    pairs = [(said[m].text, g) for m, g in sorted(found)]
    return pairs, _bank(bank, [r for r in records if r.kind is Kind.SUBJECT and r.valid and r.embedding is not None])


def _bank(memories: Sequence[MemoryRecord], subjects: Sequence[MemoryRecord]) -> Bank:
    """The memories' vectors, their subjects' vectors and which subjects each memory is linked to."""
    where = {r.id: i for i, r in enumerate(memories)}
    linked: list[list[int]] = [[] for _ in memories]
    for s, subject in enumerate(subjects):
        for fact_id in subject.source_ids:
            if fact_id in where:
                linked[where[fact_id]].append(s)
    vectors = np.asarray([r.embedding for r in memories], dtype=np.float32)
    dim = vectors.shape[1] if len(memories) else 1
    subject_vectors = np.asarray([r.embedding for r in subjects], dtype=np.float32).reshape(len(subjects), dim)
    return Bank(vectors, subject_vectors, linked)


class AdapterJobs:
    """The handler of ``adapter`` jobs, and the trigger that enqueues them."""

    def __init__(
        self,
        store: MemoryStore,
        embedder: Embedder,
        queue: JobQueue,
        *,
        refit_s: float,
        min_pairs: int,
        on_shipped: Callable[[str], None] = lambda user_id: None,
    ) -> None:
        self._store, self._embedder, self._queue = store, embedder, queue
        self._refit_s, self._min_pairs = refit_s, min_pairs
        self._on_shipped = on_shipped
        self.rules = PairRules(sides=("user",))

    def handlers(self) -> dict[str, Callable[[Job], Any]]:
        """The job kinds this handles."""
        return {ADAPTER_JOB: self.handle}

    async def request(self, user_id: str) -> str:
        """Enqueue the user's refit of this period (nothing if it is already queued or done); its job id."""
        period = int(time.time() // self._refit_s)
        key = hashlib.blake2b(user_id.encode(), digest_size=12).hexdigest()
        job_id = f"adapter-{key}-{period}"
        return await self._queue.enqueue(ADAPTER_JOB, user_id, {}, job_id=job_id, durable=False)

    async def handle(self, job: Job) -> None:
        """Refit the user's adapter."""
        outcome = await self.refit(job.user_id)
        log.info("memory.adapter", **vars(outcome))

    async def refit(self, user_id: str) -> Outcome:
        """Fit a new adapter on the user's pairs; store it when it beats no adapter and the current one."""
        records = [r async for r in self._store.records_with_vectors(user_id)]
        texts, bank = training_set(records, self.rules)
        if len(texts) < self._min_pairs:
            return Outcome("skipped", len(texts))
        queries = np.stack([await self._embedder.embed_query(text) for text, _ in texts]).astype(np.float32)
        pairs = Pairs(queries, np.array([g for _, g in texts], dtype=np.int64), _groups(texts))
        model_id = self._embedder.model_id
        settings = FitSettings()
        found = await asyncio.to_thread(fit, pairs, bank, model_id, settings)
        current = await self._current(user_id, model_id)
        held = split(pairs, settings)[2]
        current_score = found.baseline
        if current is not None:
            new, old = (reciprocal_ranks(a.apply(held.queries), held, bank) for a in (found.adapter, current))
            current_score = float(old.mean())
            if not beats(new, old, settings.ship_z):
                return Outcome("kept", len(texts), found.held_out, current_score, found.baseline)
        if not found.confident:
            return Outcome("kept", len(texts), found.held_out, current_score, found.baseline)
        now = datetime.now(UTC)
        adapter = QueryAdapter(**{**vars(found.adapter), "fitted_at": now.isoformat()})
        await self._store.adapters.put(user_id, model_id, now, adapter.to_bytes())
        self._on_shipped(user_id)
        return Outcome("shipped", len(texts), found.held_out, current_score, found.baseline)

    async def _current(self, user_id: str, model_id: str) -> QueryAdapter | None:
        stored = await self._store.adapters.get(user_id)
        if stored is None or stored[0] != model_id:
            return None
        return QueryAdapter.from_bytes(stored[1])


def _groups(texts: Sequence[tuple[str, int]]) -> np.ndarray[Any, np.dtype[np.int64]]:
    """One group per message text (its pairs are never each other's negatives), in order."""
    ids: dict[str, int] = {}
    return np.array([ids.setdefault(text, len(ids)) for text, _ in texts], dtype=np.int64)
