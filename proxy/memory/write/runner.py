"""The job runner: runs queued jobs with their handlers, records each outcome, and drains at shutdown.

A handler says how its job ended by returning (done) or raising ``RetryLater``, ``GiveUp`` or ``WaitForConfig``
(see ``job_types``); any other error is a failed attempt, except a fault of our own disk, which the job waits
out without spending an attempt.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from types import TracebackType

import structlog

from proxy.memory import spans
from proxy.memory.store.faults import is_storage_fault
from proxy.memory.write.job_types import GiveUp, JobError, JobState, QueueDatabaseError, RetryLater, WaitForConfig
from proxy.memory.write.queue import Handler, Job, JobQueue

log = structlog.get_logger("memproxy.jobs")


class JobRunner:
    """Runs queued jobs with the given handlers while its ``async with`` block is open.

    On exit it stops claiming, lets running jobs finish for up to ``drain_timeout_s``, then cancels the rest
    and hands them back to the queue (they run again after restart; handlers are idempotent).
    """

    def __init__(self, queue: JobQueue, handlers: Mapping[str, Handler]) -> None:
        self._queue = queue
        self._settings = queue.settings
        self._handlers = dict(handlers)
        self._inflight: dict[str, tuple[Job, asyncio.Task[None]]] = {}
        self._stopping = asyncio.Event()
        self._main: asyncio.Task[None] | None = None
        self._last_purge = 0.0
        self._health = queue.health
        self._unsettled: dict[str, Callable[[], Awaitable[None]]] = {}  # outcomes the queue failed to record

    async def __aenter__(self) -> JobRunner:
        self._queue.on_forget(self._stop_user)
        self._main = asyncio.create_task(self._run_forever(), name="memproxy-job-runner")
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stopping.set()
        self._queue.wakeup.set()
        if self._main is not None:
            await self._main
            self._main = None

    async def _run_forever(self) -> None:
        async with asyncio.TaskGroup() as group:
            group.create_task(self._heartbeat())
            while not self._stopping.is_set():
                next_due = await self._fill(group)
                await self._sleep_until(next_due)
            await self._drain()

    async def _fill(self, group: asyncio.TaskGroup) -> float:
        self._queue.wakeup.clear()  # before claiming: a wake-up during the claim is kept for the next wait
        busy = Counter(job.kind for job, _ in self._inflight.values())
        free = {kind: self._settings.concurrency_of(kind) - busy[kind] for kind in self._handlers}
        if not any(n > 0 for n in free.values()):
            return float("inf")
        try:
            await self._settle()
            jobs, next_due = await self._queue.claim(free, start=lambda job: self._start(group, job))
            await self._purge_now_and_then()
        except (OSError, JobError) as error:
            self._queue_failed("jobs.claim_failed", error)
            return time.time() + self._settings.poll_interval_s
        if jobs:  # a claim that found nothing may have written nothing: no proof that the disk works again
            self._health.ok("queue")
        return next_due

    def _start(self, group: asyncio.TaskGroup, job: Job) -> None:
        self._inflight[job.id] = (job, group.create_task(self._run_one(job), name=f"job-{job.id}"))

    async def _sleep_until(self, next_due: float) -> None:
        """Wait for an enqueue or a finished job, or until the next scheduled job is due.

        Due jobs left unclaimed wait for a busy lane or a free slot: both end with a finished job.
        """
        until_due = next_due - time.time()
        timeout = self._settings.poll_interval_s if until_due <= 0 else min(self._settings.poll_interval_s, until_due)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await self._queue.wakeup.wait()

    async def _purge_now_and_then(self) -> None:
        if time.monotonic() - self._last_purge > 60.0:
            self._last_purge = time.monotonic()
            await self._queue.purge_done()

    async def _heartbeat(self) -> None:
        while not self._stopping.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._settings.lease_s / 3):
                    await self._stopping.wait()
            try:
                await self._queue.renew(list(self._inflight))
            except (QueueDatabaseError, OSError) as error:
                self._queue_failed("jobs.renew_failed", error)

    def _queue_failed(self, event: str, error: BaseException) -> None:
        """A failure of the queue's own database: a storage fault is logged once per fault, others each time."""
        if is_storage_fault(error):
            self._health.fault("queue", error)
        else:
            log.error(event, error=repr(error))

    async def _settle(self) -> None:
        """Record the outcomes of finished jobs that the queue could not record at the time (disk fault)."""
        for job_id, outcome in list(self._unsettled.items()):
            await outcome()
            del self._unsettled[job_id]

    async def _drain(self) -> None:
        tasks = [task for _, task in self._inflight.values()]
        if not tasks:
            return
        _, pending = await asyncio.wait(tasks, timeout=self._settings.drain_timeout_s)
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending)
            log.warning("jobs.drain_cancelled", count=len(pending))

    async def _stop_user(self, user_id: str) -> None:
        tasks = [task for job, task in self._inflight.values() if job.user_id == user_id]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)

    async def _run_one(self, job: Job) -> None:
        request_id = job.payload.get("request_id")
        started = time.perf_counter()
        try:
            with (
                structlog.contextvars.bound_contextvars(job_id=job.id, job_kind=job.kind, request_id=request_id),
                spans.job_span(f"memproxy.job.{job.kind}", job.payload.get("traceparent"), attempt=job.attempt),
            ):
                await self._attempt(job)
        except asyncio.CancelledError:
            await asyncio.shield(self._release_quietly(job))
            raise
        except (OSError, JobError) as error:
            # The queue failed to record the outcome: on a disk fault, hand the job back (without spending an
            # attempt) once the disk works again; otherwise the lease runs out and the job is taken again.
            self._queue_failed("jobs.bookkeeping_failed", error)
            if is_storage_fault(error):
                self._unsettled[job.id] = functools.partial(self._queue.release, job)
        finally:
            self._inflight.pop(job.id, None)
            self._queue.wakeup.set()
        self._queue.observe_step(f"job.{job.kind}", time.perf_counter() - started)

    async def _attempt(self, job: Job) -> None:
        resumes = self._queue.resumes_of(job.user_id)
        try:
            async with asyncio.timeout(self._settings.job_timeout_s):
                await self._handlers[job.kind](job)
        except RetryLater as error:
            delay = await self._queue.defer(job, str(error))
            log.info("job.deferred", reason=str(error), retry_in_s=round(delay, 2))
        except GiveUp as error:
            await self._queue.fail(job, str(error), permanent=True)
            log.error("job.dead", attempt=job.attempt, error=str(error))
        except WaitForConfig as error:
            await self._queue.wait_for_config(job, error.reason, str(error))
            if self._queue.resumes_of(job.user_id) != resumes:  # what it waits for came while it ran
                await self._queue.resume_waiting(job.user_id)
            log.warning(
                "job.waiting",
                reason=error.reason,
                detail=str(error)[:300],
                recheck_in_s=self._settings.waiting_recheck_s,
            )
        except Exception as error:  # the worker's boundary: no handler error may stop it
            if is_storage_fault(error):
                await self._wait_out_fault(job, error)
            else:
                await self._record_failure(job, error)
        else:
            await self._queue.complete(job)
            await self._write_path_ok()

    async def _wait_out_fault(self, job: Job, error: Exception) -> None:
        """Our own disk failed under the job: it waits (backoff, no attempt spent), never dead-lettered."""
        self._health.fault("write_path", error)
        await self._queue.defer(job, f"storage fault: {type(error).__name__}: {str(error)[:300]}")

    async def _write_path_ok(self) -> None:
        if self._health.failing("write_path"):
            self._health.ok("write_path")
            count = await self._queue.retry_storage_deferred()
            log.info("jobs.resumed_after_storage_fault", count=count)

    async def _record_failure(self, job: Job, error: Exception) -> None:
        reason = "timeout" if isinstance(error, TimeoutError) else f"{type(error).__name__}: {error}"
        state = await self._queue.fail(job, reason[:1000])
        event = "job.dead" if state is JobState.DEAD else "job.failed"
        log.error(event, attempt=job.attempt, error=reason[:300], exc_info=state is JobState.DEAD)

    async def _release_quietly(self, job: Job) -> None:
        try:
            await self._queue.release(job)
        except (OSError, JobError) as error:
            log.warning("jobs.release_failed", error=repr(error))
