"""Faults of our own disk: recognised, waited out without dead letters, logged once per change of state."""

from __future__ import annotations

import asyncio
import errno
import json
import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from proxy.memory.errors import StoreError
from proxy.memory.store.faults import fault_reason, is_storage_fault
from proxy.memory.store.memory_store import MemoryStore, StoreSettings
from proxy.memory.store.records import Kind, MemoryRecord
from proxy.memory.write.job_types import JobQueueSettings
from proxy.memory.write.llm import LLMUnavailable
from proxy.memory.write.queue import Job, JobQueue
from proxy.memory.write.runner import JobRunner
from tests.support.embedder import HashingEmbedder
from tests.support.readonly import read_only


def settings(path: Path, **changes: Any) -> JobQueueSettings:
    """Fast queue settings for tests."""
    values: dict[str, Any] = {
        "path": path,
        "backoff_base_s": 0.02,
        "backoff_max_s": 0.1,
        "poll_interval_s": 0.02,
        "drain_timeout_s": 0.5,
        "max_attempts": 2,
    }
    return JobQueueSettings.model_validate({**values, **changes})


def _chained(outer: Exception, inner: BaseException) -> Exception:
    outer.__cause__ = inner
    return outer


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        (PermissionError(errno.EACCES, "Permission denied"), "EACCES"),
        (OSError(errno.EROFS, "Read-only file system"), "EROFS"),
        (OSError(errno.ENOSPC, "No space left on device"), "ENOSPC"),
        (sqlite3.OperationalError("attempt to write a readonly database"), "readonly_database"),
        (sqlite3.OperationalError("database or disk is full"), "database_or_disk_is_full"),
        (RuntimeError("lance error: LanceError(IO): Operation not permitted (os error 1), at path x"), "EPERM"),
        (
            ValueError(
                "Failed to open file for write: 'IoError { io_error: Os { code: 28, kind: StorageFull, "
                'message: "No space left on device" } }\''
            ),
            "no_space_left",
        ),
        (_chained(StoreError("write failed"), OSError(errno.EIO, "Input/output error")), "EIO"),
    ],
)
def test_disk_faults_are_recognised(error: Exception, reason: str) -> None:
    """Read-only, full and failing disks are storage faults, whichever library reports them, with a short reason."""
    assert is_storage_fault(error)
    assert fault_reason(error) == reason


@pytest.mark.parametrize(
    "error",
    [
        ValueError("temperature must be a number"),
        RuntimeError("lance error: LanceError(IO): Not found (os error 2)"),
        FileNotFoundError(errno.ENOENT, "No such file"),
        LLMUnavailable("upstream said: permission denied"),
        KeyError("text"),
    ],
)
def test_other_errors_are_not_disk_faults(error: Exception) -> None:
    """Bugs, bad input and a down dependency are not mistaken for a disk fault (they keep their own handling)."""
    assert not is_storage_fault(error)


async def test_debounced_job_left_running_beside_its_pending_twin_does_not_stop_the_queue(tmp_path: Path) -> None:
    """A summary job killed while running, with a newer one pending for the same key, is folded into it at open."""
    async with JobQueue(settings(tmp_path)) as queue:
        first = await queue.enqueue("summary", "u1", {"n": 1}, dedupe_key="summary:c1", run_after=time.time())
        [job], _ = await queue.claim({"summary": 1})
        assert job.id == first
        second = await queue.enqueue("summary", "u1", {"n": 2}, dedupe_key="summary:c1", run_after=time.time() + 3600)
        assert second != first
    async with JobQueue(settings(tmp_path)) as queue:  # the process died: the first job is an orphan
        assert (await queue.get(second) or {})["state"] == "done"  # the twin is folded into the orphan
        orphan = await queue.get(first)
        assert orphan is not None
        assert orphan["state"] == "pending"
        assert orphan["run_after"] <= time.time()  # runs now, with the twin's newer payload
        jobs, _ = await queue.claim({"summary": 1})
        assert [(j.id, j.payload) for j in jobs] == [(first, {"n": 2})]


async def test_deferring_a_debounced_job_folds_its_pending_twin_into_it(tmp_path: Path) -> None:
    """A running debounced job that must wait, while a newer one is pending, takes that one's payload and stays
    the one pending job of its key."""
    async with JobQueue(settings(tmp_path)) as queue:
        await queue.enqueue("insights", "u1", {"n": 1}, dedupe_key="insights", run_after=time.time())
        [job], _ = await queue.claim({"insights": 1})
        twin = await queue.enqueue("insights", "u1", {"n": 2}, dedupe_key="insights", run_after=time.time() + 3600)
        await queue.defer(job, "storage fault: test")
        assert (await queue.get(twin) or {})["state"] == "done"
        kept = await queue.get(job.id) or {}
        assert kept["state"] == "pending"
        assert json.loads(kept["payload"]) == {"n": 2}


async def test_concurrent_enqueues_share_commits(tmp_path: Path) -> None:
    """64 exchanges committed at once need a handful of durable commits, not 64, and all survive a reopen."""
    async with JobQueue(settings(tmp_path)) as queue:
        ids = await asyncio.gather(*(queue.enqueue("exchange", f"u{i % 4}", {"i": i}) for i in range(64)))
        batches, items = queue.commit_batches
    assert items == 64
    assert batches <= 8
    async with JobQueue(settings(tmp_path)) as queue:
        rows = [await queue.get(job_id) for job_id in ids]
    assert all(row is not None and row["state"] == "pending" for row in rows)


async def test_jobs_wait_out_a_read_only_store_and_are_never_dead_lettered(tmp_path: Path) -> None:
    """With the store's directory read-only, turn jobs wait past max_attempts; writable again, all are stored.

    The log has one ``storage.fault`` line per failing component, not one per attempt, and one recovery line.
    """
    store_dir, queue_dir = tmp_path / "store", tmp_path / "queue"
    embedder = HashingEmbedder()
    async with (
        MemoryStore(StoreSettings(path=store_dir, flush_interval_ms=1), embedder) as store,
        JobQueue(settings(queue_dir)) as queue,
    ):

        async def store_turn(job: Job) -> None:
            record = MemoryRecord(user_id=job.user_id, kind=Kind.TURN, text=job.payload["text"], id=job.id)
            await store.add([record])

        ids = []
        with capture_logs() as logs:
            async with JobRunner(queue, {"exchange": store_turn}):
                with read_only(store_dir):
                    for i in range(3):
                        ids.append(await queue.enqueue("exchange", f"u{i}", {"text": f"turn number {i}"}))
                    await asyncio.sleep(1.5)  # ~15 retries' worth at these backoffs, max_attempts is 2
                    rows = [await queue.get(job_id) for job_id in ids]
                    assert [row["state"] if row else None for row in rows] != ["dead"] * 3
                    assert all(row and row["state"] in ("pending", "running") for row in rows), rows
                    assert all(int(row["deferrals"]) >= 3 for row in rows if row), rows
                deadline = time.monotonic() + 10
                while [(await queue.get(j) or {}).get("state") for j in ids] != ["done"] * 3:
                    assert time.monotonic() < deadline, "jobs did not resume after the disk came back"
                    await asyncio.sleep(0.05)
        assert queue.health.reason is None
        assert (await queue.metrics()).dead == 0
        stored = {r.id for u in ("u0", "u1", "u2") for r in (await store.list(u, limit=10)).data}
        assert stored == set(ids)
    faults = [e for e in logs if e["event"] == "storage.fault"]
    assert 1 <= len(faults) <= 3, faults  # per component (store, write path), never per attempt
    assert {e["component"] for e in logs if e["event"] == "storage.recovered"} == {e["component"] for e in faults}
    assert not [e for e in logs if e["event"] in ("job.failed", "job.dead", "memory.flush_failed")]


async def test_job_interrupted_by_process_deaths_is_not_dead_lettered(tmp_path: Path) -> None:
    """A job running at each of several kill -9s (more than max_attempts) is still there to run afterwards."""
    async with JobQueue(settings(tmp_path)) as queue:
        job_id = await queue.enqueue("exchange", "u1", {"text": "answered"})
    for _ in range(5):  # max_attempts is 2: five interrupted runs would have dead-lettered it
        async with JobQueue(settings(tmp_path)) as queue:
            [job], _ = await queue.claim({"exchange": 1})
            assert job.id == job_id
        # closing without finishing: as if the process had died while running it
    async with JobQueue(settings(tmp_path)) as queue:
        row = await queue.get(job_id)
        assert row is not None
        assert (row["state"], row["attempts"], row["orphaned"]) == ("pending", 0, 5)
        [job], _ = await queue.claim({"exchange": 1})
        assert job.payload == {"text": "answered"}
