"""Replicas over object storage: what lets several memproxy processes serve one ``s3://`` store.

Where each piece of state lives, and why:

* **The memory table** (LanceDB) is on object storage, shared. Lance commits with conditional writes, so two
  replicas writing at once neither overwrite nor lose each other's rows; reads see other replicas' commits
  within ``storage.sync_interval_s`` (LanceDB's read consistency interval).
* **The manifest** (live table, embedding model) is an object beside the table (``manifest.json``).
* **Caches and the Tantivy keyword index** are per replica, on local disk or in RAM, and derived from the
  table: a fresh disk rebuilds Tantivy at start (the store's startup repair). Every write publishes a
  **change** (``changes/<ms>-<replica>-<n>.json``: the users touched) before its commit and again after it;
  every replica polls the feed every ``sync_interval_s`` and, for each user named by another replica, drops
  the user's cached vectors and read-cache entries and re-indexes the user's Tantivy documents from the
  table, once at once and once more ``settle_s`` later (which covers a commit that lands after the first
  look, or a writer killed between its commit and its second notice). So another replica's write is seen
  by every replica within ``sync_interval_s`` plus one poll, and at worst ``settle_s`` after it was announced.
  A forget-user change also makes every replica drop the user's queued jobs and delete any row a job of
  theirs wrote meanwhile.
* **The job queue** stays a local SQLite file per replica (leases, per-user order, retries at local-disk
  cost), and every acknowledged exchange is also in the **journal** on object storage
  (``journal/<replica>/<job>.json``, written before ``record`` returns, removed when its turns and facts
  are stored). Each replica writes a heartbeat (``replicas/<replica>.json``); the entries of a replica whose
  heartbeat is older than ``dead_after_s`` are adopted by another one (claimed with ``If-None-Match``, so by
  exactly one) and replayed under the same job id: record ids derive from it, so a replay neither
  duplicates nor loses a memory. A replica killed with kill -9, or restarted on an empty disk, loses nothing
  that was acknowledged.
* **Background work** (compaction and index builds, purges of forgotten users' bytes, the weekly insight
  schedule, the change feed's cleanup) runs on the replica that holds the **lease**
  (``leases/maintenance.json``), taken and renewed with conditional writes (``If-None-Match`` to create,
  ``If-Match`` on the ETag read to take over an expired one or renew).

Here: the cluster's settings and the replica's name. The pieces: ``manifest.RemoteManifest``, ``lease.py``,
``changes.py`` (the feed), ``journal.py``, ``replicated.py`` (the store) and ``runtime.py`` (the loops).
"""

from __future__ import annotations

import socket
import uuid
from dataclasses import dataclass

from proxy.memory.store.objectstore import StorageLocation


@dataclass(frozen=True)
class ClusterSettings:
    """How replicas share one store (built from ``[storage]`` by the config)."""

    location: StorageLocation
    sync_interval_s: float = 1.0
    lease_s: float = 15.0
    settle_s: float = 10.0
    dead_after_s: float = 15.0
    changes_keep_s: float = 600.0
    replica: str | None = None  # this replica's name (None: ``replica_name()``); one for all processes of a serve


def replica_name() -> str:
    """This process's name in the cluster: host name plus a random suffix (a restart is a new replica)."""
    host = "".join(c if c.isalnum() or c in "-_." else "-" for c in socket.gethostname())[:40] or "replica"
    return f"{host}-{uuid.uuid4().hex[:8]}"
