"""The store's data directory and the small files that record its state: owner lock, sync note, purge marker.

* ``LOCK``: one process owns a data directory (and its Tantivy writer); an exclusive ``flock`` held while open.
* ``sync.json``: the live LanceDB table and version that Tantivy reflects, noted after each write; a table that
  moved past it on open means a crash between the two arms, and the startup repair runs.
* ``purge.pending``: a forgotten user's bytes are still to be removed from disk; whoever sees it finishes the
  purge (the next open, or the next maintenance round).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from proxy.memory.errors import StoreError


class DataDir:
    """The files under ``path`` that say who owns the store and how far its two indexes agree."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @contextlib.contextmanager
    def owned(self) -> Iterator[None]:
        """Hold an exclusive lock on the data directory: one process owns it (and its Tantivy writer)."""
        lock_path = self.path / "LOCK"
        with lock_path.open("a") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError as exc:
                raise StoreError(f"{self.path} is in use by another memproxy process") from exc
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    # the sync note ----------------------------------------------------------------------------------------

    @property
    def _sync_path(self) -> Path:
        return self.path / "sync.json"

    def write_sync_note(self, table: str, version: int) -> None:
        """Note that Tantivy reflects the live LanceDB ``table`` at ``version`` (replaced atomically)."""
        tmp = self._sync_path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"table": table, "version": version}))
        os.replace(tmp, self._sync_path)

    def sync_note(self) -> dict[str, Any]:
        """The last note written (empty when there is none or it cannot be read)."""
        try:
            return dict(json.loads(self._sync_path.read_text()))
        except (OSError, ValueError):
            return {}

    # the purge marker -------------------------------------------------------------------------------------

    @property
    def _purge_path(self) -> Path:
        return self.path / "purge.pending"

    @property
    def purge_pending(self) -> bool:
        """Whether deleted rows' bytes are still to be removed from disk."""
        return self._purge_path.exists()

    def mark_purge(self) -> None:
        """Note that deleted rows' bytes must be removed (written before the rows are deleted)."""
        self._purge_path.write_text("1")

    def purge_done(self) -> None:
        """The bytes are gone (or the purge is someone else's): clear the marker."""
        self._purge_path.unlink(missing_ok=True)
