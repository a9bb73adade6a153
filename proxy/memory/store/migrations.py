"""Schema versions of the two stores in a data directory, checked on every open.

- the records table: ``schema_version`` in ``lance/manifest.json`` (``records.SCHEMA_VERSION``);
- the job database: SQLite's ``PRAGMA user_version`` (``JOBS_SCHEMA_VERSION``; 0 is the unversioned layout
  written before versions were recorded, identical to version 1).

On open, an older store is migrated forward by the steps that are safe while serving (``online``); a step that
is not (a rewrite, a re-embedding) makes the open fail with the command to run, ``memproxy migrate``, with the
server stopped. A store written by a newer memproxy is refused: downgrades are not supported (restore the backup
taken before the upgrade). ``plan`` is the pure part; ``ensure_jobs_schema`` and ``migrate_data_dir`` apply it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import sqlite3
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from proxy.memory.errors import StoreError
from proxy.memory.store.records import SCHEMA_VERSION

JOBS_SCHEMA_VERSION = 3
MIGRATE_COMMAND = "memproxy migrate --config FILE"


class SchemaError(StoreError):
    """A store's schema version cannot be served by this memproxy; the message says what to do."""


@dataclass(frozen=True)
class Step:
    """How a store goes from one version to the next; ``apply`` gets the store's handle."""

    describe: str
    apply: Callable[[Any], None]
    online: bool = True


def _nothing(_: Any) -> None:
    """A step whose layout is unchanged (only the version is recorded)."""


def _add_waiting_column(conn: Any) -> None:
    """Jobs waiting for a key or configuration (``waiting`` = the reason); a no-op where the column exists."""
    if "waiting" not in {row[1] for row in conn.execute("PRAGMA table_info(jobs)")}:
        conn.execute("ALTER TABLE jobs ADD COLUMN waiting TEXT")


def _add_orphaned_column(conn: Any) -> None:
    """How many process deaths interrupted a job (its attempt is given back); a no-op where the column exists."""
    if "orphaned" not in {row[1] for row in conn.execute("PRAGMA table_info(jobs)")}:
        conn.execute("ALTER TABLE jobs ADD COLUMN orphaned INTEGER NOT NULL DEFAULT 0")


JOBS_STEPS: Mapping[int, Step] = {
    0: Step("record the schema version (layout unchanged)", _nothing),
    1: Step("add the jobs.waiting column (jobs waiting for a key or configuration)", _add_waiting_column),
    2: Step("add the jobs.orphaned column (process deaths a job lived through)", _add_orphaned_column),
}
RECORDS_STEPS: Mapping[int, Step] = {
    # the column itself is added when the table opens (``MemoryTable._add_missing_columns``: metadata only)
    1: Step("add the expires_at column (memories that expire)", _nothing),
}


def plan(store: str, found: int, current: int, steps: Mapping[int, Step], *, offline: bool = False) -> list[Step]:
    """The steps from ``found`` to ``current``; ``SchemaError`` if the store is newer, a step is missing, or a
    step needs ``memproxy migrate`` and this is not it (``offline`` False)."""
    if found > current:
        raise SchemaError(
            f"the {store} schema is version {found}, newer than this memproxy's {current}: "
            "upgrade memproxy (downgrades are not supported; restore the backup taken before "
            "the upgrade to go back)"
        )
    out = []
    for version in range(found, current):
        step = steps.get(version)
        if step is None:
            raise SchemaError(f"no migration of the {store} schema from version {version} to {version + 1}")
        if not step.online and not offline:
            raise SchemaError(
                f"the {store} schema is version {found}, this memproxy needs {current}: stop the "
                f"server and run `{MIGRATE_COMMAND}` ({step.describe})"
            )
        out.append(step)
    return out


def ensure_jobs_schema(conn: sqlite3.Connection, *, offline: bool = False) -> tuple[int, int]:
    """Migrate an open job database to ``JOBS_SCHEMA_VERSION`` (or raise); returns (found, now)."""
    found = int(conn.execute("PRAGMA user_version").fetchone()[0])
    steps = plan("job database", found, JOBS_SCHEMA_VERSION, JOBS_STEPS, offline=offline)
    if not steps:
        return found, found
    conn.execute("BEGIN IMMEDIATE")
    try:
        for step in steps:
            step.apply(conn)
        conn.execute(f"PRAGMA user_version = {JOBS_SCHEMA_VERSION:d}")
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    return found, JOBS_SCHEMA_VERSION


def check_records_schema(found: int, lance_dir: Path, *, offline: bool = False) -> int:
    """Migrate the records table in ``lance_dir`` from ``found`` to ``SCHEMA_VERSION`` (or raise)."""
    for step in plan("records table", found, SCHEMA_VERSION, RECORDS_STEPS, offline=offline):
        step.apply(lance_dir)
    return SCHEMA_VERSION


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise SchemaError(f"{path.parent} is in use by a running memproxy: stop it first") from None
        yield
    finally:
        os.close(fd)


def _migrate_jobs(jobs_dir: Path) -> str:
    database = jobs_dir / "jobs.sqlite3"
    if not database.exists():
        return "job database: none yet"
    with _locked(jobs_dir / "jobs.lock"), contextlib.closing(sqlite3.connect(database, isolation_level=None)) as c:
        found, now = ensure_jobs_schema(c, offline=True)
    return f"job database: version {found} -> {now}" if found != now else f"job database: version {now}, current"


def _migrate_records(data_dir: Path) -> str:
    manifest_path = data_dir / "lance" / "manifest.json"
    if not manifest_path.exists():
        return "records table: none yet"
    with _locked(data_dir / "LOCK"):
        manifest = json.loads(manifest_path.read_text())
        found = int(manifest["schema_version"])
        now = check_records_schema(found, data_dir / "lance", offline=True)
        if now != found:
            manifest["schema_version"] = now
            tmp = manifest_path.with_suffix(".tmp")
            tmp.write_text(json.dumps(manifest))
            os.replace(tmp, manifest_path)
    return f"records table: version {found} -> {now}" if found != now else f"records table: version {now}, current"


def migrate_data_dir(data_dir: Path, jobs_dir: Path) -> list[str]:
    """``memproxy migrate``: every store under the data directory brought to this version; one line each."""
    return [_migrate_records(data_dir), _migrate_jobs(jobs_dir)]
