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
    WindowFact,
    normalise,
    screen_fact,
    screen_facts,
    shortcut_plan,
)
from proxy.memory.jobs import GiveUp, Handler, Job, JobQueue, RetryLater
from proxy.memory.llm import LLMUnavailable
from proxy.memory.prefilter import DEFAULT_MIN_WORDS, any_worth_extracting, asks_to_remember
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
    summary_max_new_turns: int = Field(default=40, ge=1)
    summary_max_turns_per_call: int = Field(default=60, ge=2)
    insights_debounce_s: float = Field(default=900.0, ge=0)
    reconcile_neighbours: int = Field(default=3, ge=1, le=20)
    # MiniLM: an update of a fact scores >= 0.6 against it ("lives in London" / "moved to Paris" 0.60), unrelated
    # facts of one user ~0.27 ("likes jazz" / "has a dog"); LoCoMo's facts of one speaker: 98% >= 0.5
    reconcile_min_similarity: float = Field(default=0.5, ge=-1.0, le=1.0)
    # a turn's vector: unit (1 - w) * its own + w * unit(its own + the previous turn's own) (``context_vector``);
    # 0 stores each turn's own vector. 0.5: LoCoMo default R@10 0.730 against 0.716 for turns alone
    # (bench/locomo.py, "+turns"), for one more embedding per exchange (the turn before it)
    context_weight: float = Field(default=0.5, ge=0.0, le=1.0)
    # a conversation is (re-)summarised only once this many of its turns are not in its summary yet (a one-message
    # chat needs none; a short tail stays as turns, which are searchable themselves)
    summary_min_turns: int = Field(default=8, ge=1)
    # facts are extracted over a window of a user's exchanges: one call once this many wait...
    facts_window_exchanges: int = Field(default=10, ge=1)
    # ...or this long after the first of them (turns are searchable at once; facts wait at most this long). A chat
    # sends a message every 10-60 s: 5 s makes windows of one exchange, i.e. a call per message
    facts_window_wait_s: float = Field(default=20.0, ge=0.0)
    # characters of each assistant reply shown to extraction (context only)
    facts_reply_chars: int = Field(default=120, ge=0)
    # exchanges whose user messages pass no cheap local check (proxy/memory/prefilter.py) skip extraction
    prefilter: bool = True
    prefilter_min_words: int = Field(default=DEFAULT_MIN_WORDS, ge=1)


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


def context_vector(own: Vectors, previous: Vectors, weight: float) -> Vectors:
    """A turn's vector that also carries the turn it answers, so that a question about either finds it.

    Unit ``(1 - weight) * own + weight * unit(own + previous)``, row-wise for matrices, where ``previous`` is the
    previous turn's own vector (a zero row: none). The pair's direction is the sum of the two turns' vectors
    rather than an embedding of the two texts together: one embedding per turn instead of two (the pair's text is
    also twice as long), at the same recall (LoCoMo default R@10 0.730 vs 0.728, MRR 0.503 vs 0.507).
    """
    return _unit((1.0 - weight) * own + weight * _unit(own + previous))


def _unit(rows: Vectors) -> Vectors:
    norms = np.linalg.norm(rows, axis=-1, keepdims=True)
    return (rows / np.where(norms == 0.0, 1.0, norms)).astype(np.float32)


def fact_record(job_id: str, i: int, user_id: str, found: Found, text: str) -> MemoryRecord:
    """The fact record for the ``i``-th screened fact of a job."""
    fact = found.screened.fact
    return MemoryRecord(
        user_id=user_id, kind=Kind.FACT, text=text, id=derived_id(job_id, "fact", i),
        conversation_id=found.conversation_id, category=fact.category, importance=fact.importance,
        entities=fact.entities, sensitive=fact.sensitive or fact.sensitive_category != "none",
        source_ids=found.source_ids, meta=json.dumps({"job_id": job_id, "explicit": found.screened.explicit}),
    )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Found:
    """A screened fact of a window with where it came from (the user turns of its exchange)."""

    screened: Screened
    conversation_id: str
    source_ids: tuple[str, ...]


WINDOW_KEY = "facts:window"


def window_item(job_id: str, p: ExchangePayload, source_ids: Sequence[str], reply_chars: int) -> dict[str, Any]:
    """What the facts window keeps of one exchange (the reply cut to what extraction is shown)."""
    return {
        "job": job_id, "conversation_id": p.conversation_id, "model": p.model, "request_id": p.request_id,
        "user_messages": list(p.user_messages), "reply": p.reply[:reply_chars], "added_at": time.time(),
        "source_ids": list(source_ids), "remember": asks_to_remember(p.user_messages),
    }  # fmt: skip


def _add_to_window(item: dict[str, Any]) -> Any:
    def update(state: dict[str, Any] | None) -> dict[str, Any]:
        state = state or {"items": [], "jobs": []}
        if item["job"] not in state["jobs"]:
            state["items"] = [*state["items"], item][-_MAX_PENDING_TURNS:]
            state["jobs"] = [*state["jobs"], item["job"]][-200:]
        return state

    return update


def _take_window(job_id: str, size: int) -> Any:
    """Mark the oldest ``size`` exchanges no job has taken as taken by ``job_id`` (a retry finds its own)."""

    def update(state: dict[str, Any] | None) -> dict[str, Any]:
        state = state or {"items": [], "jobs": []}
        free = size - sum(1 for item in state["items"] if item.get("taken_by") == job_id)
        items = []
        for item in state["items"]:
            if free > 0 and not item.get("taken_by"):
                item, free = {**item, "taken_by": job_id}, free - 1
            items.append(item)
        return {**state, "items": items}

    return update


def _done_with_window(job_id: str) -> Any:
    def update(state: dict[str, Any] | None) -> dict[str, Any]:
        state = state or {"items": [], "jobs": []}
        return {**state, "items": [item for item in state["items"] if item.get("taken_by") != job_id]}

    return update


def untaken(state: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    """The window's exchanges that no facts job has taken yet."""
    return [item for item in (state or {}).get("items", []) if not item.get("taken_by")]


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
        """Store the turns, schedule the summary, and add the exchange to the user's facts window."""
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
        if user_turns and self._worth_extracting(p):  # facts come only from what the user wrote
            await self._add_to_window(job, p, user_turns)

    def _worth_extracting(self, p: ExchangePayload) -> bool:
        return not self.settings.prefilter or any_worth_extracting(p.user_messages, self.settings.prefilter_min_words)

    async def _add_to_window(self, job: Job, p: ExchangePayload, source_ids: Sequence[str]) -> None:
        """Queue the exchange for extraction: due when the window is full, holds a "remember ...", or
        ``facts_window_wait_s`` after its first."""
        item = window_item(job.id, p, source_ids, self.settings.facts_reply_chars)
        state = await self._queue.update_state(job.user_id, WINDOW_KEY, _add_to_window(item))
        await self._enqueue_window(job.user_id, state, p.model, p.request_id)

    async def _enqueue_window(self, user_id: str, state: Mapping[str, Any] | None, model: str, request_id: Any) -> None:
        waiting = untaken(state)
        if not waiting:
            return
        full = len(waiting) >= self.settings.facts_window_exchanges or any(i.get("remember") for i in waiting)
        first_at = min(float(item.get("added_at", 0.0)) for item in waiting)
        run_after = time.time() if full else first_at + self.settings.facts_window_wait_s
        payload = {"model": model, "request_id": request_id}
        await self._queue.enqueue("facts", user_id, payload, dedupe_key=WINDOW_KEY, run_after=run_after, durable=False)

    async def _with_context(
        self, turns: list[MemoryRecord], context: Sequence[tuple[str, str]]
    ) -> list[MemoryRecord]:
        """The turns with context vectors: one embedding of each turn, and of the turn before the exchange."""
        weight = self.settings.context_weight
        if weight <= 0 or not turns:
            return turns
        before = [context[-1][1]] if context and context[-1][1] else []
        embedder = self._store.embedder
        vectors = await embedder.embed_documents([*before, *(t.text for t in turns)])
        own = vectors[len(before) :]
        previous = np.vstack([vectors[:1] if before else np.zeros_like(own[:1]), own[:-1]])
        mixed = context_vector(own, previous, weight)
        return [
            t.replace(embedding=[float(x) for x in v], model_id=embedder.model_id)
            for t, v in zip(turns, mixed, strict=True)
        ]

    async def _schedule_summary(self, job: Job, p: ExchangePayload, turn_ids: Sequence[str]) -> None:
        """Count the turns towards the conversation's summary; schedule it once the conversation is long enough."""
        key = f"summary:{p.conversation_id}"
        state = await self._queue.update_state(job.user_id, key, _add_pending(job.id, turn_ids))
        if not state or len(state["pending"]) < self.settings.summary_min_turns:
            return  # short conversations, and short tails of summarised ones, stay as turns
        due_now = len(state["pending"]) >= self.settings.summary_max_new_turns
        run_after = time.time() + (0.0 if due_now else self.settings.summary_idle_s)
        payload = {"conversation_id": p.conversation_id, "model": p.model, "request_id": p.request_id}
        await self._queue.enqueue("summary", job.user_id, payload, dedupe_key=key, run_after=run_after, durable=False)

    # ------------------------------------------------------------------------------------------ facts

    async def handle_facts(self, job: Job) -> None:
        """Extract, screen and reconcile the facts of the user's window of exchanges; then trigger insights."""
        items = await self._window(job)
        if not items:
            return
        found = await self._screened_facts(job, items)
        plans = await self._plans(job, items, found)
        for i, decided in sorted(plans.items(), key=lambda kv: int(kv[0])):
            if f"fact:{i}" not in job.progress:
                record = fact_record(job.id, int(i), job.user_id, found[int(i)], decided["text"])
                if decided.get("embedding") is not None:
                    record = record.replace(embedding=decided["embedding"], model_id=self._store.embedder.model_id)
                await self._apply(job.user_id, Plan(**decided["plan"]), record)
                await job.checkpoint(f"fact:{i}")
        await self._after_window(job, items)

    async def _window(self, job: Job) -> list[dict[str, Any]]:
        """The exchanges this job extracts from: fixed at its first attempt (a retry takes the same ones)."""
        if "window" in job.progress:
            return list(job.progress["window"])
        if "user_messages" in job.payload:  # a per-exchange job enqueued before windows existed
            p = _parse(FactsPayload, job.payload)
            items = [window_item(job.id, p, p.source_ids, self.settings.facts_reply_chars)]
        else:
            taken = _take_window(job.id, self.settings.facts_window_exchanges)
            state = await self._queue.update_state(job.user_id, WINDOW_KEY, taken) or {}
            items = [item for item in state.get("items", []) if item.get("taken_by") == job.id]
        await job.checkpoint("window", items)
        return items

    async def _after_window(self, job: Job, items: Sequence[Mapping[str, Any]]) -> None:
        """Take the window's exchanges out of the state; schedule the rest; trigger insights."""
        model = self._model_of(items[-1])
        request_id = items[-1].get("request_id")
        if "user_messages" not in job.payload:
            state = await self._queue.update_state(job.user_id, WINDOW_KEY, _done_with_window(job.id))
            await self._enqueue_window(job.user_id, state, str(items[-1]["model"]), request_id)
        payload = {"reason": "exchange", "model": model, "request_id": request_id}
        run_after = time.time() + self.settings.insights_debounce_s
        await self._queue.enqueue(
            "insights", job.user_id, payload, dedupe_key="insights", run_after=run_after, durable=False
        )

    def _model_of(self, item: Mapping[str, Any]) -> str:
        return self.settings.model or str(item["model"])

    async def _screened_facts(self, job: Job, items: Sequence[Mapping[str, Any]]) -> list[Found]:
        if "extracted" in job.progress:
            return [_found_from_json(item) for item in job.progress["extracted"]]
        exchanges = [ExchangeText(tuple(item["user_messages"]), str(item["reply"])) for item in items]
        async with job.timed("extract"):
            extracted = await self._extract(self._model_of(items[-1]), exchanges)
        groups: dict[int, list[ExtractedFact]] = {}
        for fact in extracted:
            groups.setdefault(fact.exchange if 1 <= fact.exchange <= len(items) else 0, []).append(fact)
        unplaced = groups.pop(0, [])
        fallback = not any(f.explicit_request for f in unplaced)  # the screens' "remember ..." fallback
        found: list[Found] = []
        for n, (exchange, item) in enumerate(zip(exchanges, items, strict=True), start=1):
            sources = tuple(item["source_ids"])
            found += self._screen(groups.get(n, []), exchange, str(item["conversation_id"]), sources, fallback)
        if unplaced:
            sources = tuple(s for item in items for s in item["source_ids"])
            found += self._screen(unplaced, _joined(exchanges), str(items[-1]["conversation_id"]), sources, False)
        found = _unique(found)[: self._extractor.settings.max_facts * len(items)]
        await job.checkpoint("extracted", [_found_to_json(f) for f in found])
        return found

    def _screen(
        self, facts: list[ExtractedFact], exchange: ExchangeText, conversation: str, sources: tuple[str, ...],
        fallback: bool,
    ) -> list[Found]:  # fmt: skip
        """The facts of one exchange that pass the screens (with the "remember ..." fallback when asked)."""
        if fallback:
            kept, reasons = screen_facts(facts, exchange, self._extractor.settings)
        else:
            outcomes = [screen_fact(f, exchange, self._extractor.settings) for f in facts]
            kept = [o for o in outcomes if not isinstance(o, str)]
            reasons = [o for o in outcomes if isinstance(o, str)]
        for reason in reasons:
            log.info("memory.rejected", reason=reason)
        return [Found(s, conversation, sources) for s in kept]

    async def _extract(self, model: str, exchanges: Sequence[ExchangeText]) -> list[WindowFact]:
        try:
            return await self._extractor.extract_window(model, exchanges, self.settings.facts_reply_chars)
        except LLMUnavailable as error:
            raise RetryLater(f"memory LLM unavailable: {error}") from None
        except ExtractionFailed as error:
            log.warning("memory.step_failed", step="extract", reason=str(error))
            return []

    async def _plans(self, job: Job, items: Sequence[Mapping[str, Any]], found: Sequence[Found]) -> dict[str, Any]:
        """What to do with each fact (decided once, checkpointed): no model call when nothing stored is near."""
        if "plans" in job.progress:
            return dict(job.progress["plans"])
        if not found:
            return {}
        vectors = await self._store.embedder.embed_documents([f.screened.fact.text for f in found])
        near = [await self._neighbours(job.user_id, vector) for vector in vectors]
        async with job.timed("reconcile"):
            plans = await self._decide(self._model_of(items[-1]), found, near)
        decided: dict[str, Any] = {}
        targets: set[str] = set()
        for i, plan in enumerate(plans):
            settled = await self._settled(plan, found[i], items) if plan is not None else None
            if settled is not None and settled.target_id is not None:
                if settled.target_id in targets:  # two facts of one window change the same stored fact: keep both
                    settled = Plan("add", found[i].screened.fact.text)
                targets.add(settled.target_id or "")
            if settled is not None:
                embedding = [float(x) for x in vectors[i]] if settled.action == "add" else None
                if settled.action == "supersede" and settled.text == found[i].screened.fact.text:
                    embedding = [float(x) for x in vectors[i]]
                decided[str(i)] = {"plan": dataclasses.asdict(settled), "text": settled.text, "embedding": embedding}
        await job.checkpoint("plans", decided)
        return decided

    async def _decide(self, model: str, found: Sequence[Found], near: Sequence[list[Neighbour]]) -> list[Plan | None]:
        """Shortcut plans where they apply; one model call for the rest (the single-fact call for one)."""
        floor = self.settings.reconcile_min_similarity
        plans: list[Plan | None] = [
            shortcut_plan(f.screened.fact.text, n, floor) for f, n in zip(found, near, strict=True)
        ]
        ask = [i for i, plan in enumerate(plans) if plan is None]
        close = {i: [n for n in near[i] if n.score >= floor] for i in ask}
        try:
            if len(ask) == 1:
                (i,) = ask
                plans[i] = await self._extractor.decide(model, found[i].screened.fact.text, close[i])
            elif ask:
                asked = [(found[i].screened.fact.text, close[i]) for i in ask]
                for i, plan in zip(ask, await self._extractor.decide_many(model, asked), strict=True):
                    plans[i] = plan
        except LLMUnavailable as error:
            raise RetryLater(f"memory LLM unavailable: {error}") from None
        except ExtractionFailed as error:
            log.warning("memory.step_failed", step="reconcile", reason=str(error))
        return plans

    async def _settled(self, plan: Plan, found: Found, items: Sequence[Mapping[str, Any]]) -> Plan | None:
        """The plan, with an UPDATE's merged text screened like the extracted fact (None: dropped)."""
        if plan.action == "skip":
            return None
        if plan.action != "supersede" or plan.text == found.screened.fact.text:
            return plan
        exchange = _joined([ExchangeText(tuple(i["user_messages"]), str(i["reply"])) for i in items])
        merged = found.screened.fact.model_copy(update={"text": plan.text, "explicit_request": found.screened.explicit})
        outcome = screen_fact(merged, exchange, self._extractor.settings)
        if isinstance(outcome, str):
            log.info("memory.rejected", reason=outcome, step="reconcile")
            return None
        return dataclasses.replace(plan, text=outcome.fact.text)

    async def _neighbours(self, user_id: str, vector: Any) -> list[Neighbour]:
        hits = await self._store.vector_search(user_id, vector, self.settings.reconcile_neighbours, kinds=[Kind.FACT])
        return [Neighbour(hit.record.id, hit.record.text, hit.score) for hit in hits]

    async def _apply(self, user_id: str, plan: Plan, record: MemoryRecord) -> None:
        # Subjects are linked before the fact is stored: once a fact can be found, so can its subjects.
        if plan.action == "add":
            await self._subjects.link(record)
            await self._store.add([record])
        elif plan.action == "supersede" and plan.target_id is not None:
            await self._subjects.link(record)
            if await self._store.get(user_id, plan.target_id) is None:
                await self._store.add([record])  # the target went meanwhile (forgotten, or superseded by a retry)
            else:
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
            await self._queue.enqueue("summary", job.user_id, job.payload, dedupe_key=key, durable=False)

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


def _found_to_json(found: Found) -> dict[str, Any]:
    fact = found.screened.fact.model_dump(mode="json")
    return {"fact": fact, "explicit": found.screened.explicit, "conversation_id": found.conversation_id,
            "source_ids": list(found.source_ids)}  # fmt: skip


def _found_from_json(item: Mapping[str, Any]) -> Found:
    screened = Screened(ExtractedFact.model_validate(item["fact"]), bool(item["explicit"]))
    return Found(screened, str(item["conversation_id"]), tuple(item["source_ids"]))


def _joined(exchanges: Sequence[ExchangeText]) -> ExchangeText:
    """A window's exchanges as one (what the screens check a fact of no known exchange against)."""
    users = tuple(text for e in exchanges for text in e.user_messages)
    return ExchangeText(users, "\n".join(e.reply for e in exchanges))


def _unique(found: Sequence[Found]) -> list[Found]:
    """The facts with the same words only once (the first kept)."""
    seen: set[str] = set()
    out = []
    for f in found:
        key = normalise(f.screened.fact.text)
        if key not in seen:
            seen.add(key)
            out.append(f)
    return out
