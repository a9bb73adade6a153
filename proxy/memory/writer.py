"""The write path's job handlers: turns, facts, summaries, and the insight trigger.

One finished chat becomes one durable ``exchange`` job (``Writer.record``). Its handlers, run by the
``JobRunner``:

- ``exchange``: stores the user message(s) and the assistant reply as turn records (one batched embedding, so
  the exchange is searchable as soon as possible), counts the turns towards the conversation's next summary
  (debounced ``summary`` job: after ``summary_idle_s`` of quiet, or at once past ``summary_max_new_turns``),
  and enqueues the ``facts`` job of the exchange.
- ``facts``: the memory-side model extracts facts, the screens of ``extraction`` drop what must not be
  stored, and each remaining fact is reconciled with the user's nearest valid facts (add, supersede,
  invalidate or skip as duplicate), and the subject records of the names it carries follow (``subjects``).
  Then a debounced ``insights`` job is enqueued (consumed by the insights module).
- ``summary``: summarises the conversation's turns not yet summarised into one rolling summary per
  conversation (the previous one is superseded, kept as history).

Facts run in their own lane, so a slow model never delays the next reply's turns. Every effect is idempotent
by job id: record ids are uuid5 of the job id and a position, steps are checkpointed in the job, and a replayed
job finds its records already there. A reply cut short by a client disconnect is stored, marked ``partial``
(the user saw that text; retrieval can weigh it down); facts still come only from the user's words.
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import numpy as np
import structlog
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from proxy.memory.embedders import Vectors
from proxy.memory.extraction import (
    ExchangeText,
    ExtractedFact,
    ExtractionFailed,
    ExtractionSettings,
    Extractor,
    Neighbour,
    Plan,
    Screened,
    screen_fact,
    screen_facts,
    shortcut_plan,
)
from proxy.memory.jobs import GiveUp, Handler, Job, JobQueue, RetryLater
from proxy.memory.llm import LLMUnavailable
from proxy.memory.records import Kind, MemoryRecord
from proxy.memory.screens import ScreenedText, redact_identifiers, remembered_identifiers, screen_text
from proxy.memory.service import Exchange
from proxy.memory.store import MemoryStore
from proxy.memory.subjects import SubjectLinker
from proxy.memory.tool_turns import tool_turn_texts

log = structlog.get_logger("memproxy.writer")

ID_NAMESPACE = uuid.UUID("6f1d3c2a-9b8e-4f7a-a1c5-3e2d9b0c4f61")
_MAX_PENDING_TURNS = 1000


class WriterSettings(BaseModel):
    """How the write path uses the memory-side model and when it summarises."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str | None = None  # None: the model (and so the route) of the chat that produced the exchange
    summary_idle_s: float = Field(default=1800.0, gt=0)
    summary_max_new_turns: int = Field(default=20, ge=1)
    summary_max_turns_per_call: int = Field(default=60, ge=2)
    insights_debounce_s: float = Field(default=900.0, ge=0)
    reconcile_neighbours: int = Field(default=5, ge=1, le=20)
    reconcile_min_similarity: float = Field(default=0.3, ge=-1.0, le=1.0)
    # a turn's vector: unit (1 - w) * its own + w * (previous turn + it); 0 embeds each turn alone. 0.5 lifted
    # LoCoMo evidence recall@10 from 0.718 to 0.730 (bench/locomo.py, "+context"), at twice the embedding work
    context_weight: float = Field(default=0.5, ge=0.0, le=1.0)


class ExchangePayload(BaseModel):
    """What an ``exchange`` job holds (never the system prompt, never a key)."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    conversation_id: str
    model: str
    user_messages: tuple[str, ...]
    reply: str
    partial: bool = False
    finished_at: float
    request_id: str | None = None
    context: tuple[tuple[str, str], ...] = ()
    tool_results: tuple[str, ...] = ()  # stored as turns of role "tool"; never a source of facts
    tool_calls: tuple[str, ...] = ()  # the reply's tool calls, stored as assistant turns


class FactsPayload(ExchangePayload):
    """What a ``facts`` job holds: the exchange and the ids of its user turns (the facts' sources)."""

    source_ids: tuple[str, ...] = ()


def derived_id(job_id: str, *parts: object) -> str:
    """A record id fixed by the job id and a position, so that replays never duplicate."""
    return uuid.uuid5(ID_NAMESPACE, "/".join([job_id, *map(str, parts)])).hex


def exchange_payload(exchange: Exchange, screens: ExtractionSettings | None = None) -> dict[str, Any]:
    """The job payload of a finished exchange (the system prompt is deliberately left out), its identifiers
    redacted before it reaches the queue's disk unless the user asked to remember (see ``screens.py``)."""
    payload = ExchangePayload(
        conversation_id=exchange.conversation_id,
        model=exchange.model,
        user_messages=tuple(exchange.user_messages),
        reply=exchange.assistant_text,
        partial=exchange.partial,
        finished_at=exchange.finished_at.timestamp(),
        request_id=exchange.request_id,
        context=tuple(exchange.context),
        tool_results=exchange.tool_results,
        tool_calls=exchange.tool_calls,
    )
    return redacted_payload(payload, screens or ExtractionSettings()).model_dump(mode="json")


def redacted_payload(p: ExchangePayload, screens: ExtractionSettings) -> ExchangePayload:
    """``p`` with identifiers redacted in every text, except those the user asked to remember."""
    keep = remembered_identifiers(p.user_messages, screens.extra_sensitive_patterns)

    def redact(text: str) -> str:
        return redact_identifiers(text, screens.extra_sensitive_patterns, keep)[0]

    return p.model_copy(update={
        "user_messages": tuple(redact(t) for t in p.user_messages), "reply": redact(p.reply),
        "context": tuple((role, redact(t)) for role, t in p.context),
        "tool_results": tuple(redact(t) for t in p.tool_results),
        "tool_calls": tuple(redact(t) for t in p.tool_calls),
    })  # fmt: skip


def screened_turn(text: str, p: ExchangePayload, screens: ExtractionSettings) -> ScreenedText:
    """One turn's text as stored: identifiers redacted (but those asked to remember), instructions flagged."""
    keep = remembered_identifiers(p.user_messages, screens.extra_sensitive_patterns)
    return screen_text(text, keep=keep, extra_identifiers=screens.extra_sensitive_patterns,
                       extra_instructions=screens.extra_injection_patterns)  # fmt: skip


def turn_records(
    job_id: str, user_id: str, p: ExchangePayload, screens: ExtractionSettings | None = None
) -> list[MemoryRecord]:
    """The turn records of an exchange: user messages just before the reply, the reply marked if partial;
    each text screened (``screened_turn``)."""
    end = datetime.fromtimestamp(p.finished_at, UTC)
    meta = json.dumps({"job_id": job_id, "model": p.model})
    texts = [("user", text, False) for text in p.user_messages if text.strip()]
    texts += tool_turn_texts(p.tool_results, p.reply, p.partial, p.tool_calls)
    screened = [screened_turn(text, p, screens or ExtractionSettings()) for _, text, _ in texts]
    return [
        MemoryRecord(
            user_id=user_id,
            kind=Kind.TURN,
            text=seen.text,
            id=derived_id(job_id, "turn", i),
            created_at=end - timedelta(microseconds=len(texts) - 1 - i),
            conversation_id=p.conversation_id,
            role=role,
            partial=partial,
            sensitive=seen.sensitive is not None,
            meta=meta,
            flagged=seen.flagged,
        )
        for i, ((role, _, partial), seen) in enumerate(zip(texts, screened, strict=True))
    ]


def context_vector(own: Vectors, with_previous: Vectors, weight: float) -> Vectors:
    """Unit ``(1 - weight) * own + weight * with_previous`` (row-wise for matrices): a turn's vector that also
    carries the turn it answers, so that a question about either finds it."""
    mixed = ((1.0 - weight) * own + weight * with_previous).astype(np.float32)
    norms = np.linalg.norm(mixed, axis=-1, keepdims=True)
    return mixed / np.where(norms == 0.0, 1.0, norms)


def fact_record(job_id: str, i: int, user_id: str, p: FactsPayload, screened: Screened, text: str) -> MemoryRecord:
    """The fact record for the ``i``-th screened fact of a job."""
    fact = screened.fact
    return MemoryRecord(
        user_id=user_id, kind=Kind.FACT, text=text, id=derived_id(job_id, "fact", i),
        conversation_id=p.conversation_id, category=fact.category, importance=fact.importance,
        entities=fact.entities, sensitive=fact.sensitive or fact.sensitive_category != "none",
        source_ids=p.source_ids, meta=json.dumps({"job_id": job_id, "explicit": screened.explicit}),
    )  # fmt: skip


def _add_pending(job_id: str, turn_ids: Sequence[str]) -> Any:
    def update(state: dict[str, Any] | None) -> dict[str, Any]:
        state = state or {"pending": [], "jobs": [], "summary_id": None}
        if job_id not in state["jobs"]:
            state["pending"] = [*state["pending"], *turn_ids][-_MAX_PENDING_TURNS:]
            state["jobs"] = [*state["jobs"], job_id][-50:]
        return state

    return update


def _summarised(turn_ids: Sequence[str], summary_id: str) -> Any:
    def update(state: dict[str, Any] | None) -> dict[str, Any]:
        state = state or {"pending": [], "jobs": []}
        done = set(turn_ids)
        return {**state, "pending": [t for t in state["pending"] if t not in done], "summary_id": summary_id}

    return update


class Writer:
    """The handlers of the write path's jobs, over one store, one queue and one extractor."""

    def __init__(self, settings: WriterSettings, store: MemoryStore, queue: JobQueue, extractor: Extractor) -> None:
        self.settings = settings
        self._store = store
        self._queue = queue
        self._extractor = extractor
        self._subjects = SubjectLinker(store)  # subject records follow the facts (see ``subjects``)

    def handlers(self) -> dict[str, Handler]:
        """The job kinds this writer handles, for the ``JobRunner``."""
        return {"exchange": self.handle_exchange, "facts": self.handle_facts, "summary": self.handle_summary}

    async def record(self, exchange: Exchange) -> str:
        """Durably enqueue a finished exchange; returns the job id once the commit is on disk."""
        payload = exchange_payload(exchange, self._extractor.settings)
        return await self._queue.enqueue("exchange", exchange.user_id, payload)

    def _model(self, p: ExchangePayload) -> str:
        return self.settings.model or p.model

    # --------------------------------------------------------------------------------------- exchange

    async def handle_exchange(self, job: Job) -> None:
        """Store the turns, schedule the summary, and enqueue the facts job."""
        p = _parse(ExchangePayload, job.payload)
        turns = turn_records(job.id, job.user_id, p, self._extractor.settings)
        if "turns" not in job.progress:
            async with job.timed("turns"):
                await self._store.add(await self._with_context(turns, p.context))
            job.queue.observe_step("reply_to_searchable", max(0.0, time.time() - p.finished_at))
            await job.checkpoint("turns")
        if turns:
            await self._schedule_summary(job, p, [t.id for t in turns])
        user_turns = tuple(t.id for t in turns if t.role == "user")
        if user_turns:  # facts come only from what the user wrote
            facts = FactsPayload(**p.model_dump(), source_ids=user_turns).model_dump(mode="json")
            await self._queue.enqueue("facts", job.user_id, facts, job_id=f"{job.id}:facts")

    async def _with_context(
        self, turns: list[MemoryRecord], context: Sequence[tuple[str, str]]
    ) -> list[MemoryRecord]:
        """The turns with context vectors (one batched embedding of each text alone and after its previous turn)."""
        weight = self.settings.context_weight
        if weight <= 0 or not turns:
            return turns
        previous = [context[-1][1] if context else None, *(t.text for t in turns[:-1])]
        texts = [t.text for t in turns] + [f"{prev}\n{t.text}" for prev, t in zip(previous, turns, strict=True) if prev]
        embedder = self._store.embedder
        vectors = await embedder.embed_documents(texts)
        own, with_previous = vectors[: len(turns)], iter(vectors[len(turns) :])
        out = []
        for turn, prev, vector in zip(turns, previous, own, strict=True):
            if prev:
                vector = context_vector(vector, next(with_previous), weight)
            out.append(turn.replace(embedding=[float(x) for x in vector], model_id=embedder.model_id))
        return out

    async def _schedule_summary(self, job: Job, p: ExchangePayload, turn_ids: Sequence[str]) -> None:
        key = f"summary:{p.conversation_id}"
        state = await self._queue.update_state(job.user_id, key, _add_pending(job.id, turn_ids))
        pending = len(state["pending"]) if state else 0
        due_now = pending >= self.settings.summary_max_new_turns
        run_after = time.time() + (0.0 if due_now else self.settings.summary_idle_s)
        payload = {"conversation_id": p.conversation_id, "model": p.model, "request_id": p.request_id}
        await self._queue.enqueue("summary", job.user_id, payload, dedupe_key=key, run_after=run_after)

    # ------------------------------------------------------------------------------------------ facts

    async def handle_facts(self, job: Job) -> None:
        """Extract, screen and reconcile the exchange's facts; then trigger insights."""
        p = _parse(FactsPayload, job.payload)
        screened = await self._screened_facts(job, p)
        for i, fact in enumerate(screened):
            if f"fact:{i}" not in job.progress:
                async with job.timed("reconcile"):
                    await self._reconcile(job, p, i, fact)
                await job.checkpoint(f"fact:{i}")
        now = time.time()
        payload = {"reason": "exchange", "model": self._model(p), "request_id": p.request_id}
        await self._queue.enqueue(
            "insights", job.user_id, payload, dedupe_key="insights", run_after=now + self.settings.insights_debounce_s
        )

    async def _screened_facts(self, job: Job, p: FactsPayload) -> list[Screened]:
        if "extracted" in job.progress:
            return [_screened_from_json(item) for item in job.progress["extracted"]]
        exchange = ExchangeText(p.user_messages, p.reply, p.context)
        async with job.timed("extract"):
            found = await self._extract(p, exchange)
        kept, reasons = screen_facts(found, exchange, self._extractor.settings)
        for reason in reasons:
            log.info("memory.rejected", reason=reason)
        await job.checkpoint("extracted", [_screened_to_json(s) for s in kept])
        return kept

    async def _extract(self, p: FactsPayload, exchange: ExchangeText) -> list[ExtractedFact]:
        try:
            return await self._extractor.extract(self._model(p), exchange)
        except LLMUnavailable as error:
            raise RetryLater(f"memory LLM unavailable: {error}") from None
        except ExtractionFailed as error:
            log.warning("memory.step_failed", step="extract", reason=str(error))
            return []

    async def _reconcile(self, job: Job, p: FactsPayload, i: int, screened: Screened) -> None:
        record = fact_record(job.id, i, job.user_id, p, screened, screened.fact.text)
        decided = job.progress.get(f"plan:{i}")
        if decided is not None:  # an earlier attempt decided and began applying: apply the same plan again
            await self._apply(job.user_id, Plan(**decided["plan"]), record.replace(text=decided["text"]))
            return
        vector = (await self._store.embedder.embed_documents([record.text]))[0]
        neighbours = await self._neighbours(job.user_id, vector)
        plan = await self._plan(p, record.text, neighbours)
        if plan is None:
            return
        if plan.action == "supersede" and plan.text != record.text:
            merged = await self._rescreen(record, plan.text, screened, p)
            if merged is None:
                return
            record = merged
        elif plan.action in ("add", "supersede"):
            record = record.replace(embedding=[float(x) for x in vector], model_id=self._store.embedder.model_id)
        await job.checkpoint(f"plan:{i}", {"plan": dataclasses.asdict(plan), "text": record.text})
        await self._apply(job.user_id, plan, record)

    async def _neighbours(self, user_id: str, vector: Any) -> list[Neighbour]:
        hits = await self._store.vector_search(user_id, vector, self.settings.reconcile_neighbours, kinds=[Kind.FACT])
        return [Neighbour(hit.record.id, hit.record.text, hit.score) for hit in hits]

    async def _plan(self, p: FactsPayload, text: str, neighbours: Sequence[Neighbour]) -> Plan | None:
        shortcut = shortcut_plan(text, neighbours, self.settings.reconcile_min_similarity)
        if shortcut is not None:
            return shortcut
        close = [n for n in neighbours if n.score >= self.settings.reconcile_min_similarity]
        try:
            return await self._extractor.decide(self._model(p), text, close)
        except LLMUnavailable as error:
            raise RetryLater(f"memory LLM unavailable: {error}") from None
        except ExtractionFailed as error:
            log.warning("memory.step_failed", step="reconcile", reason=str(error))
            return None

    async def _rescreen(
        self, record: MemoryRecord, text: str, screened: Screened, p: FactsPayload
    ) -> MemoryRecord | None:
        """The merged text of an UPDATE passes the same screens as the extracted fact."""
        merged = screened.fact.model_copy(update={"text": text, "explicit_request": screened.explicit})
        outcome = screen_fact(merged, ExchangeText(p.user_messages, p.reply, p.context), self._extractor.settings)
        if isinstance(outcome, str):
            log.info("memory.rejected", reason=outcome, step="reconcile")
            return None
        return record.replace(text=outcome.fact.text)

    async def _apply(self, user_id: str, plan: Plan, record: MemoryRecord) -> None:
        # Subjects are linked before the fact is stored: once a fact can be found, so can its subjects.
        if plan.action == "add":
            await self._subjects.link(record)
            await self._store.add([record])
        elif plan.action == "supersede" and plan.target_id is not None:
            await self._subjects.link(record)
            await self._store.supersede(user_id, plan.target_id, record)
            await self._subjects.unlink(user_id, plan.target_id)
        elif plan.action == "invalidate" and plan.target_id is not None:
            await self._store.update(user_id, plan.target_id, valid=False)
            await self._subjects.unlink(user_id, plan.target_id)
        log.info("memory.fact", action=plan.action, fact_id=record.id, target_id=plan.target_id)

    # ---------------------------------------------------------------------------------------- summary

    async def handle_summary(self, job: Job) -> None:
        """Summarise the conversation's turns not yet summarised into its rolling summary."""
        conversation_id = str(job.payload["conversation_id"])
        key = f"summary:{conversation_id}"
        state = await self._queue.get_state(job.user_id, key) or {}
        pending = list(state.get("pending", []))[: self.settings.summary_max_turns_per_call]
        if not pending:
            return
        summary_id = derived_id(job.id, "summary")
        if "summary_written" not in job.progress or await self._store.get(job.user_id, summary_id) is None:
            async with job.timed("summary"):
                done = await self._summarise(job, conversation_id, pending, state.get("summary_id"), summary_id)
            if not done:
                return
        after = await self._queue.update_state(job.user_id, key, _summarised(pending, summary_id))
        if after and len(after["pending"]) >= self.settings.summary_max_new_turns:
            await self._queue.enqueue("summary", job.user_id, job.payload, dedupe_key=key)

    async def _summarise(
        self, job: Job, conversation_id: str, pending: Sequence[str], previous_id: str | None, summary_id: str
    ) -> bool:
        turns = sorted(await self._store.get_many(job.user_id, pending), key=lambda t: (t.created_at, t.id))
        previous = await self._store.get(job.user_id, previous_id) if previous_id else None
        if not turns:
            return True
        model = self.settings.model or str(job.payload.get("model", ""))
        try:
            out = await self._extractor.summarise(
                model, previous.text if previous else None, [(t.role or "user", t.text) for t in turns]
            )
        except LLMUnavailable as error:
            raise RetryLater(f"memory LLM unavailable: {error}") from None
        except ExtractionFailed as error:
            log.warning("memory.step_failed", step="summary", reason=str(error))
            return False
        screens = self._extractor.settings
        summary = screen_text(out.summary, extra_identifiers=screens.extra_sensitive_patterns,
                              extra_instructions=screens.extra_injection_patterns)  # fmt: skip
        record = MemoryRecord(
            user_id=job.user_id, kind=Kind.SUMMARY, text=summary.text, id=summary_id, flagged=summary.flagged,
            conversation_id=conversation_id, source_ids=tuple(t.id for t in turns),
            entities=tuple(redact_identifiers(topic, screens.extra_sensitive_patterns)[0] for topic in out.topics[:5]),
            start_at=previous.start_at if previous and previous.start_at else turns[0].created_at,
            end_at=turns[-1].created_at, meta=json.dumps({"job_id": job.id}),
        )  # fmt: skip
        await job.checkpoint("summary_written")  # from here a replay checks the store for the record
        if previous is not None and previous.valid:
            await self._store.supersede(job.user_id, previous.id, record)
        else:
            await self._store.add([record])
        return True


def _parse(model: type[ExchangePayload], payload: Mapping[str, Any]) -> Any:
    try:
        return model.model_validate(payload)
    except ValidationError as error:
        raise GiveUp(f"invalid job payload: {error.errors()[0]['loc']}: {error.errors()[0]['msg']}") from None


def _screened_to_json(screened: Screened) -> dict[str, Any]:
    return {**screened.fact.model_dump(mode="json"), "explicit": screened.explicit}


def _screened_from_json(item: Mapping[str, Any]) -> Screened:
    fact = ExtractedFact.model_validate({k: v for k, v in item.items() if k != "explicit"})
    return Screened(fact, bool(item["explicit"]))
