"""The job queue's vocabulary: its settings, errors, job states and metrics (no I/O).

Vocabulary:

- A *job* has a kind (which handler runs it), a user, a JSON payload and a state: ``pending`` (due at
  ``run_after``), ``running`` (claimed under a lease), ``done`` (kept ``done_retention_s`` with its payload
  cleared, so that re-enqueueing the same ``job_id`` is ignored) or ``dead`` (gave up after ``max_attempts``).
- A *lane* is one (user, kind). Jobs of one lane run one at a time, in enqueue order; lanes run in parallel,
  at most ``concurrency`` jobs of each kind at once. (Lanes and limits are per kind, not per user only, so
  that storing the turns of a new reply never waits behind slow fact-extraction calls, the user's own or
  anyone else's.)
- A *debounced* job has a ``dedupe_key``: enqueueing the same (user, kind, key) while a job is still pending
  updates that job (new ``run_after`` and payload) instead of adding one, never later than
  ``debounce_max_delay_s`` after its first trigger. Debounced jobs do not hold up the FIFO order of their
  lane.
- A *waiting* job is a pending job whose handler raised ``WaitForConfig`` (no key, a rejected key, no model):
  retrying cannot help until something changes, so it spends no attempt, is never dead-lettered for it, is
  counted per reason in the metrics, looks again every ``waiting_recheck_s``, and runs at once when
  ``resume_waiting(user_id)`` says that user's situation changed (e.g. a chat brought a key).

Durability: ``enqueue`` returns only once its commit is on disk (``synchronous=FULL``); every other write uses
``synchronous=NORMAL`` (safe against a killed process; a power cut can at worst replay a finished job, and
handlers are idempotent by job id). A running job holds a lease renewed by a heartbeat; a job whose lease ran
out is taken again. At open, the queue takes an exclusive lock file, so any job still marked running belongs
to a dead process and is taken again at once, without spending an attempt (up to ``queue_db.ORPHAN_LIMIT``
deaths). All SQLite calls run on one dedicated thread.

Every error of the queue is a ``JobError`` (a ``MemoryLayerError``): the SQLite database's own errors are
mapped at the queue's boundary to ``QueueDatabaseError`` (the ``sqlite3`` error is its ``__cause__``, so
``is_storage_fault`` still recognises a disk fault through it).
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Mapping
from enum import StrEnum
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, field_validator

from proxy.memory.errors import MemoryLayerError

# Jobs in flight for these kinds instead of ``concurrency`` (``JobQueueTuning.kind_concurrency``'s defaults).
KIND_CONCURRENCY: Mapping[str, int] = {"exchange": 128, "insights": 2}
LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class JobQueueTuning(BaseModel):
    """``[jobs]``: how the job queue retries, leases and runs jobs (its database is ``jobs.sqlite3`` in the data
    directory)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_attempts: int = Field(default=5, ge=1)
    backoff_base_s: float = Field(default=1.0, gt=0)
    backoff_max_s: float = Field(default=300.0, gt=0)
    lease_s: float = Field(default=60.0, gt=0)
    concurrency: int = Field(default=16, ge=1)  # jobs in flight per kind
    # ...except these kinds. Exchange jobs mostly wait for the store's next batched commit: the more of them in
    # flight, the more turns one commit carries (at 16, a sustained chat load outran them 4 to 1). Insights jobs
    # (a user's turns read and clustered) run in the writer beside the exchanges and nothing waits for them: the
    # first wave of a busy start (every user's comes due one debounce later) ran 16 at a time and held the
    # exchanges back (bench-writes: reply -> searchable p99 ~5 s in that minute of every 30-minute run).
    kind_concurrency: dict[str, Annotated[int, Field(ge=1)]] = Field(default_factory=lambda: dict(KIND_CONCURRENCY))

    @field_validator("kind_concurrency")
    @classmethod
    def _over_defaults(cls, value: dict[str, int]) -> dict[str, int]:
        """A table given in the config changes the kinds it names; the others keep their defaults."""
        return {**KIND_CONCURRENCY, **value}

    def concurrency_of(self, kind: str) -> int:
        """Jobs of ``kind`` that may run at once."""
        return self.kind_concurrency.get(kind, self.concurrency)

    poll_interval_s: float = Field(default=1.0, gt=0)
    job_timeout_s: float = Field(default=300.0, gt=0)
    drain_timeout_s: float = Field(default=10.0, ge=0)
    debounce_max_delay_s: float = Field(default=3600.0, gt=0)
    done_retention_s: float = Field(default=86400.0, ge=0)
    waiting_recheck_s: float = Field(default=900.0, gt=0)  # a job waiting for a key/configuration looks again


class JobQueueSettings(JobQueueTuning):
    """Where the queue lives, and how it retries, leases and runs jobs."""

    path: Path


class JobError(MemoryLayerError):
    """Base of the job queue's errors."""


class QueueLocked(JobError):
    """Another live process already owns this queue's data directory."""


class QueueDatabaseError(JobError):
    """The queue's SQLite database failed (the ``sqlite3`` error is the ``__cause__``; its text is the message)."""


class RetryLater(JobError):
    """Raised by a handler when a dependency is down: wait (backoff) without spending an attempt."""


class GiveUp(JobError):
    """Raised by a handler when retrying cannot help: the job goes to the dead letters at once."""


class WaitForConfig(JobError):
    """Raised by a handler when only a key or configuration change can help: the job waits (see the module doc)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


class JobState(StrEnum):
    """Where a job is in its life."""

    PENDING = "pending"
    RUNNING = "running"
    DONE = "done"
    DEAD = "dead"


def backoff_delay(attempt: int, base_s: float, max_s: float, rng: random.Random) -> float:
    """Exponential backoff with equal jitter: half of the capped delay fixed, half random."""
    ceiling = min(max_s, base_s * 2.0 ** min(attempt - 1, 60))
    return ceiling / 2 + rng.uniform(0.0, ceiling / 2)


@dataclasses.dataclass
class StepLatency:
    """Latency of one named step: count, sum, max and per-bucket counts (upper bounds in seconds)."""

    count: int = 0
    sum_s: float = 0.0
    max_s: float = 0.0
    buckets: list[int] = dataclasses.field(default_factory=lambda: [0] * len(LATENCY_BUCKETS_S))

    def observe(self, seconds: float) -> None:
        """Count one observation."""
        self.count += 1
        self.sum_s += seconds
        self.max_s = max(self.max_s, seconds)
        for i, bound in enumerate(LATENCY_BUCKETS_S):
            if seconds <= bound:
                self.buckets[i] += 1
                break


@dataclasses.dataclass(frozen=True)
class QueueMetrics:
    """A snapshot of the queue as plain numbers (the app maps them to Prometheus)."""

    ready: int
    scheduled: int
    running: int
    dead: int
    oldest_age_s: float
    depth_by_kind: Mapping[str, int]
    completed_total: int
    failed_total: int
    deferred_total: int
    dead_total: int
    step_latency: Mapping[str, StepLatency]
    waiting: Mapping[str, int] = dataclasses.field(default_factory=dict)  # pending jobs waiting, by reason
    waits_total: Mapping[str, int] = dataclasses.field(default_factory=dict)  # times jobs started waiting

    @property
    def depth(self) -> int:
        """Jobs not yet finished: ready, scheduled for later, or running."""
        return self.ready + self.scheduled + self.running
