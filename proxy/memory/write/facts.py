"""The facts job: a window's facts extracted, screened, reconciled with the nearest stored facts, and stored.

Each remaining fact is reconciled with the user's nearest valid facts (add, supersede, invalidate or skip as
duplicate: no model call when nothing stored is near), and the subject records of the names it carries follow
(``subjects``). Then a debounced ``insights`` job is enqueued (handled by the ``insights`` package). Every step
is checkpointed in the job, so a retry neither asks the model again nor stores a fact twice.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Mapping, Sequence
from typing import Any

import structlog

from proxy.memory.events import MemoryEvents, NoEvents
from proxy.memory.store.memory_store import MemoryStore
from proxy.memory.store.records import Kind, MemoryRecord
from proxy.memory.write.extraction import (
    ExtractedFact,
    ExtractionFailed,
    Extractor,
    Neighbour,
    Plan,
    WindowFact,
    normalise,
    shortcut_plan,
)
from proxy.memory.write.fact_apply import apply_plan
from proxy.memory.write.fact_screens import Screened, screen_fact, screen_facts
from proxy.memory.write.facts_window import (
    WINDOW_KEY,
    add_to_window,
    done_with_window,
    take_window,
    untaken,
    window_item,
)
from proxy.memory.write.job_kinds import FACTS_JOB, INSIGHTS_DEDUPE_KEY, INSIGHTS_JOB
from proxy.memory.write.job_types import RetryLater
from proxy.memory.write.llm import LLMUnavailable
from proxy.memory.write.payloads import ExchangePayload, FactsPayload, derived_id, parse_payload
from proxy.memory.write.prompts import ExchangeText
from proxy.memory.write.queue import Job, JobQueue
from proxy.memory.write.settings import WriterSettings
from proxy.memory.write.subjects import SubjectLinker

log = structlog.get_logger("memproxy.writer")


@dataclasses.dataclass(frozen=True)
class Found:
    """A screened fact of a window with where it came from (the user turns of its exchange)."""

    screened: Screened
    conversation_id: str
    source_ids: tuple[str, ...]


def fact_record(job_id: str, i: int, user_id: str, found: Found, text: str) -> MemoryRecord:
    """The fact record for the ``i``-th screened fact of a job."""
    fact = found.screened.fact
    return MemoryRecord(
        user_id=user_id, kind=Kind.FACT, text=text, id=derived_id(job_id, "fact", i),
        conversation_id=found.conversation_id, category=fact.category, importance=fact.importance,
        entities=fact.entities, sensitive=fact.sensitive or fact.sensitive_category != "none",
        source_ids=found.source_ids, meta=json.dumps({"job_id": job_id, "explicit": found.screened.explicit}),
    )  # fmt: skip


class FactJobs:
    """Queues a user's exchanges for extraction and handles the ``facts`` jobs that extract from them."""

    def __init__(
        self,
        settings: WriterSettings,
        store: MemoryStore,
        queue: JobQueue,
        extractor: Extractor,
        events: MemoryEvents | None = None,
    ) -> None:
        self.settings = settings
        self._events = events or NoEvents()
        self._store = store
        self._queue = queue
        self._extractor = extractor
        self._subjects = SubjectLinker(store)  # subject records follow the facts (see ``subjects``)

    async def add_exchange(self, job: Job, p: ExchangePayload, source_ids: Sequence[str]) -> None:
        """Queue the exchange for extraction: due when the window is full, holds a "remember ...", or
        ``facts_window_wait_s`` after its first."""
        item = window_item(job.id, p, source_ids, self.settings.facts_reply_chars)
        state = await self._queue.update_state(job.user_id, WINDOW_KEY, add_to_window(item))
        await self._enqueue_window(job.user_id, state, p.model, p.request_id)

    async def _enqueue_window(self, user_id: str, state: Mapping[str, Any] | None, model: str, request_id: Any) -> None:
        waiting = untaken(state)
        if not waiting:
            return
        full = len(waiting) >= self.settings.facts_window_exchanges or any(i.get("remember") for i in waiting)
        first_at = min(float(item.get("added_at", 0.0)) for item in waiting)
        run_after = time.time() if full else first_at + self.settings.facts_window_wait_s
        payload = {"model": model, "request_id": request_id}
        await self._queue.enqueue(
            FACTS_JOB, user_id, payload, dedupe_key=WINDOW_KEY, run_after=run_after, durable=False
        )

    async def handle(self, job: Job) -> None:
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
            p = parse_payload(FactsPayload, job.payload)
            items = [window_item(job.id, p, p.source_ids, self.settings.facts_reply_chars)]
        else:
            taken = take_window(job.id, self.settings.facts_window_exchanges)
            state = await self._queue.update_state(job.user_id, WINDOW_KEY, taken) or {}
            items = [item for item in state.get("items", []) if item.get("taken_by") == job.id]
        await job.checkpoint("window", items)
        return items

    async def _after_window(self, job: Job, items: Sequence[Mapping[str, Any]]) -> None:
        """Take the window's exchanges out of the state; schedule the rest; trigger insights."""
        model = self._model_of(items[-1])
        request_id = items[-1].get("request_id")
        if "user_messages" not in job.payload:
            state = await self._queue.update_state(job.user_id, WINDOW_KEY, done_with_window(job.id))
            await self._enqueue_window(job.user_id, state, str(items[-1]["model"]), request_id)
        payload = {"reason": "exchange", "model": model, "request_id": request_id}
        run_after = time.time() + self.settings.insights_debounce_s
        await self._queue.enqueue(
            INSIGHTS_JOB, job.user_id, payload, dedupe_key=INSIGHTS_DEDUPE_KEY, run_after=run_after, durable=False
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
        await apply_plan(self._store, self._subjects, self._events, user_id, plan, record)


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
