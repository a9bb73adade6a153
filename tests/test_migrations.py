"""Schema versions: both stores check theirs on open, migrate forward, or refuse with what to do."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import subprocess
from pathlib import Path

import pytest

from proxy.memory.embedders.base import BaseEmbedder
from proxy.memory.store.memory_store import MemoryStore, StoreSettings
from proxy.memory.store.migrations import JOBS_SCHEMA_VERSION, SchemaError, Step, plan
from proxy.memory.store.records import SCHEMA_VERSION
from proxy.memory.write.job_types import JobQueueSettings
from proxy.memory.write.queue import JobQueue
from tests.support.processes import MEMPROXY, child_env


def _user_version(database: Path) -> int:
    with sqlite3.connect(database) as conn:
        return int(conn.execute("PRAGMA user_version").fetchone()[0])


def _set_user_version(database: Path, version: int) -> None:
    conn = sqlite3.connect(database)
    conn.execute(f"PRAGMA user_version = {version:d}")
    conn.close()


def test_plan_refuses_newer_and_names_the_command_for_offline_steps() -> None:
    """A newer store asks for an upgrade; a step that needs the server stopped names `memproxy migrate`."""
    with pytest.raises(SchemaError, match="newer than this memproxy's 2: upgrade memproxy"):
        plan("records table", 3, 2, {})
    rewrite = {1: Step("rewrite every row", lambda _: None, online=False)}
    with pytest.raises(SchemaError, match=r"run `memproxy migrate --config FILE` \(rewrite every row\)"):
        plan("records table", 1, 2, rewrite)
    assert [s.describe for s in plan("records table", 1, 2, rewrite, offline=True)] == ["rewrite every row"]
    with pytest.raises(SchemaError, match="no migration"):
        plan("job database", 0, 2, {0: Step("a", lambda _: None)})


async def _queue_with_a_job(path: Path) -> tuple[Path, str]:
    async with JobQueue(JobQueueSettings(path=path)) as queue:
        job_id = await queue.enqueue("facts", "ann", {"text": "x"})
    return path / "jobs.sqlite3", job_id


async def test_unversioned_job_database_is_migrated_and_keeps_its_jobs(tmp_path: Path) -> None:
    """A job database from before versions were recorded opens, gets the current version, and keeps its jobs."""
    database, job_id = await _queue_with_a_job(tmp_path / "jobs")
    assert _user_version(database) == JOBS_SCHEMA_VERSION
    _set_user_version(database, 0)
    async with JobQueue(JobQueueSettings(path=tmp_path / "jobs")) as queue:
        row = await queue.get(job_id)
    assert row is not None
    assert row["state"] == "pending"
    assert _user_version(database) == JOBS_SCHEMA_VERSION


async def test_newer_job_database_is_refused_untouched(tmp_path: Path) -> None:
    """A job database written by a newer memproxy is refused and left as it was."""
    database, _ = await _queue_with_a_job(tmp_path / "jobs")
    _set_user_version(database, 99)
    with pytest.raises(SchemaError, match="job database schema is version 99"):
        async with JobQueue(JobQueueSettings(path=tmp_path / "jobs")):
            pass
    assert _user_version(database) == 99
    _set_user_version(database, JOBS_SCHEMA_VERSION)  # e.g. the backup restored: it opens (the lock was released)
    async with JobQueue(JobQueueSettings(path=tmp_path / "jobs")) as queue:
        assert (await queue.metrics()).ready == 1


@pytest.mark.asyncio(loop_scope="module")
async def test_newer_records_table_is_refused(tmp_path: Path, local: BaseEmbedder) -> None:
    """A records table whose manifest is from a newer schema is refused with the advice to upgrade."""
    async with MemoryStore(StoreSettings(path=tmp_path), local):
        pass
    manifest = tmp_path / "lance" / "manifest.json"
    data = json.loads(manifest.read_text())
    assert data["schema_version"] == SCHEMA_VERSION
    manifest.write_text(json.dumps({**data, "schema_version": SCHEMA_VERSION + 1}))
    with pytest.raises(SchemaError, match=r"records table schema is version .* upgrade memproxy"):
        async with MemoryStore(StoreSettings(path=tmp_path), local):
            pass
    assert json.loads(manifest.read_text())["schema_version"] == SCHEMA_VERSION + 1


def test_migrate_command_and_serve_refusal(tmp_path: Path) -> None:
    """`memproxy migrate` reports each store's version; `serve` on a newer store exits 1 with one clear line."""
    data = tmp_path / "data"
    database, _ = asyncio.run(_queue_with_a_job(data / "jobs.sqlite3"))
    _set_user_version(database, 0)
    env = child_env(MEMPROXY_STORAGE__PATH=str(data))
    migrated = subprocess.run(
        [str(MEMPROXY), "migrate"], capture_output=True, text=True, env=env, timeout=120, check=False
    )
    assert migrated.returncode == 0, migrated.stderr
    assert f"job database: version 0 -> {JOBS_SCHEMA_VERSION}" in migrated.stdout
    assert "records table: none yet" in migrated.stdout
    _set_user_version(database, 99)
    served = subprocess.run(
        [str(MEMPROXY), "serve", "--port", "0"], capture_output=True, text=True, env=env, timeout=180, check=False
    )
    assert served.returncode == 1
    assert "memproxy: the job database schema is version 99" in served.stderr
    assert "Traceback" not in served.stderr
