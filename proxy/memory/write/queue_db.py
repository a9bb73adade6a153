"""The job queue's SQLite database: schema, lock file, and every statement (run on the queue's one thread).

``JobDatabase`` is synchronous and owned by ``JobQueue``, which runs each of its methods on a single dedicated
thread and maps SQLite's errors to its own (see ``job_types``).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import sqlite3
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from proxy.memory.store.migrations import JOBS_SCHEMA_VERSION, JOBS_STEPS, ensure_jobs_schema, plan
from proxy.memory.write.job_types import JobQueueSettings, QueueLocked

JSON = dict[str, Any]

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
-- claims look for one kind's due jobs: without the kind in the index, a claim of facts jobs walked every due
-- exchange job (a cost that grew with the queue, on the queue's one thread: the write side stalled under load)
CREATE INDEX IF NOT EXISTS jobs_due_kind ON jobs(state, kind, run_after);
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


class JobDatabase:
    """The SQLite side of the queue; every method runs on the queue's single thread."""

    def __init__(self, settings: JobQueueSettings, *, producer: bool = False) -> None:
        """``producer``: a chat process's connection, which only enqueues; the memory writer process owns the
        queue (its lock, migrations, claims)."""
        self.settings = settings
        self.producer = producer
        self.conn: sqlite3.Connection | None = None
        self.lock_fd: int | None = None

    @property
    def c(self) -> sqlite3.Connection:
        assert self.conn is not None, "queue is not open"
        return self.conn

    def open(self) -> None:
        if self.producer:
            self.conn = _connect(self.settings.path / "jobs.sqlite3")
            found = self.conn.execute("PRAGMA user_version").fetchone()[0]
            if found != JOBS_SCHEMA_VERSION:
                self.close()
                raise QueueLocked(f"the job queue in {self.settings.path} is not ready (schema {found})")
            return
        self.settings.path.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.settings.path / "jobs.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise QueueLocked(f"the job queue in {self.settings.path} is owned by another process") from None
        self.lock_fd = fd
        conn = _connect(self.settings.path / "jobs.sqlite3")
        try:  # a newer database is refused before it is touched; an older one is migrated forward
            plan("job database", conn.execute("PRAGMA user_version").fetchone()[0], JOBS_SCHEMA_VERSION, JOBS_STEPS)
            conn.executescript(_SCHEMA)
            ensure_jobs_schema(conn)
        except BaseException:
            conn.close()
            self.close()
            raise
        self.conn = conn

    def data_version(self) -> int:
        """SQLite's count of commits by other connections (the chat processes' enqueues)."""
        return int(self.c.execute("PRAGMA data_version").fetchone()[0])

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


def _connect(path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None)
    conn.row_factory = sqlite3.Row
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")
    conn.execute("PRAGMA busy_timeout=5000")
    return conn


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
