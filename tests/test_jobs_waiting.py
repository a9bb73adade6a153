"""Jobs that wait for a key or configuration: no attempt spent, never dead, counted, woken by their user."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from proxy.memory.write.job_types import WaitForConfig
from proxy.memory.write.queue import Job, JobQueue
from proxy.memory.write.runner import JobRunner
from tests.test_jobs import eventually, settings, state_of


async def test_a_waiting_job_spends_no_attempt_and_runs_when_its_user_is_resumed(tmp_path: Path) -> None:
    """Many refusals never dead-letter the job; it is counted by reason, and runs once resumed."""
    key_arrived = False
    runs = 0

    async def handler(job: Job) -> None:
        nonlocal runs
        runs += 1
        if not key_arrived:
            raise WaitForConfig("no_key", "the upstream wants a key")

    async with JobQueue(settings(tmp_path, max_attempts=1, waiting_recheck_s=0.05)) as queue:
        job_id = await queue.enqueue("facts", "ann", {})
        other = await queue.enqueue("facts", "ben", {})
        async with JobRunner(queue, {"facts": handler}):

            async def refused_often() -> bool:
                return runs >= 6

            await eventually(refused_often)

            async def counted_waiting() -> bool:  # between rechecks (both jobs may be running at one instant)
                return (await queue.metrics()).waiting.get("no_key", 0) >= 1

            await eventually(counted_waiting)
            snapshot = await queue.metrics()
            assert snapshot.dead == 0
            assert snapshot.waits_total["no_key"] >= 6
            row = await queue.get(job_id)
            assert row is not None
            assert row["attempts"] == 0
            assert "waiting (no_key)" in row["last_error"]
            key_arrived = True
            await queue.resume_waiting("ann")

            async def done() -> bool:
                return await state_of(queue, job_id) == "done"

            await eventually(done)
            assert await state_of(queue, other) in ("pending", "running", "done")


async def test_resume_wakes_only_that_users_waiting_jobs(tmp_path: Path) -> None:
    """A key for one user makes that user's waiting jobs due, not another user's."""

    async def refuse(job: Job) -> None:
        raise WaitForConfig("key_rejected", "401")

    async with JobQueue(settings(tmp_path, waiting_recheck_s=3600)) as queue:
        ann = await queue.enqueue("facts", "ann", {})
        ben = await queue.enqueue("facts", "ben", {})
        async with JobRunner(queue, {"facts": refuse}):

            async def both_wait() -> bool:
                return (await queue.metrics()).waiting.get("key_rejected") == 2

            await eventually(both_wait)
        assert await queue.resume_waiting("ann") == 1
        rows = {job_id: await queue.get(job_id) for job_id in (ann, ben)}
        assert rows[ann] is not None
        assert rows[ben] is not None
        assert rows[ann]["run_after"] < rows[ben]["run_after"]


async def test_a_key_that_arrives_while_the_job_runs_is_not_missed(tmp_path: Path) -> None:
    """The user's key arrives (``resume_waiting``) after the job looked for it and before it is parked as
    waiting: the job runs again at once instead of waiting out ``waiting_recheck_s`` (a lost wake-up)."""
    key_arrived = False
    runs = 0

    async def handler(job: Job) -> None:
        nonlocal runs, key_arrived
        runs += 1
        if not key_arrived:
            key_arrived = True
            await queue.resume_waiting(job.user_id)  # nothing is waiting yet: this job is still running
            raise WaitForConfig("no_key", "the upstream wants a key")

    async with JobQueue(settings(tmp_path, waiting_recheck_s=3600)) as queue:
        job_id = await queue.enqueue("facts", "ann", {})
        async with JobRunner(queue, {"facts": handler}):

            async def done() -> bool:
                return await state_of(queue, job_id) == "done"

            await eventually(done)
    assert runs == 2


async def test_a_queue_from_before_waiting_jobs_opens_and_keeps_its_jobs(tmp_path: Path) -> None:
    """A jobs.sqlite3 made without the ``waiting`` column gains it at open; its pending job still runs."""
    async with JobQueue(settings(tmp_path)) as queue:
        job_id = await queue.enqueue("facts", "ann", {"n": 1})
    conn = sqlite3.connect(tmp_path / "jobs.sqlite3")
    conn.execute("ALTER TABLE jobs DROP COLUMN waiting")
    conn.execute("PRAGMA user_version = 0")  # as a queue written before schema versions existed
    conn.commit()
    conn.close()
    ran: list[str] = []

    async def handler(job: Job) -> None:
        ran.append(job.id)

    async with JobQueue(settings(tmp_path)) as queue, JobRunner(queue, {"facts": handler}):

        async def done() -> bool:
            return ran == [job_id]

        await eventually(done)
