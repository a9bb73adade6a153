"""The summary job: a conversation's rolling summary of its turns not yet summarised (the old one superseded).

The exchange job counts each conversation's new turns (``SummaryJobs.schedule``); once there are
``summary_min_turns`` of them, a debounced ``summary`` job runs after ``summary_idle_s`` of quiet, or at once past
``summary_max_new_turns``. The previous summary is superseded, kept as history.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from typing import Any

import structlog

from proxy.memory.store.memory_store import MemoryStore
from proxy.memory.store.records import Kind, MemoryRecord
from proxy.memory.write.extraction import ExtractionFailed, Extractor
from proxy.memory.write.identifiers import redact_identifiers
from proxy.memory.write.job_kinds import SUMMARY_JOB
from proxy.memory.write.job_types import RetryLater
from proxy.memory.write.llm import LLMUnavailable
from proxy.memory.write.payloads import ExchangePayload, derived_id
from proxy.memory.write.queue import Job, JobQueue
from proxy.memory.write.screens import screen_text
from proxy.memory.write.settings import WriterSettings

log = structlog.get_logger("memproxy.writer")

_MAX_PENDING_TURNS = 1000
State = dict[str, Any]
Update = Callable[[State | None], State]


def _add_pending(job_id: str, turn_ids: Sequence[str]) -> Update:
    def update(state: dict[str, Any] | None) -> dict[str, Any]:
        state = state or {"pending": [], "jobs": [], "summary_id": None}
        if job_id not in state["jobs"]:
            state["pending"] = [*state["pending"], *turn_ids][-_MAX_PENDING_TURNS:]
            state["jobs"] = [*state["jobs"], job_id][-50:]
        return state

    return update


def _summarised(turn_ids: Sequence[str], summary_id: str) -> Update:
    def update(state: dict[str, Any] | None) -> dict[str, Any]:
        state = state or {"pending": [], "jobs": []}
        done = set(turn_ids)
        return {**state, "pending": [t for t in state["pending"] if t not in done], "summary_id": summary_id}

    return update


class SummaryJobs:
    """Schedules and handles the ``summary`` jobs of the user's conversations."""

    def __init__(self, settings: WriterSettings, store: MemoryStore, queue: JobQueue, extractor: Extractor) -> None:
        self.settings = settings
        self._store = store
        self._queue = queue
        self._extractor = extractor

    async def schedule(self, job: Job, p: ExchangePayload, turn_ids: Sequence[str]) -> None:
        """Count the turns towards the conversation's summary; schedule it once the conversation is long enough."""
        key = f"summary:{p.conversation_id}"
        state = await self._queue.update_state(job.user_id, key, _add_pending(job.id, turn_ids))
        if not state or len(state["pending"]) < self.settings.summary_min_turns:
            return  # short conversations, and short tails of summarised ones, stay as turns
        due_now = len(state["pending"]) >= self.settings.summary_max_new_turns
        run_after = time.time() + (0.0 if due_now else self.settings.summary_idle_s)
        payload = {"conversation_id": p.conversation_id, "model": p.model, "request_id": p.request_id}
        await self._queue.enqueue(SUMMARY_JOB, job.user_id, payload, dedupe_key=key, run_after=run_after, durable=False)

    async def handle(self, job: Job) -> None:
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
            await self._queue.enqueue(SUMMARY_JOB, job.user_id, job.payload, dedupe_key=key, durable=False)

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
