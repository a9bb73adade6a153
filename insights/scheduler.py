"""Insight triggers and the job that runs them: all of them go through the durable queue.

- **Activity**: the write path enqueues a debounced ``insights`` job after each exchange's facts
  (``request_insights`` does the same for anyone else, with the delay the caller gives: the write path
  uses ``[writer] insights_debounce_s``).
- **Schedule**: ``InsightScheduler`` (an async context manager that owns its task) looks every
  ``schedule_check_s`` for users whose last run is at least ``schedule_interval_s`` old (default weekly) and
  who wrote something since, and enqueues a job for each.
- **Manual**: ``request_insights(queue, user_id, reason="manual")``, due at once.

Every trigger uses the dedupe key ``"insights"``, so triggers for a user whose job has not started yet
collapse into that one job; the queue runs one job per (user, kind) at a time; and ``regenerate`` joins a
run already in flight. ``InsightJobs.handle`` is the handler of kind ``"insights"``; after a run it records
``{"last_run_at", "model"}`` in the queue's per-user state (key ``"insights"``), which the scheduler reads.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from types import TracebackType
from typing import Any

import structlog

from insights.service import InsightSettings, regenerate
from proxy.memory import MemoryEvents, MemoryLayerError, NoEvents, memory_dict
from proxy.memory.store import Kind, MemoryStore
from proxy.memory.write import (
    INSIGHTS_DEDUPE_KEY,
    INSIGHTS_JOB,
    Handler,
    Job,
    JobQueue,
    LLMClient,
    LLMUnavailable,
    RetryLater,
    WaitForConfig,
)

log = structlog.get_logger("memproxy.insights")

JOB_KIND = INSIGHTS_JOB  # the write path triggers the same job (proxy.memory.write.job_kinds)
DEDUPE_KEY = INSIGHTS_DEDUPE_KEY
STATE_KEY = "insights"


async def request_insights(
    queue: JobQueue,
    user_id: str,
    *,
    reason: str = "manual",
    delay_s: float = 0.0,
    model: str | None = None,
    request_id: str | None = None,
) -> str:
    """Enqueue (or pull forward / push back) the user's insight job; returns its id."""
    payload: dict[str, Any] = {"reason": reason}
    if model:
        payload["model"] = model
    if request_id:
        payload["request_id"] = request_id
    return await queue.enqueue(
        JOB_KIND, user_id, payload, dedupe_key=DEDUPE_KEY, run_after=time.time() + max(0.0, delay_s)
    )


class InsightJobs:
    """The handler of ``insights`` jobs: one regeneration per job, then the user's run state is saved."""

    def __init__(
        self,
        store: MemoryStore,
        llm: LLMClient,
        settings: InsightSettings,
        *,
        default_model: str | None = None,
        latest_model: Callable[[str], str | None] | None = None,
        clock: Callable[[], datetime] | None = None,
        events: MemoryEvents | None = None,
    ) -> None:
        self._store = store
        self._events = events or NoEvents()
        self._llm = llm
        self._settings = settings
        self._default_model = default_model
        self._latest_model = latest_model or (lambda _user_id: None)
        self._clock = clock or (lambda: datetime.now(UTC))

    def handlers(self) -> dict[str, Handler]:
        """``{"insights": handle}``, to merge into the job runner's handlers."""
        return {JOB_KIND: self.handle}

    def model_for(self, user_id: str, payload: Mapping[str, Any], state: Mapping[str, Any]) -> str | None:
        """``[insights] model``, else the configured memory model, else the user's latest chat model, else the
        model the trigger or the last run named."""
        return (
            self._settings.model
            or self._default_model
            or self._latest_model(user_id)
            or payload.get("model")
            or state.get("model")
        )

    async def handle(self, job: Job) -> None:
        """Regenerate the job's user's insights (waits, without spending an attempt, while the LLM is down or
        while no model is known: after a restart, until the user's next chat)."""
        state = await job.queue.get_state(job.user_id, STATE_KEY) or {}
        model = self.model_for(job.user_id, job.payload, state)
        if not model:
            raise WaitForConfig(
                "no_model", "no model for insights yet: the user's next chat brings one (or set [insights] model)"
            )
        now = self._clock()
        try:
            current = await regenerate(self._store, self._llm, job.user_id, self._settings, now, model=model)
        except LLMUnavailable as error:
            raise RetryLater(str(error)) from None
        await job.queue.update_state(job.user_id, STATE_KEY, _ran(now.timestamp(), str(model)))
        log.info("insights.ran", reason=job.payload.get("reason"), insights=len(current))
        if current:
            insights = [memory_dict(record) for record in current]
            await self._events.emit("insights.regenerated", job.user_id, insights=insights)


def _ran(at: float, model: str) -> Callable[[dict[str, Any] | None], dict[str, Any]]:
    def update(old: dict[str, Any] | None) -> dict[str, Any]:
        return {**(old or {}), "last_run_at": at, "model": model}

    return update


def _scheduled(at: float) -> Callable[[dict[str, Any] | None], dict[str, Any]]:
    def update(old: dict[str, Any] | None) -> dict[str, Any]:
        return {**(old or {}), "scheduled_at": at}

    return update


def due(last_run_at: float | None, last_activity_at: float | None, now: float, interval_s: float) -> bool:
    """Whether a scheduled run is due: active since the last run, which is at least ``interval_s`` old."""
    if last_activity_at is None:
        return False
    if last_run_at is None:
        return True
    return last_activity_at > last_run_at and now - last_run_at >= interval_s


class InsightScheduler:
    """Enqueues insight jobs for active users on a schedule while its ``async with`` block is open."""

    def __init__(
        self,
        store: MemoryStore,
        queue: JobQueue,
        settings: InsightSettings,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._store = store
        self._queue = queue
        self._settings = settings
        self._clock = clock
        self._stopping = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.ticks = 0

    async def __aenter__(self) -> InsightScheduler:
        self._stopping.clear()
        self._task = asyncio.create_task(self._run(), name="memproxy-insight-scheduler")
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stopping.set()
        if self._task is not None:
            task, self._task = self._task, None
            await task

    @property
    def running(self) -> bool:
        """Whether the scheduler's task is alive."""
        return self._task is not None and not self._task.done()

    async def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                await self.tick()
            except (MemoryLayerError, OSError) as error:  # the queue maps SQLite errors to a MemoryLayerError
                log.error("insights.schedule_failed", error=repr(error))
            self.ticks += 1
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._settings.schedule_check_s):
                    await self._stopping.wait()

    async def tick(self) -> list[str]:
        """Enqueue a job for every due user; returns their ids."""
        enqueued: list[str] = []
        users: list[str] = sorted(await self._store.user_ids())
        for user_id in users:
            if self._stopping.is_set():
                break
            state = await self._queue.get_state(user_id, STATE_KEY) or {}
            if await self._due(user_id, state):
                await request_insights(self._queue, user_id, reason="schedule", model=state.get("model"))
                await self._queue.update_state(user_id, STATE_KEY, _scheduled(self._clock()))
                enqueued.append(user_id)
        if enqueued:
            log.info("insights.scheduled", users=len(enqueued))
        return enqueued

    async def _due(self, user_id: str, state: Mapping[str, Any]) -> bool:
        """Due by ``due``, counting a scheduled job that never completed as a run (no hourly retries)."""
        page = await self._store.list(user_id, [Kind.TURN], limit=1)
        last_activity = page.data[0].created_at.timestamp() if page.data else None
        runs = [t for t in (state.get("last_run_at"), state.get("scheduled_at")) if t is not None]
        return due(max(runs, default=None), last_activity, self._clock(), self._settings.schedule_interval_s)
