"""Durable job queue for the write path: SQLite in WAL mode in the data dir, leases, retries, dead letters.

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
to a dead process and is taken again at once, without spending an attempt (up to ``ORPHAN_LIMIT``
deaths). All SQLite calls run on one dedicated thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import fcntl
import functools
import json
import os
import random
import sqlite3
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from enum import StrEnum
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import structlog
from pydantic import BaseModel, ConfigDict, Field

from proxy.memory.errors import MemoryLayerError
from proxy.memory.faults import StorageHealth, is_storage_fault
from proxy.memory.migrations import JOBS_SCHEMA_VERSION, JOBS_STEPS, ensure_jobs_schema, plan
from proxy.memory.write.group_commit import GroupCommit

log = structlog.get_logger("memproxy.jobs")

T = TypeVar("T")
JSON = dict[str, Any]
LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class JobQueueSettings(BaseModel):
    """Where the queue lives and how it retries, leases and runs jobs."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    path: Path
    max_attempts: int = Field(default=5, ge=1)
    backoff_base_s: float = Field(default=1.0, gt=0)
    backoff_max_s: float = Field(default=300.0, gt=0)
    lease_s: float = Field(default=60.0, gt=0)
    concurrency: int = Field(default=16, ge=1)  # jobs in flight per kind
    poll_interval_s: float = Field(default=1.0, gt=0)
    job_timeout_s: float = Field(default=300.0, gt=0)
    drain_timeout_s: float = Field(default=10.0, ge=0)
    debounce_max_delay_s: float = Field(default=3600.0, gt=0)
    done_retention_s: float = Field(default=86400.0, ge=0)
    waiting_recheck_s: float = Field(default=900.0, gt=0)  # a job waiting for a key/configuration looks again


class JobError(MemoryLayerError):
    """Base of the job queue's errors."""


class QueueLocked(JobError):
    """Another live process already owns this queue's data directory."""


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


_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    kind TEXT NOT NULL,
    user_id TEXT NOT NULL,
    payload TEXT NOT NULL,
    dedupe_key TEXT,
    state TEXT NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0,
    deferrals INTEGER NOT NULL DEFAULT 0,
    run_after REAL NOT NULL,
    first_trigger REAL NOT NULL,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    lease_owner TEXT,
    lease_until REAL,
    progress TEXT NOT NULL DEFAULT '{}',
    last_error TEXT,
    orphaned INTEGER NOT NULL DEFAULT 0
);
CREATE UNIQUE INDEX IF NOT EXISTS jobs_debounce ON jobs(user_id, kind, dedupe_key)
    WHERE state = 'pending' AND dedupe_key IS NOT NULL;
CREATE INDEX IF NOT EXISTS jobs_due ON jobs(state, run_after);
CREATE INDEX IF NOT EXISTS jobs_lane ON jobs(user_id, kind, state, seq);
CREATE TABLE IF NOT EXISTS job_state (
    user_id TEXT NOT NULL,
    key TEXT NOT NULL,
    value TEXT NOT NULL,
    PRIMARY KEY (user_id, key)
);
"""

_CANDIDATES = """
SELECT * FROM jobs AS j
WHERE j.state = 'pending' AND j.run_after <= :now AND j.kind = :kind
  AND NOT EXISTS (SELECT 1 FROM jobs AS r
                  WHERE r.user_id = j.user_id AND r.kind = j.kind AND r.state = 'running')
  AND (j.dedupe_key IS NOT NULL OR NOT EXISTS (
        SELECT 1 FROM jobs AS e
        WHERE e.user_id = j.user_id AND e.kind = j.kind AND e.state = 'pending'
          AND e.dedupe_key IS NULL AND e.seq < j.seq))
ORDER BY j.run_after, j.seq
LIMIT :limit
"""

# At open, every job still marked running was interrupted by the death of the process running it (we hold the
# lock). That is not the job's failure, so the attempt is given back: a crash storm (20 kill -9 in a minute,
# the reads starving the job meanwhile) must not dead-letter an answered exchange. Only a job that was running
# at ORPHAN_LIMIT process deaths is taken for a poison pill (it may be what kills the process).
ORPHAN_LIMIT = 25
_RECLAIM_ORPHANS = """
UPDATE jobs SET
    state = CASE WHEN orphaned + 1 >= :limit THEN 'dead' ELSE 'pending' END,
    attempts = MAX(attempts - 1, 0), orphaned = orphaned + 1,
    last_error = 'orphaned: the process running it died (' || (orphaned + 1) || ' times)',
    lease_owner = NULL, lease_until = NULL, updated_at = :now, run_after = MIN(run_after, :now)
WHERE state = 'running'
"""

_EXPIRE_LEASES = """
UPDATE jobs SET
    state = CASE WHEN attempts >= :max THEN 'dead' ELSE 'pending' END,
    last_error = 'lease expired: the worker holding it stopped',
    lease_owner = NULL, lease_until = NULL, updated_at = :now
WHERE state = 'running' AND (lease_until < :now OR lease_owner != :owner)
"""

# A debounced job going back to pending while a newer pending job holds its (user, kind, key) would break the
# one-pending-per-key index (and, at open, stop memproxy from starting). The pending twin is folded into it:
# the job going back keeps its id (a facts window marks the exchanges it took with its job id, possibly before
# its first checkpoint), takes the twin's newer payload, and runs no later than the twin would have.
_TWINS = """
SELECT j.id AS id, t.id AS twin, t.payload AS payload, t.run_after AS run_after FROM jobs AS j
JOIN jobs AS t ON t.user_id = j.user_id AND t.kind = j.kind AND t.dedupe_key = j.dedupe_key
                  AND t.state = 'pending'
WHERE j.state = 'running' AND j.dedupe_key IS NOT NULL AND {where}
"""

_GAUGES = """
SELECT
    COALESCE(SUM(state = 'pending' AND run_after <= :now), 0),
    COALESCE(SUM(state = 'pending' AND run_after > :now), 0),
    COALESCE(SUM(state = 'running'), 0),
    COALESCE(SUM(state = 'dead'), 0),
    MIN(CASE WHEN state = 'running' OR (state = 'pending' AND run_after <= :now)
             THEN CASE WHEN dedupe_key IS NULL THEN created_at ELSE run_after END END)
FROM jobs
"""


class _Db:
    """The SQLite side of the queue; every method runs on the queue's single thread."""

    def __init__(self, settings: JobQueueSettings) -> None:
        self.settings = settings
        self.conn: sqlite3.Connection | None = None
        self.lock_fd: int | None = None

    @property
    def c(self) -> sqlite3.Connection:
        assert self.conn is not None, "queue is not open"
        return self.conn

    def open(self) -> None:
        self.settings.path.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.settings.path / "jobs.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise QueueLocked(f"the job queue in {self.settings.path} is owned by another process") from None
        self.lock_fd = fd
        conn = sqlite3.connect(self.settings.path / "jobs.sqlite3", isolation_level=None)
        conn.row_factory = sqlite3.Row
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.execute("PRAGMA busy_timeout=5000")
        try:  # a newer database is refused before it is touched; an older one is migrated forward
            plan("job database", conn.execute("PRAGMA user_version").fetchone()[0], JOBS_SCHEMA_VERSION, JOBS_STEPS)
            conn.executescript(_SCHEMA)
            ensure_jobs_schema(conn)
        except BaseException:
            conn.close()
            self.close()
            raise
        self.conn = conn

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None
        if self.lock_fd is not None:
            os.close(self.lock_fd)
            self.lock_fd = None

    @contextlib.contextmanager
    def txn(self, *, durable: bool = False) -> Iterator[sqlite3.Connection]:
        """One write transaction; ``durable`` makes its commit fsync before returning."""
        if durable:
            self.c.execute("PRAGMA synchronous=FULL")
        self.c.execute("BEGIN IMMEDIATE")
        try:
            yield self.c
        except BaseException:
            self.c.execute("ROLLBACK")
            raise
        else:
            self.c.execute("COMMIT")
        finally:
            if durable:
                self.c.execute("PRAGMA synchronous=NORMAL")

    def enqueue_many(self, items: Sequence[tuple[JSON, str | None]]) -> list[str | BaseException]:
        """Several enqueues in one durable transaction (one fsync); each in its own savepoint."""
        results: list[str | BaseException] = []
        with self.txn(durable=True) as c:
            for row, job_id in items:
                c.execute("SAVEPOINT one")
                try:
                    results.append(self._enqueue_one(c, row, job_id))
                except sqlite3.IntegrityError as error:
                    c.execute("ROLLBACK TO one")
                    results.append(error)
                c.execute("RELEASE one")
        return results

    def enqueue(self, row: JSON, job_id: str | None, durable: bool) -> str:
        """One enqueue in its own transaction (``durable=False``: no fsync; see ``JobQueue.enqueue``)."""
        with self.txn(durable=durable) as c:
            return self._enqueue_one(c, row, job_id)

    def _enqueue_one(self, c: sqlite3.Connection, row: JSON, job_id: str | None) -> str:
        if job_id is not None and c.execute("SELECT 1 FROM jobs WHERE id = ?", (job_id,)).fetchone():
            return job_id
        if row["dedupe_key"] is not None:
            existing = self._debounce(c, row)
            if existing is not None:
                return existing
        c.execute(
            "INSERT INTO jobs (id, kind, user_id, payload, dedupe_key, state, run_after, first_trigger,"
            " created_at, updated_at) VALUES (:id, :kind, :user_id, :payload, :dedupe_key, 'pending',"
            " :run_after, :now, :now, :now)",
            row,
        )
        return str(row["id"])

    def retry_storage_deferred(self, now: float) -> int:
        """Make jobs that wait out a storage fault due now (the disk works again)."""
        with self.txn() as c:
            return c.execute(
                "UPDATE jobs SET run_after = ? WHERE state = 'pending' AND run_after > ?"
                " AND last_error LIKE 'storage fault:%'",
                (now, now),
            ).rowcount

    def _debounce(self, c: sqlite3.Connection, row: JSON) -> str | None:
        found = c.execute(
            "SELECT id, first_trigger FROM jobs WHERE user_id = ? AND kind = ? AND dedupe_key = ?"
            " AND state = 'pending'",
            (row["user_id"], row["kind"], row["dedupe_key"]),
        ).fetchone()
        if found is None:
            return None
        run_after = min(row["run_after"], found["first_trigger"] + self.settings.debounce_max_delay_s)
        c.execute(
            "UPDATE jobs SET run_after = ?, payload = ?, updated_at = ? WHERE id = ?",
            (run_after, row["payload"], row["now"], found["id"]),
        )
        return str(found["id"])

    def reclaim_orphans(self, owner: str, now: float) -> int:
        """Take back jobs left running by a process that is gone (we hold the lock, so all of them)."""
        with self.txn() as c:
            self._fold_twins(c, "TRUE", {})  # the orphans run at once (_RECLAIM_ORPHANS), no later than a twin
            return c.execute(_RECLAIM_ORPHANS, {"limit": ORPHAN_LIMIT, "now": now}).rowcount

    def _fold_twins(self, c: sqlite3.Connection, where: str, params: JSON) -> float | None:
        """Fold the pending twins of running debounced jobs matching ``where`` into them (see ``_TWINS``); the
        earliest run time of a folded twin, or None when there was none."""
        pairs = c.execute(_TWINS.format(where=where), params).fetchall()
        for row in pairs:
            c.execute(
                "UPDATE jobs SET state = 'done', payload = '{}', last_error = ?, updated_at = ? WHERE id = ?",
                (f"folded into job {row['id']}", time.time(), row["twin"]),
            )
            c.execute("UPDATE jobs SET payload = ? WHERE id = ?", (row["payload"], row["id"]))
        return min((float(row["run_after"]) for row in pairs), default=None)

    def claim(self, limits: Mapping[str, int], owner: str, now: float) -> tuple[list[sqlite3.Row], float]:
        """Due jobs marked running, at most ``limits[kind]`` per kind and one per lane; and the next due time."""
        picked: list[sqlite3.Row] = []
        with self.txn() as c:
            self._expire(c, owner, now)
            for kind, limit in limits.items():
                if limit > 0:
                    rows = c.execute(_CANDIDATES, {"now": now, "kind": kind, "limit": limit * 8 + 8}).fetchall()
                    picked += _one_per_lane(rows, limit)
            lease_until = now + self.settings.lease_s
            for row in picked:
                c.execute(
                    "UPDATE jobs SET state = 'running', attempts = attempts + 1, lease_owner = ?,"
                    " lease_until = ?, updated_at = ?, waiting = NULL WHERE seq = ?",
                    (owner, lease_until, now, row["seq"]),
                )
            marks = ",".join("?" * len(limits))
            nxt = c.execute(
                f"SELECT MIN(run_after) FROM jobs WHERE state = 'pending' AND kind IN ({marks})",  # noqa: S608
                tuple(limits),
            ).fetchone()[0]
        return picked, float(nxt) if nxt is not None else float("inf")

    def _expire(self, c: sqlite3.Connection, owner: str, now: float) -> None:
        self._fold_twins(c, "j.lease_until < :now", {"now": now})
        c.execute(
            _EXPIRE_LEASES.replace("OR lease_owner != :owner", ""),
            {"max": self.settings.max_attempts, "now": now},
        )

    def renew(self, ids: Sequence[str], owner: str, until: float) -> None:
        with self.txn() as c:
            c.executemany(
                "UPDATE jobs SET lease_until = ? WHERE id = ? AND state = 'running' AND lease_owner = ?",
                [(until, job_id, owner) for job_id in ids],
            )

    def finish(self, job_id: str, owner: str, changes: JSON) -> bool:
        """Apply ``changes`` to a job this owner holds; False if it is no longer ours (e.g. forgotten)."""
        cols = ", ".join(f"{name} = :{name}" for name in changes)
        with self.txn() as c:
            if changes.get("state") == "pending":
                where = "j.id = :job_id AND j.lease_owner = :owner"
                twin_due = self._fold_twins(c, where, {"job_id": job_id, "owner": owner})
                if twin_due is not None:
                    changes = {**changes, "run_after": min(float(changes["run_after"]), twin_due)}
                    cols = ", ".join(f"{name} = :{name}" for name in changes)
            cur = c.execute(
                f"UPDATE jobs SET {cols}, lease_owner = NULL, lease_until = NULL"  # noqa: S608 - fixed names
                " WHERE id = :job_id AND state = 'running' AND lease_owner = :owner",
                {**changes, "job_id": job_id, "owner": owner},
            )
            return cur.rowcount == 1

    def save_progress(self, job_id: str, owner: str, progress: str) -> None:
        with self.txn() as c:
            c.execute(
                "UPDATE jobs SET progress = ? WHERE id = ? AND state = 'running' AND lease_owner = ?",
                (progress, job_id, owner),
            )

    def purge_done(self, before: float) -> int:
        with self.txn() as c:
            return c.execute("DELETE FROM jobs WHERE state = 'done' AND updated_at < ?", (before,)).rowcount

    def forget_user(self, user_id: str, running_too: bool) -> int:
        with self.txn() as c:
            states = "" if running_too else " AND state != 'running'"
            count = c.execute(f"DELETE FROM jobs WHERE user_id = ?{states}", (user_id,)).rowcount  # noqa: S608
            c.execute("DELETE FROM job_state WHERE user_id = ?", (user_id,))
            return count

    def gauges(self, now: float) -> tuple[tuple[Any, ...], dict[str, int]]:
        totals = tuple(self.c.execute(_GAUGES, {"now": now}).fetchone())
        by_kind = self.c.execute(
            "SELECT kind, COUNT(*) FROM jobs WHERE state IN ('pending', 'running') GROUP BY kind"
        ).fetchall()
        return totals, {str(kind): int(n) for kind, n in by_kind}

    def waiting_counts(self) -> dict[str, int]:
        rows = self.c.execute(
            "SELECT waiting, COUNT(*) FROM jobs WHERE state = 'pending' AND waiting IS NOT NULL GROUP BY waiting"
        ).fetchall()
        return {str(reason): int(n) for reason, n in rows}

    def resume_waiting(self, user_id: str, now: float) -> int:
        with self.txn() as c:
            return c.execute(
                "UPDATE jobs SET run_after = ?, updated_at = ? WHERE user_id = ? AND state = 'pending'"
                " AND waiting IS NOT NULL AND run_after > ?",
                (now, now, user_id, now),
            ).rowcount

    def dead_letters(self, limit: int) -> list[JSON]:
        rows = self.c.execute(
            "SELECT id, kind, user_id, attempts, created_at, updated_at, last_error FROM jobs"
            " WHERE state = 'dead' ORDER BY updated_at DESC LIMIT ?",
            (limit,),
        ).fetchall()
        return [dict(row) for row in rows]

    def requeue(self, job_id: str, now: float) -> bool:
        with self.txn() as c:
            cur = c.execute(
                "UPDATE jobs SET state = 'pending', attempts = 0, deferrals = 0, run_after = ?,"
                " updated_at = ? WHERE id = ? AND state = 'dead'",
                (now, now, job_id),
            )
            return cur.rowcount == 1

    def job_row(self, job_id: str) -> JSON | None:
        row = self.c.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return dict(row) if row is not None else None

    def get_state(self, user_id: str, key: str) -> JSON | None:
        row = self.c.execute("SELECT value FROM job_state WHERE user_id = ? AND key = ?", (user_id, key)).fetchone()
        return json.loads(row[0]) if row is not None else None

    def update_state(self, user_id: str, key: str, fn: Callable[[JSON | None], JSON | None]) -> JSON | None:
        with self.txn() as c:
            row = c.execute("SELECT value FROM job_state WHERE user_id = ? AND key = ?", (user_id, key)).fetchone()
            new = fn(json.loads(row[0]) if row is not None else None)
            if new is None:
                c.execute("DELETE FROM job_state WHERE user_id = ? AND key = ?", (user_id, key))
            else:
                c.execute(
                    "INSERT INTO job_state (user_id, key, value) VALUES (?, ?, ?)"
                    " ON CONFLICT (user_id, key) DO UPDATE SET value = excluded.value",
                    (user_id, key, json.dumps(new)),
                )
            return new


def _one_per_lane(rows: Sequence[sqlite3.Row], limit: int) -> list[sqlite3.Row]:
    lanes: set[tuple[str, str]] = set()
    picked: list[sqlite3.Row] = []
    for row in rows:
        lane = (row["user_id"], row["kind"])
        if lane in lanes:
            continue
        lanes.add(lane)
        picked.append(row)
        if len(picked) == limit:
            break
    return picked


class JobQueue:
    """The durable queue: enqueue, claim, finish, metrics and per-user state, all off the event loop."""

    def __init__(self, settings: JobQueueSettings, *, rng: random.Random | None = None,
                 health: StorageHealth | None = None) -> None:
        self.settings = settings
        self.owner = uuid.uuid4().hex
        self.health = health or StorageHealth()
        self._db = _Db(settings)
        self._commits: GroupCommit[tuple[JSON, str | None], str] = GroupCommit(self._write_enqueues)
        self._executor: ThreadPoolExecutor | None = None
        self._rng = rng or random.Random()
        self._wake: asyncio.Event | None = None
        self._forget_hooks: list[Callable[[str], Awaitable[None]]] = []
        self._steps: dict[str, StepLatency] = {}
        self._totals = {"completed": 0, "failed": 0, "deferred": 0, "dead": 0}
        self._waits: Counter[str] = Counter()

    async def __aenter__(self) -> JobQueue:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="memproxy-jobs")
        self._wake = asyncio.Event()
        try:
            await self._call(self._db.open)
            reclaimed = await self._call(self._db.reclaim_orphans, self.owner, time.time())
        except BaseException:
            await self._shutdown()
            raise
        if reclaimed:
            log.info("jobs.reclaimed", count=reclaimed)
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self._shutdown()

    async def _shutdown(self) -> None:
        if self._executor is None:
            return
        await self._commits.aclose()
        await self._call(self._db.close)
        self._executor.shutdown(wait=True)
        self._executor = None

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        if self._executor is None:
            raise JobError("the job queue is not open")
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

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
        except (sqlite3.Error, OSError) as error:
            if is_storage_fault(error):
                self.health.fault("queue", error)
            raise
        self.health.ok("queue")
        return results

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

    async def claim(self, limits: Mapping[str, int]) -> tuple[list[Job], float]:
        """Claim due jobs, up to ``limits[kind]`` of each kind (one per lane); also when the next one is due."""
        rows, next_due = await self._call(self._db.claim, dict(limits), self.owner, time.time())
        return [self._job(row) for row in rows], next_due

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
        changes = {"state": "pending", "attempts": job.attempt - 1, "run_after": now + self.settings.waiting_recheck_s,
                   "updated_at": now, "last_error": f"waiting ({reason}): {detail}"[:1000], "waiting": reason}
        await self._finish(job, changes)
        self._waits[reason] += 1

    async def resume_waiting(self, user_id: str) -> int:
        """Make the user's waiting jobs due now (something they waited for may have arrived); returns how many."""
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


Handler = Callable[[Job], Awaitable[None]]


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
        free = {kind: self._settings.concurrency - busy[kind] for kind in self._handlers}
        if not any(n > 0 for n in free.values()):
            return float("inf")
        try:
            await self._settle()
            jobs, next_due = await self._queue.claim(free)
            await self._purge_now_and_then()
        except (sqlite3.Error, OSError, JobError) as error:
            self._queue_failed("jobs.claim_failed", error)
            return time.time() + self._settings.poll_interval_s
        if jobs:  # a claim that found nothing may have written nothing: no proof that the disk works again
            self._health.ok("queue")
        for job in jobs:
            self._inflight[job.id] = (job, group.create_task(self._run_one(job), name=f"job-{job.id}"))
        return next_due

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
            except (sqlite3.Error, OSError) as error:
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
            with structlog.contextvars.bound_contextvars(job_id=job.id, job_kind=job.kind, request_id=request_id):
                await self._attempt(job)
        except asyncio.CancelledError:
            await asyncio.shield(self._release_quietly(job))
            raise
        except (sqlite3.Error, OSError, JobError) as error:
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
            log.warning("job.waiting", reason=error.reason, detail=str(error)[:300],
                        recheck_in_s=self._settings.waiting_recheck_s)
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
        except (sqlite3.Error, OSError, JobError) as error:
            log.warning("jobs.release_failed", error=repr(error))
