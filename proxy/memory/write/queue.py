"""The durable job queue's API: enqueue, claim and finish jobs, per-user state and metrics, off the event loop.

What a job, a lane, a debounced and a waiting job are, and how durable each write is: see ``job_types``.
All SQLite calls run on one dedicated thread (``queue_db.JobDatabase``); its errors stop here, mapped to
``QueueDatabaseError``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import random
import sqlite3
import time
import uuid
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from types import TracebackType
from typing import Any, TypeVar

import structlog

from proxy.memory.store.faults import StorageHealth, is_storage_fault
from proxy.memory.write.group_commit import GroupCommit
from proxy.memory.write.job_types import (
    JobError,
    JobQueueSettings,
    JobState,
    QueueDatabaseError,
    QueueMetrics,
    StepLatency,
    backoff_delay,
)
from proxy.memory.write.queue_db import JobDatabase

log = structlog.get_logger("memproxy.jobs")

T = TypeVar("T")
JSON = dict[str, Any]


RESUMES_KEPT = 10_000  # users whose resume count the queue keeps (a lost one waits for the periodic recheck)


@dataclasses.dataclass
class Job:
    """One claimed job as a handler sees it; ``progress`` holds the checkpoints of earlier attempts."""

    id: str
    kind: str
    user_id: str
    payload: JSON
    attempt: int
    created_at: float
    progress: JSON
    queue: JobQueue = dataclasses.field(repr=False)

    async def checkpoint(self, key: str, value: Any = True) -> None:
        """Durably record that step ``key`` is done (with its result) so a retry can skip it."""
        self.progress[key] = value
        await self.queue.save_progress(self)

    @contextlib.asynccontextmanager
    async def timed(self, step: str) -> AsyncIterator[None]:
        """Measure the enclosed step into the queue's per-step latency (only when it succeeds)."""
        started = time.perf_counter()
        yield
        self.queue.observe_step(step, time.perf_counter() - started)


Handler = Callable[[Job], Awaitable[None]]


def database_error(error: sqlite3.Error) -> QueueDatabaseError:
    """The queue's own error for a SQLite error (kept as its cause)."""
    mapped = QueueDatabaseError(str(error))
    mapped.__cause__ = error
    return mapped


class JobQueue:
    """The durable queue: enqueue, claim, finish, metrics and per-user state, all off the event loop."""

    def __init__(
        self,
        settings: JobQueueSettings,
        *,
        rng: random.Random | None = None,
        health: StorageHealth | None = None,
        producer: bool = False,
        watch_s: float = 0.0,
    ) -> None:
        """``producer``: a chat process's queue, which only enqueues (the memory writer process owns the queue);
        ``watch_s``: the owner looks this often for jobs other processes enqueued (0: none do)."""
        self.settings = settings
        self.owner = uuid.uuid4().hex
        self.health = health or StorageHealth()
        self.producer = producer
        self._watch_s = watch_s
        self._watcher: asyncio.Task[None] | None = None
        self._db = JobDatabase(settings, producer=producer)
        self._commits: GroupCommit[tuple[JSON, str | None], str] = GroupCommit(self._write_enqueues)
        self._executor: ThreadPoolExecutor | None = None
        self._rng = rng or random.Random()
        self._wake: asyncio.Event | None = None
        self._forget_hooks: list[Callable[[str], Awaitable[None]]] = []
        # A forget and a claim never interleave: a job claimed (marked running in the database) is started by
        # the runner before a forget looks for running jobs, or the forget has deleted it before the claim.
        self._claiming = asyncio.Lock()
        self._steps: dict[str, StepLatency] = {}
        self._totals = {"completed": 0, "failed": 0, "deferred": 0, "dead": 0}
        self._waits: Counter[str] = Counter()
        # Each user's ``resume_waiting`` calls (the users of the latest RESUMES_KEPT): a job that starts waiting
        # after what it waited for arrived, while it ran, is resumed by the runner (``resumes_of``).
        self._resumes: OrderedDict[str, int] = OrderedDict()

    async def __aenter__(self) -> JobQueue:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="memproxy-jobs")
        self._wake = asyncio.Event()
        try:
            await self._call(self._db.open)
            reclaimed = 0 if self.producer else await self._call(self._db.reclaim_orphans, self.owner, time.time())
        except BaseException:
            await self._shutdown()
            raise
        if reclaimed:
            log.info("jobs.reclaimed", count=reclaimed)
        if self._watch_s > 0:
            self._watcher = asyncio.create_task(self._watch_others())
        return self

    async def _watch_others(self) -> None:
        """Wake the runner when another process (a chat process) committed an enqueue."""
        seen = await self._call(self._db.data_version)
        while True:
            await asyncio.sleep(self._watch_s)
            with contextlib.suppress(QueueDatabaseError):
                version = await self._call(self._db.data_version)
                if version != seen:
                    seen = version
                    self.wakeup.set()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self._shutdown()

    async def _shutdown(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
            self._watcher = None
        if self._executor is None:
            return
        await self._commits.aclose()
        await self._call(self._db.close)
        self._executor.shutdown(wait=True)
        self._executor = None

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run one database call on the queue's thread: the queue's boundary, where SQLite's errors are mapped."""
        if self._executor is None:
            raise JobError("the job queue is not open")
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)
        except sqlite3.Error as error:
            raise database_error(error) from error

    @property
    def completed_total(self) -> int:
        """Jobs completed since this queue opened."""
        return self._totals["completed"]

    @property
    def wakeup(self) -> asyncio.Event:
        """Set when there may be new work (an enqueue or a finished job)."""
        assert self._wake is not None, "queue is not open"
        return self._wake

    async def enqueue(
        self,
        kind: str,
        user_id: str,
        payload: Mapping[str, Any],
        *,
        dedupe_key: str | None = None,
        run_after: float | None = None,
        job_id: str | None = None,
        durable: bool = True,
    ) -> str:
        """Add a job and return its id once the commit is durable.

        ``dedupe_key`` debounces (see the module doc); ``job_id`` makes the enqueue idempotent: if a job with
        that id exists (in any state, including done within ``done_retention_s``) nothing is added.
        ``durable=False`` skips the fsync: for a follow-up enqueued by a running job, whose own completion is
        committed later in the same write-ahead log (a power cut that loses the follow-up loses that
        completion too, and the job runs again).
        """
        now = time.time()
        row = {
            "id": job_id or uuid.uuid4().hex,
            "kind": kind,
            "user_id": user_id,
            "payload": json.dumps(payload, separators=(",", ":")),
            "dedupe_key": dedupe_key,
            "run_after": now if run_after is None else run_after,
            "now": now,
        }
        if durable:  # concurrent enqueues share one fsync
            new_id = await self._commits.submit((row, job_id))
        else:
            new_id = await self._call(self._db.enqueue, row, job_id, False)
        self.wakeup.set()
        return new_id

    async def _write_enqueues(self, items: list[tuple[JSON, str | None]]) -> list[str | BaseException]:
        try:
            results = await self._call(self._db.enqueue_many, items)
        except (QueueDatabaseError, OSError) as error:
            if is_storage_fault(error):
                self.health.fault("queue", error)
            raise
        self.health.ok("queue")
        return [database_error(r) if isinstance(r, sqlite3.Error) else r for r in results]

    @property
    def commit_batches(self) -> tuple[int, int]:
        """(durable commits, enqueues they carried) since start: the group commit's effect."""
        return self._commits.batches, self._commits.items

    async def retry_storage_deferred(self) -> int:
        """Jobs waiting out a storage fault become due now; returns how many."""
        count = await self._call(self._db.retry_storage_deferred, time.time())
        if count:
            self.wakeup.set()
        return count

    async def claim(
        self, limits: Mapping[str, int], start: Callable[[Job], object] | None = None
    ) -> tuple[list[Job], float]:
        """Claim due jobs, up to ``limits[kind]`` of each kind (one per lane); also when the next one is due.

        ``start(job)`` is called for each claimed job before any ``forget_user`` can look for running jobs
        (the runner starts them there), so a forget stops every job it did not delete.
        """
        async with self._claiming:
            rows, next_due = await self._call(self._db.claim, dict(limits), self.owner, time.time())
            jobs = [self._job(row) for row in rows]
            if start is not None:
                for job in jobs:
                    start(job)
        return jobs, next_due

    def _job(self, row: sqlite3.Row) -> Job:
        return Job(
            id=row["id"],
            kind=row["kind"],
            user_id=row["user_id"],
            payload=json.loads(row["payload"]),
            attempt=int(row["attempts"]) + 1,
            created_at=float(row["created_at"]),
            progress=json.loads(row["progress"]),
            queue=self,
        )

    async def renew(self, job_ids: Sequence[str]) -> None:
        """Extend the leases of jobs this process is running."""
        if job_ids:
            await self._call(self._db.renew, tuple(job_ids), self.owner, time.time() + self.settings.lease_s)

    async def save_progress(self, job: Job) -> None:
        """Persist a job's checkpoints."""
        await self._call(self._db.save_progress, job.id, self.owner, json.dumps(job.progress))

    async def complete(self, job: Job) -> None:
        """Mark a job done (its payload and progress are cleared)."""
        now = time.time()
        changes = {"state": "done", "updated_at": now, "payload": "{}", "progress": "{}", "last_error": None}
        await self._finish(job, changes)
        self._totals["completed"] += 1

    async def fail(self, job: Job, error: str, *, permanent: bool = False) -> JobState:
        """Record a failed attempt: retry later with backoff, or dead-letter after the last attempt."""
        now = time.time()
        self._totals["failed"] += 1
        if permanent or job.attempt >= self.settings.max_attempts:
            self._totals["dead"] += 1
            await self._finish(job, {"state": "dead", "updated_at": now, "last_error": error})
            return JobState.DEAD
        delay = backoff_delay(job.attempt, self.settings.backoff_base_s, self.settings.backoff_max_s, self._rng)
        changes = {"state": "pending", "run_after": now + delay, "updated_at": now, "last_error": error}
        await self._finish(job, changes)
        return JobState.PENDING

    async def defer(self, job: Job, reason: str) -> float:
        """Put a job back to wait for a dependency, without spending an attempt; returns the delay."""
        row = await self._call(self._db.job_row, job.id)
        deferrals = int(row["deferrals"]) + 1 if row else 1
        delay = backoff_delay(deferrals, self.settings.backoff_base_s, self.settings.backoff_max_s, self._rng)
        now = time.time()
        changes = {
            "state": "pending",
            "attempts": job.attempt - 1,
            "deferrals": deferrals,
            "run_after": now + delay,
            "updated_at": now,
            "last_error": reason,
        }
        await self._finish(job, changes)
        self._totals["deferred"] += 1
        return delay

    async def wait_for_config(self, job: Job, reason: str, detail: str) -> None:
        """Park a job that only a key or configuration change can help: no attempt spent, never dead."""
        now = time.time()
        changes = {
            "state": "pending",
            "attempts": job.attempt - 1,
            "run_after": now + self.settings.waiting_recheck_s,
            "updated_at": now,
            "last_error": f"waiting ({reason}): {detail}"[:1000],
            "waiting": reason,
        }
        await self._finish(job, changes)
        self._waits[reason] += 1

    def resumes_of(self, user_id: str) -> int:
        """How many times the user's waiting jobs were resumed (0 for users not among the latest kept)."""
        return self._resumes.get(user_id, 0)

    async def resume_waiting(self, user_id: str) -> int:
        """Make the user's waiting jobs due now (something they waited for may have arrived); returns how many."""
        self._resumes[user_id] = self._resumes.pop(user_id, 0) + 1
        while len(self._resumes) > RESUMES_KEPT:
            self._resumes.popitem(last=False)
        count = await self._call(self._db.resume_waiting, user_id, time.time())
        if count:
            self.wakeup.set()
        return count

    async def release(self, job: Job) -> None:
        """Hand an interrupted job back, due now, without spending an attempt (used at shutdown)."""
        now = time.time()
        await self._finish(job, {"state": "pending", "attempts": job.attempt - 1, "run_after": now, "updated_at": now})

    async def _finish(self, job: Job, changes: JSON) -> None:
        await self._call(self._db.finish, job.id, self.owner, changes)
        self.wakeup.set()

    async def purge_done(self) -> int:
        """Drop finished jobs older than ``done_retention_s``."""
        return await self._call(self._db.purge_done, time.time() - self.settings.done_retention_s)

    async def get(self, job_id: str) -> JSON | None:
        """One job's row as a dict (for tests and operators), or None."""
        return await self._call(self._db.job_row, job_id)

    async def dead_letters(self, limit: int = 100) -> list[JSON]:
        """The most recent dead jobs (without payloads)."""
        return await self._call(self._db.dead_letters, limit)

    async def requeue(self, job_id: str) -> bool:
        """Give a dead job a fresh set of attempts."""
        done = await self._call(self._db.requeue, job_id, time.time())
        self.wakeup.set()
        return done

    async def update_state(self, user_id: str, key: str, fn: Callable[[JSON | None], JSON | None]) -> JSON | None:
        """Atomically replace a small per-user JSON value with ``fn(old)`` (None deletes it); returns it.

        ``fn`` runs on the queue's thread inside the transaction: it must be quick and pure.
        """
        return await self._call(self._db.update_state, user_id, key, fn)

    async def get_state(self, user_id: str, key: str) -> JSON | None:
        """A per-user JSON value, or None."""
        return await self._call(self._db.get_state, user_id, key)

    def on_forget(self, hook: Callable[[str], Awaitable[None]]) -> None:
        """Register a coroutine that stops a user's running jobs (the runner registers itself)."""
        self._forget_hooks.append(hook)

    async def forget_user(self, user_id: str) -> int:
        """Delete every job and state of ``user_id``; running ones are stopped first. Returns jobs deleted.

        Call it before the store's ``forget_user``, so that no job of the user writes after the store forgot.
        """
        async with self._claiming:
            count = await self._call(self._db.forget_user, user_id, False)
            for hook in self._forget_hooks:
                await hook(user_id)
            return count + await self._call(self._db.forget_user, user_id, True)

    def observe_step(self, step: str, seconds: float) -> None:
        """Count one step latency observation."""
        self._steps.setdefault(step, StepLatency()).observe(seconds)

    async def metrics(self) -> QueueMetrics:
        """Queue depth, age of the oldest due job, totals since start and per-step latency."""
        now = time.time()
        (ready, scheduled, running, dead, oldest), by_kind = await self._call(self._db.gauges, now)
        waiting = await self._call(self._db.waiting_counts)
        return QueueMetrics(
            ready=int(ready),
            scheduled=int(scheduled),
            running=int(running),
            dead=int(dead),
            oldest_age_s=max(0.0, now - float(oldest)) if oldest is not None else 0.0,
            depth_by_kind=by_kind,
            completed_total=self._totals["completed"],
            failed_total=self._totals["failed"],
            deferred_total=self._totals["deferred"],
            dead_total=self._totals["dead"],
            step_latency={name: dataclasses.replace(s, buckets=list(s.buckets)) for name, s in self._steps.items()},
            waiting=waiting,
            waits_total=dict(self._waits),
        )
