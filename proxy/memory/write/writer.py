"""The write path's job handlers: one finished chat becomes turns, facts, summaries and an insights trigger.

One finished chat becomes one durable ``exchange`` job (``Writer.record``, payload in ``payloads``). Its
handlers, run by the ``JobRunner``:

- ``exchange`` (here): stores the user message(s) and the assistant reply as turn records (``turns``: one
  batched embedding, so the exchange is searchable as soon as possible), counts the turns towards the
  conversation's next summary (``summaries``), and adds the exchange to the user's facts window
  (``facts_window``), which enqueues the debounced ``facts`` job.
- ``facts`` (``facts``): the memory-side model extracts facts, the screens of ``fact_screens`` drop what must
  not be stored, and each remaining fact is reconciled with the user's nearest valid facts (add, supersede,
  invalidate or skip as duplicate), and the subject records of the names it carries follow (``subjects``).
  Then a debounced ``insights`` job is enqueued (consumed by the insights package).
- ``summary`` (``summaries``): summarises the conversation's turns not yet summarised into one rolling summary
  per conversation (the previous one is superseded, kept as history).

Facts run in their own lane, so a slow model never delays the next reply's turns. Every effect is idempotent
by job id: record ids are uuid5 of the job id and a position, steps are checkpointed in the job, and a replayed
job finds its records already there. A reply cut short by a client disconnect is stored, marked ``partial``
(the user saw that text; retrieval can weigh it down); facts still come only from the user's words.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import structlog

from proxy.memory.embedders.base import BaseEmbedder, QueryCache
from proxy.memory.embedders.protocol import Vectors
from proxy.memory.events import MemoryEvents
from proxy.memory.service import Exchange
from proxy.memory.store.memory_store import MemoryStore
from proxy.memory.store.records import MemoryRecord
from proxy.memory.text_cap import query_texts
from proxy.memory.write.extraction import ExtractionSettings, Extractor
from proxy.memory.write.facts import FactJobs
from proxy.memory.write.job_kinds import EXCHANGE_JOB, FACTS_JOB, SUMMARY_JOB
from proxy.memory.write.payloads import ExchangePayload, exchange_payload, parse_payload
from proxy.memory.write.prefilter import any_worth_extracting
from proxy.memory.write.queue import Handler, Job, JobQueue
from proxy.memory.write.settings import WriterSettings
from proxy.memory.write.summaries import SummaryJobs
from proxy.memory.write.turns import exchange_context_vectors, turn_records

log = structlog.get_logger("memproxy.writer")
CAUGHT_UP_S = 10.0  # no exchange late for the document model this long: the writer has caught up


async def enqueue_exchange(queue: JobQueue, exchange: Exchange, screens: ExtractionSettings) -> str:
    """Durably enqueue a finished exchange (its payload screened by ``screens``); returns the job id once the
    commit is on disk."""
    return await queue.enqueue(EXCHANGE_JOB, exchange.user_id, exchange_payload(exchange, screens))


class Writer:
    """The handlers of the write path's jobs, over one store, one queue and one extractor."""

    def __init__(
        self,
        settings: WriterSettings,
        store: MemoryStore,
        queue: JobQueue,
        extractor: Extractor,
        query_vectors: QueryCache | None = None,
        events: MemoryEvents | None = None,
    ) -> None:
        self.settings = settings
        self._store = store
        # The embedder's vector cache when queries and documents share the model: a user turn's vector is then
        # the one its request's read path embedded, pinned from the commit until the job embeds its turns.
        self._query_vectors = query_vectors
        self._queue = queue
        self._extractor = extractor
        self._facts = FactJobs(settings, store, queue, extractor, events)
        self._summaries = SummaryJobs(settings, store, queue, extractor)
        self._behind_since: float | None = None  # exchanges have been late for the document model since then
        self._last_late = 0.0

    def handlers(self) -> dict[str, Handler]:
        """The job kinds this writer handles, for the ``JobRunner``."""
        return {EXCHANGE_JOB: self.handle_exchange, FACTS_JOB: self.handle_facts, SUMMARY_JOB: self.handle_summary}

    async def record(self, exchange: Exchange) -> str:
        """Durably enqueue a finished exchange; returns the job id once the commit is on disk."""
        self.pin_query_vectors(exchange.user_messages)
        return await enqueue_exchange(self._queue, exchange, self._extractor.settings)

    def pin_query_vectors(self, user_messages: Sequence[str]) -> None:
        """Keep the read path's vectors of these messages for the exchange job (whichever path enqueues it)."""
        if self._query_vectors is not None:
            for text in query_texts(user_messages):
                self._query_vectors.pin(text)

    def _unpin_query_vectors(self, user_messages: Sequence[str]) -> None:
        if self._query_vectors is not None:
            for text in query_texts(user_messages):
                self._query_vectors.unpin(text)

    async def handle_exchange(self, job: Job) -> None:
        """Store the turns, schedule the summary, and add the exchange to the user's facts window."""
        p = parse_payload(ExchangePayload, job.payload)
        turns = turn_records(job.id, job.user_id, p, self._extractor.settings)
        if "turns" not in job.progress:
            try:
                async with job.timed("turns"):  # split in two: the wait for the model, then the store's commit
                    async with job.timed("turn_vectors"):
                        turns = await self._with_context(turns, p.context, time.time() - p.finished_at)
                    async with job.timed("turn_commit"):
                        await self._store.add(turns)
            finally:
                self._unpin_query_vectors(p.user_messages)
            job.queue.observe_step("reply_to_searchable", max(0.0, time.time() - p.finished_at))
            await job.checkpoint("turns")
        if turns:
            await self._summaries.schedule(job, p, [t.id for t in turns])
        user_turns = tuple(t.id for t in turns if t.role == "user")
        if user_turns and self._worth_extracting(p):  # facts come only from what the user wrote
            await self._facts.add_exchange(job, p, user_turns)

    def _worth_extracting(self, p: ExchangePayload) -> bool:
        return not self.settings.prefilter or any_worth_extracting(p.user_messages, self.settings.prefilter_min_words)

    async def _vectors(self, texts: list[str], waited_s: float) -> Vectors:
        """The texts' vectors by the document model, or by the embedder's cheap query side (``quick_documents``)
        when the model would not have them within ``quick_vectors_after_s`` of the reply (by its backlog and
        recent pace before it starts, or by a deadline while it runs: its threads share the cores with the chat
        processes)."""
        embedder = self._store.embedder
        after = self.settings.quick_vectors_after_s
        if after <= 0 or not isinstance(embedder, BaseEmbedder) or not embedder.embeds_quickly:
            return await embedder.embed_documents(texts)
        vectors: Vectors | None = None
        budget = after - waited_s
        if budget > 0 and embedder.documents_due_s(len(texts)) < budget:  # the model can make it: try it
            try:
                vectors = await asyncio.wait_for(embedder.embed_documents(texts), budget)
            except TimeoutError:
                vectors = None
        self._note_behind(vectors is None, waited_s)
        if vectors is None:
            vectors = embedder.quick_documents(texts)
        return vectors if vectors is not None else await embedder.embed_documents(texts)

    def _note_behind(self, behind: bool, waited_s: float) -> None:
        """One log line as the writer falls behind, and one once no exchange was late for ``CAUGHT_UP_S``."""
        now = time.monotonic()
        if behind:
            if self._behind_since is None:
                log.info("memory.writer_behind", waited_s=round(waited_s, 2))
                self._behind_since = now
            self._last_late = now
        elif self._behind_since is not None and now - self._last_late >= CAUGHT_UP_S:
            log.info("memory.writer_caught_up", behind_s=round(self._last_late - self._behind_since, 1))
            self._behind_since = None

    async def _with_context(
        self, turns: list[MemoryRecord], context: Sequence[tuple[str, str]], waited_s: float = 0.0
    ) -> list[MemoryRecord]:
        """The turns with their vectors (``_vectors``): context vectors from one embedding of each turn and of the
        turn before the exchange (``context_weight`` 0: each turn's own)."""
        if not turns:
            return turns
        weight = self.settings.context_weight
        before = [context[-1][1]] if weight > 0 and context and context[-1][1] else []
        vectors = await self._vectors([*before, *(t.text for t in turns)], waited_s)
        mixed = exchange_context_vectors(vectors[len(before) :], vectors[0] if before else None, weight)
        model_id = self._store.embedder.model_id
        return [
            t.replace(embedding=[float(x) for x in v], model_id=model_id) for t, v in zip(turns, mixed, strict=True)
        ]

    async def handle_facts(self, job: Job) -> None:
        """Extract, screen and reconcile the facts of the user's window of exchanges; then trigger insights."""
        await self._facts.handle(job)

    async def handle_summary(self, job: Job) -> None:
        """Summarise the conversation's turns not yet summarised into its rolling summary."""
        await self._summaries.handle(job)
