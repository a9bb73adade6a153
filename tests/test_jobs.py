"""The durable job queue: durability, ordering, retries, dead letters, leases, debouncing, forget, metrics."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import sqlite3
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.memory.errors import MemoryLayerError
from proxy.memory.write.job_types import (
    GiveUp,
    JobQueueSettings,
    QueueDatabaseError,
    QueueLocked,
    RetryLater,
    backoff_delay,
)
from proxy.memory.write.queue import Job, JobQueue
from proxy.memory.write.queue_db import _CANDIDATES
from proxy.memory.write.runner import JobRunner
from tests.support import polling


def settings(path: Path, **changes: object) -> JobQueueSettings:
    """Fast settings for tests."""
    values: dict[str, object] = {
        "path": path,
        "backoff_base_s": 0.01,
        "backoff_max_s": 0.05,
        "poll_interval_s": 0.05,
        "drain_timeout_s": 0.5,
    }
    values.update(changes)
    return JobQueueSettings.model_validate(values)


async def eventually(check: Callable[[], Awaitable[bool]], within_s: float = 5.0) -> None:
    """Wait until ``check`` is true, or fail (polled every 10 ms)."""
    await polling.eventually(check, within_s, every_s=0.01)


async def state_of(queue: JobQueue, job_id: str) -> str | None:
    """The job's state, or None when it is gone."""
    row = await queue.get(job_id)
    return None if row is None else str(row["state"])


async def test_enqueued_job_survives_reopen(tmp_path: Path) -> None:
    """A job whose enqueue returned is still there, with its payload, after the queue is closed and opened."""
    async with JobQueue(settings(tmp_path)) as queue:
        job_id = await queue.enqueue("exchange", "u1", {"text": "hello"})
    async with JobQueue(settings(tmp_path)) as queue:
        seen: list[dict[str, object]] = []

        async def handler(job: Job) -> None:
            seen.append(job.payload)

        async with JobRunner(queue, {"exchange": handler}):
            await eventually(lambda: state_is(queue, job_id, "done"))
    assert seen == [{"text": "hello"}]


async def state_is(queue: JobQueue, job_id: str, state: str | None) -> bool:
    """Whether the job is in ``state``."""
    return await state_of(queue, job_id) == state


async def test_one_user_in_order_users_in_parallel(tmp_path: Path) -> None:
    """Jobs of one user run one at a time in enqueue order, while different users run at the same time."""
    running: dict[str, int] = defaultdict(int)
    order: dict[str, list[int]] = defaultdict(list)
    overlap = {"same_user": 0, "max_parallel": 0}

    async def handler(job: Job) -> None:
        running[job.user_id] += 1
        overlap["same_user"] = max(overlap["same_user"], running[job.user_id])
        overlap["max_parallel"] = max(overlap["max_parallel"], sum(running.values()))
        await asyncio.sleep(random.uniform(0.001, 0.01))
        order[job.user_id].append(int(job.payload["n"]))
        running[job.user_id] -= 1

    async with JobQueue(settings(tmp_path, concurrency=3)) as queue:
        for n in range(8):
            for user in ("a", "b", "c"):
                await queue.enqueue("exchange", user, {"n": n})
        async with JobRunner(queue, {"exchange": handler}):
            await eventually(lambda: all_done(order, 3, 8))
    assert overlap["same_user"] == 1
    assert overlap["max_parallel"] >= 2
    assert all(seq == list(range(8)) for seq in order.values())


async def all_done(order: dict[str, list[int]], users: int, each: int) -> bool:
    """Whether every user's jobs have all run."""
    return len(order) == users and all(len(seq) == each for seq in order.values())


async def test_failures_retry_with_backoff_then_succeed(tmp_path: Path) -> None:
    """A handler that fails twice is retried after growing delays and the job finally completes."""
    attempts: list[float] = []

    async def handler(job: Job) -> None:
        attempts.append(time.monotonic())
        if len(attempts) < 3:
            raise RuntimeError("transient bug")

    async with JobQueue(settings(tmp_path, backoff_base_s=0.1, backoff_max_s=1.0)) as queue:
        job_id = await queue.enqueue("exchange", "u1", {})
        async with JobRunner(queue, {"exchange": handler}):
            await eventually(lambda: state_is(queue, job_id, "done"))
        metrics = await queue.metrics()
    gaps = [b - a for a, b in itertools.pairwise(attempts)]
    assert len(attempts) == 3
    assert gaps[0] >= 0.05
    assert gaps[1] >= 0.1
    assert metrics.failed_total == 2
    assert metrics.completed_total == 1


async def test_dead_letter_after_max_attempts_and_lane_moves_on(tmp_path: Path) -> None:
    """A job failing every time ends dead with its error, and the user's next job still runs."""
    ran: list[str] = []

    async def handler(job: Job) -> None:
        ran.append(job.payload["name"])
        if job.payload["name"] == "poison":
            raise ValueError("cannot parse this payload")

    async with JobQueue(settings(tmp_path, max_attempts=3)) as queue:
        poison = await queue.enqueue("exchange", "u1", {"name": "poison"})
        good = await queue.enqueue("exchange", "u1", {"name": "good"})
        async with JobRunner(queue, {"exchange": handler}):
            await eventually(lambda: state_is(queue, good, "done"))
        dead = await queue.dead_letters()
        metrics = await queue.metrics()
    assert ran == ["poison", "poison", "poison", "good"]
    assert [d["id"] for d in dead] == [poison]
    assert "cannot parse this payload" in dead[0]["last_error"]
    assert metrics.dead == 1
    assert metrics.dead_total == 1


async def test_give_up_dead_letters_at_once_and_requeue_revives(tmp_path: Path) -> None:
    """``GiveUp`` sends a job to the dead letters on its first attempt; ``requeue`` runs it again."""
    calls: list[int] = []

    async def handler(job: Job) -> None:
        calls.append(job.attempt)
        if len(calls) == 1:
            raise GiveUp("payload from an old version")

    async with JobQueue(settings(tmp_path)) as queue:
        job_id = await queue.enqueue("exchange", "u1", {})
        async with JobRunner(queue, {"exchange": handler}):
            await eventually(lambda: state_is(queue, job_id, "dead"))
            assert await queue.requeue(job_id)
            await eventually(lambda: state_is(queue, job_id, "done"))
    assert calls == [1, 1]


async def test_retry_later_waits_without_spending_attempts(tmp_path: Path) -> None:
    """A job whose dependency is down waits as long as it takes (more rounds than max_attempts), then runs."""
    rounds: list[int] = []

    async def handler(job: Job) -> None:
        rounds.append(job.attempt)
        if len(rounds) < 6:
            raise RetryLater("memory LLM unreachable")

    async with JobQueue(settings(tmp_path, max_attempts=2)) as queue:
        job_id = await queue.enqueue("exchange", "u1", {})
        async with JobRunner(queue, {"exchange": handler}):
            await eventually(lambda: state_is(queue, job_id, "done"))
        metrics = await queue.metrics()
    assert rounds == [1] * 6
    assert metrics.deferred_total == 5
    assert metrics.dead_total == 0


async def test_worker_survives_crashing_and_hanging_handlers(tmp_path: Path) -> None:
    """Handlers that raise or hang past the job timeout never stop the worker: later jobs still run."""
    done: list[str] = []

    async def handler(job: Job) -> None:
        kind = job.payload["kind"]
        if kind == "raise":
            raise KeyError("missing field")
        if kind == "hang":
            await asyncio.sleep(60)
        done.append(job.user_id)

    async with JobQueue(settings(tmp_path, max_attempts=1, job_timeout_s=0.2)) as queue:
        await queue.enqueue("exchange", "u1", {"kind": "raise"})
        await queue.enqueue("exchange", "u2", {"kind": "hang"})
        await queue.enqueue("exchange", "u3", {"kind": "ok"})
        later = await queue.enqueue("exchange", "u2", {"kind": "ok"})
        async with JobRunner(queue, {"exchange": handler}):
            await eventually(lambda: state_is(queue, later, "done"))
        dead = await queue.dead_letters()
    assert sorted(done) == ["u2", "u3"]
    assert sorted(d["last_error"].split(":")[0] for d in dead) == ["KeyError", "timeout"]


async def test_debounced_enqueue_collapses_and_pushes(tmp_path: Path) -> None:
    """Enqueueing the same debounce key while pending keeps one job, pushed later, with the last payload."""
    async with JobQueue(settings(tmp_path, debounce_max_delay_s=100.0)) as queue:
        now = time.time()
        first = await queue.enqueue("insights", "u1", {"n": 1}, dedupe_key="insights", run_after=now + 10)
        second = await queue.enqueue("insights", "u1", {"n": 2}, dedupe_key="insights", run_after=now + 20)
        other = await queue.enqueue("insights", "u2", {"n": 1}, dedupe_key="insights", run_after=now + 20)
        capped = await queue.enqueue("insights", "u1", {"n": 3}, dedupe_key="insights", run_after=now + 500)
        row = await queue.get(first)
        metrics = await queue.metrics()
    assert first == second == capped != other
    assert row is not None
    assert row["payload"] == '{"n":3}'
    assert now + 99 < row["run_after"] <= now + 101  # pushed, but never past the max delay
    assert metrics.scheduled == 2
    assert metrics.ready == 0


async def test_debounced_job_does_not_block_lane(tmp_path: Path) -> None:
    """A summary scheduled for later does not hold up the user's ordinary jobs of the same kind."""
    ran: list[str] = []

    async def handler(job: Job) -> None:
        ran.append(job.payload["name"])

    async with JobQueue(settings(tmp_path)) as queue:
        await queue.enqueue("summary", "u1", {"name": "later"}, dedupe_key="c1", run_after=time.time() + 60)
        now_id = await queue.enqueue("summary", "u1", {"name": "now"})
        async with JobRunner(queue, {"summary": handler}):
            await eventually(lambda: state_is(queue, now_id, "done"))
    assert ran == ["now"]


async def test_enqueue_with_job_id_is_idempotent(tmp_path: Path) -> None:
    """Enqueueing the same job id twice (even after it ran) adds nothing and returns the same id."""
    ran: list[int] = []

    async def handler(job: Job) -> None:
        ran.append(1)

    async with JobQueue(settings(tmp_path)) as queue, JobRunner(queue, {"facts": handler}):
        first = await queue.enqueue("facts", "u1", {}, job_id="exchange-1:facts")
        await eventually(lambda: state_is(queue, first, "done"))
        again = await queue.enqueue("facts", "u1", {}, job_id="exchange-1:facts")
        await asyncio.sleep(0.2)
    assert first == again == "exchange-1:facts"
    assert ran == [1]


async def test_expired_lease_is_taken_again(tmp_path: Path) -> None:
    """A job claimed by a worker that stopped renewing its lease is claimed again once the lease runs out."""
    async with JobQueue(settings(tmp_path, lease_s=0.2)) as queue:
        job_id = await queue.enqueue("exchange", "u1", {})
        (claimed,), _ = await queue.claim({"exchange": 5})
        assert (await queue.claim({"exchange": 5}))[0] == []
        await asyncio.sleep(0.3)
        (again,), _ = await queue.claim({"exchange": 5})
    assert claimed.id == again.id == job_id
    assert (claimed.attempt, again.attempt) == (1, 2)


async def test_jobs_left_running_by_a_dead_process_run_after_restart(tmp_path: Path) -> None:
    """A job still marked running when its process vanished is taken again at the next open, at once."""
    async with JobQueue(settings(tmp_path, lease_s=3600)) as queue:
        job_id = await queue.enqueue("exchange", "u1", {"n": 1})
        (job,), _ = await queue.claim({"exchange": 1})
        await job.checkpoint("turns", ["t1", "t2"])
    seen: list[dict[str, object]] = []

    async def handler(job: Job) -> None:
        seen.append(dict(job.progress))

    async with JobQueue(settings(tmp_path, lease_s=3600)) as queue, JobRunner(queue, {"exchange": handler}):
        await eventually(lambda: state_is(queue, job_id, "done"))
    assert seen == [{"turns": ["t1", "t2"]}]


async def test_second_owner_of_data_dir_is_refused(tmp_path: Path) -> None:
    """Opening the same queue twice fails clearly instead of letting two workers share it."""
    async with JobQueue(settings(tmp_path)):
        with pytest.raises(QueueLocked, match="owned by another process"):
            async with JobQueue(settings(tmp_path)):
                pass


async def test_forget_user_drops_queued_and_stops_running_jobs(tmp_path: Path) -> None:
    """Forgetting a user removes their queued jobs and state and stops their running job; others are kept."""
    started = asyncio.Event()
    finished: list[str] = []

    async def handler(job: Job) -> None:
        if job.user_id == "gone":
            started.set()
            await asyncio.sleep(30)
        finished.append(job.user_id)

    async with JobQueue(settings(tmp_path)) as queue:
        await queue.update_state("gone", "summary:c1", lambda _: {"pending": ["t1"]})
        async with JobRunner(queue, {"exchange": handler}):
            await queue.enqueue("exchange", "gone", {})
            await queue.enqueue("exchange", "gone", {})
            await started.wait()
            deleted = await queue.forget_user("gone")
            kept = await queue.enqueue("exchange", "kept", {})
            await eventually(lambda: state_is(queue, kept, "done"))
        metrics = await queue.metrics()
        state = await queue.get_state("gone", "summary:c1")
    assert deleted == 2
    assert finished == ["kept"]
    assert state is None
    assert metrics.depth == 0


async def test_no_job_of_a_user_is_claimed_while_they_are_being_forgotten(tmp_path: Path) -> None:
    """A claim waits for a forget in progress: a job enqueued while the forget stops the user's running jobs
    (a stopped job's follow-up, say) is deleted by it, never claimed and started behind its back."""
    claimed: list[Job] = []
    async with JobQueue(settings(tmp_path)) as queue:

        async def stop_running(user_id: str) -> None:  # what the runner does, plus a late enqueue and a claim
            await queue.enqueue("exchange", user_id, {})
            claim = asyncio.create_task(queue.claim({"exchange": 5}, start=claimed.append))
            await asyncio.sleep(0.2)  # time enough for a claim that does not wait
            assert not claim.done()
            claiming.append(claim)

        claiming: list[asyncio.Task[tuple[list[Job], float]]] = []
        queue.on_forget(stop_running)
        await queue.enqueue("exchange", "gone", {})
        await queue.forget_user("gone")
        jobs, _ = await claiming[0]
        metrics = await queue.metrics()
    assert jobs == claimed == []
    assert metrics.depth == 0


async def test_shutdown_hands_unfinished_job_back(tmp_path: Path) -> None:
    """A job still running when the runner stops is returned to the queue and runs after restart."""
    runs: list[int] = []

    async def slow(job: Job) -> None:
        runs.append(job.attempt)
        await asyncio.sleep(30)

    async def quick(job: Job) -> None:
        runs.append(job.attempt)

    async with JobQueue(settings(tmp_path, drain_timeout_s=0.1)) as queue:
        job_id = await queue.enqueue("exchange", "u1", {})
        async with JobRunner(queue, {"exchange": slow}):
            await eventually(lambda: state_is(queue, job_id, "running"))
        assert await state_of(queue, job_id) == "pending"
        async with JobRunner(queue, {"exchange": quick}):
            await eventually(lambda: state_is(queue, job_id, "done"))
    assert runs == [1, 1]


async def test_metrics_report_depth_age_and_step_latency(tmp_path: Path) -> None:
    """Metrics show waiting jobs, the age of the oldest, and per-step latency of finished steps."""

    async def handler(job: Job) -> None:
        async with job.timed("turns"):
            await asyncio.sleep(0.01)

    async with JobQueue(settings(tmp_path)) as queue:
        await queue.enqueue("exchange", "u1", {})
        await queue.enqueue("exchange", "u2", {})
        await queue.enqueue("insights", "u1", {}, dedupe_key="i", run_after=time.time() + 60)
        await asyncio.sleep(0.05)
        before = await queue.metrics()
        async with JobRunner(queue, {"exchange": handler}):
            await eventually(lambda: ready_is(queue, 0))
        after = await queue.metrics()
    assert (before.ready, before.scheduled, before.depth) == (2, 1, 3)
    assert before.oldest_age_s >= 0.05
    assert before.depth_by_kind == {"exchange": 2, "insights": 1}
    assert after.step_latency["turns"].count == 2
    assert after.step_latency["turns"].sum_s >= 0.02
    assert after.step_latency["job.exchange"].count == 2


async def ready_is(queue: JobQueue, n: int) -> bool:
    """Whether exactly ``n`` jobs are due and not running, and none are running."""
    metrics = await queue.metrics()
    return metrics.ready == n and metrics.running == 0


async def test_update_state_is_atomic(tmp_path: Path) -> None:
    """Concurrent read-modify-write updates of per-user state never lose an update."""
    async with JobQueue(settings(tmp_path)) as queue:

        def add(value: dict[str, int] | None) -> dict[str, int]:
            return {"n": (value or {"n": 0})["n"] + 1}

        await asyncio.gather(*(queue.update_state("u1", "counter", add) for _ in range(50)))
        assert await queue.get_state("u1", "counter") == {"n": 50}


@given(
    attempt=st.integers(min_value=1, max_value=10_000),
    base=st.floats(min_value=0.001, max_value=10),
    cap=st.floats(min_value=0.01, max_value=3600),
    seed=st.integers(),
)
def test_backoff_is_bounded_and_grows(attempt: int, base: float, cap: float, seed: int) -> None:
    """Backoff never exceeds the cap, never drops below half the exponential step, and never overflows."""
    delay = backoff_delay(attempt, base, cap, random.Random(seed))
    ceiling = min(cap, base * 2.0 ** min(attempt - 1, 60))
    assert ceiling / 2 <= delay <= ceiling


async def test_slow_kind_never_starves_another(tmp_path: Path) -> None:
    """With every slot of a slow kind busy, a job of another kind still starts at once."""
    release = asyncio.Event()
    started: dict[str, float] = {}

    async def slow(job: Job) -> None:
        await release.wait()

    async def quick(job: Job) -> None:
        started[job.id] = time.monotonic()

    async with JobQueue(settings(tmp_path, concurrency=2)) as queue:
        for user in ("a", "b", "c", "d"):
            await queue.enqueue("facts", user, {})
        async with JobRunner(queue, {"facts": slow, "exchange": quick}):
            await eventually(lambda: running_is(queue, 2))
            sent = time.monotonic()
            job_id = await queue.enqueue("exchange", "a", {})
            await eventually(lambda: state_is(queue, job_id, "done"))
            release.set()
    assert started[job_id] - sent < 0.5


async def running_is(queue: JobQueue, n: int) -> bool:
    """Whether exactly ``n`` jobs are running."""
    return (await queue.metrics()).running == n


async def test_database_errors_reach_callers_as_the_queue_error(tmp_path: Path) -> None:
    """A failing SQLite statement reaches the queue's callers as its own error, a MemoryLayerError, not sqlite3's."""
    async with JobQueue(settings(tmp_path)) as queue:
        with contextlib.closing(sqlite3.connect(tmp_path / "jobs.sqlite3")) as other:
            other.execute("DROP TABLE job_state")
            other.execute("DROP TABLE jobs")
        with pytest.raises(QueueDatabaseError) as raised:
            await queue.enqueue("exchange", "u1", {"n": 1})  # the durable path: one group commit
        assert isinstance(raised.value, MemoryLayerError)
        assert isinstance(raised.value.__cause__, sqlite3.OperationalError)
        assert "no such table" in str(raised.value)
        with pytest.raises(QueueDatabaseError):
            await queue.enqueue("facts", "u1", {}, durable=False)
        with pytest.raises(QueueDatabaseError):
            await queue.get_state("u1", "insights")
        with pytest.raises(QueueDatabaseError):
            await queue.claim({"exchange": 1})


async def test_claiming_one_kind_never_walks_the_other_kinds_backlog(tmp_path: Path) -> None:
    """A claim looks up each kind's due jobs in an index by kind, so a backlog of exchange jobs does not make every
    claim of facts or summary jobs walk it (the write side stalled under load when it did)."""
    async with JobQueue(settings(tmp_path)) as queue:
        await queue.enqueue("exchange", "u1", {"text": "hello"})
    with contextlib.closing(sqlite3.connect(tmp_path / "jobs.sqlite3")) as conn:
        plan = conn.execute("EXPLAIN QUERY PLAN " + _CANDIDATES, {"now": time.time(), "kind": "facts", "limit": 8})
        steps = [str(row[3]) for row in plan.fetchall()]
    assert any("USING INDEX jobs_due_kind (state=? AND kind=? AND run_after<?)" in step for step in steps), steps
