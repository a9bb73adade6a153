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
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import random
import socket
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import orjson
import structlog

from insights.scheduler import InsightScheduler
from proxy.memory.errors import MemoryLayerError
from proxy.memory.faults import StorageHealth
from proxy.memory.lance import Manifest, MemoryTable, SharedTable, record_filter
from proxy.memory.objectstore import ObjectStore, ObjectStoreError, PreconditionFailed, StorageLocation
from proxy.memory.store import _REPAIR_COLUMNS, MemoryStore, StoreSettings, _keyword_docs
from proxy.memory.write.queue import JobQueue

log = structlog.get_logger("memproxy.cluster")

MANIFEST_KEY = "manifest.json"
LEASE_KEY = "leases/maintenance.json"
_KEY_USERS_MAX = 700  # bytes of base64 user ids in a change's key (S3 keys go to 1024)
CHANGES = "changes/"
JOURNAL = "journal/"
CLAIMS = "journal-claims/"
REPLICAS = "replicas/"


@dataclass(frozen=True)
class ClusterSettings:
    """How replicas share one store (built from ``[storage]`` by the config)."""

    location: StorageLocation
    sync_interval_s: float = 1.0
    lease_s: float = 15.0
    settle_s: float = 10.0
    dead_after_s: float = 15.0
    changes_keep_s: float = 600.0


def replica_name() -> str:
    """This process's name in the cluster: host name plus a random suffix (a restart is a new replica)."""
    host = "".join(c if c.isalnum() or c in "-_." else "-" for c in socket.gethostname())[:40] or "replica"
    return f"{host}-{uuid.uuid4().hex[:8]}"


def _now_ms() -> int:
    return int(time.time() * 1000)


# --- manifest ------------------------------------------------------------------------------------------


class RemoteManifest:
    """The table manifest as an object beside the table."""

    def __init__(self, objects: ObjectStore) -> None:
        self._objects = objects

    async def read(self) -> Manifest | None:
        """The manifest, or None before the first replica opened the store."""
        found = await self._objects.get(MANIFEST_KEY)
        if found is None:
            return None
        data = orjson.loads(found.body)
        return Manifest(data["table"], data["model_id"], int(data["dim"]), int(data["schema_version"]))

    async def write(self, manifest: Manifest) -> None:
        """Replace the manifest (one PUT: atomic on S3)."""
        await self._objects.put(MANIFEST_KEY, orjson.dumps(manifest.__dict__))


# --- lease ---------------------------------------------------------------------------------------------


class Lease:
    """One holder at a time for the store's background work, by conditional writes on one object."""

    def __init__(self, objects: ObjectStore, holder: str, ttl_s: float, key: str = LEASE_KEY) -> None:
        self._objects = objects
        self.holder = holder
        self.ttl_s = ttl_s
        self.key = key
        self._etag: str | None = None
        self._valid_until = 0.0  # monotonic: we stop acting a margin before others may take over

    @property
    def held(self) -> bool:
        """Whether this replica holds the lease now."""
        return self._etag is not None and time.monotonic() < self._valid_until

    async def refresh(self) -> bool:
        """Take the lease if free or expired, renew it if ours; True if we hold it afterwards."""
        started = time.monotonic()
        try:
            etag = await self._try_take()
        except PreconditionFailed:
            etag = None
        if etag is None:
            if self._etag is not None:
                log.info("cluster.lease_lost", lease=self.key)
            self._etag = None
            return False
        if self._etag is None:
            log.info("cluster.lease_taken", lease=self.key)
        self._etag = etag
        self._valid_until = started + self.ttl_s * 0.8
        return True

    async def _try_take(self) -> str | None:
        body = orjson.dumps({"holder": self.holder, "expires_at": time.time() + self.ttl_s})
        found = await self._objects.get(self.key)
        if found is None:
            return await self._objects.put(self.key, body, if_none_match=True)
        current = orjson.loads(found.body)
        if current.get("holder") != self.holder and float(current.get("expires_at", 0)) > time.time():
            return None
        return await self._objects.put(self.key, body, if_match=found.etag)

    async def release(self) -> None:
        """Give the lease up at shutdown (another replica takes it at once instead of after ``ttl_s``)."""
        if self._etag is None:
            return
        body = orjson.dumps({"holder": self.holder, "expires_at": 0})
        with contextlib.suppress(ObjectStoreError):
            await self._objects.put(self.key, body, if_match=self._etag)
        self._etag = None


# --- change feed ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Change:
    """Users whose records another replica changed (``op``: ``write`` or ``forget``)."""

    key: str
    at_ms: int
    replica: str
    users: tuple[str, ...]
    op: str


class ChangeFeed:
    """Publishes this replica's changes and lists the others', with a look-back window for late arrivals."""

    def __init__(self, objects: ObjectStore, replica: str, lookback_s: float) -> None:
        self._objects = objects
        self.replica = replica
        self._lookback_ms = int(lookback_s * 1000)
        self._seq = 0
        self._seen: dict[str, int] = {}
        self._since_ms = _now_ms()

    def start_at(self, at_ms: int) -> None:
        """Deliver changes published from ``at_ms`` on (the moment before the store opened)."""
        self._since_ms = at_ms

    async def publish(self, users: Iterable[str], op: str = "write") -> None:
        """Announce that ``users``' records change (before the commit) or changed (after it)."""
        users = sorted(set(users))
        if not users:
            return
        self._seq += 1
        at = _now_ms()
        key = f"{CHANGES}{at:013d}-{self.replica}-{self._seq:08d}-{op}"
        named = base64.urlsafe_b64encode("\n".join(users).encode()).decode().rstrip("=")
        if len(named) <= _KEY_USERS_MAX:  # the usual case: readers need only the listing, no GET per change
            key += f"~{named}"
        body = orjson.dumps({"users": users, "op": op, "replica": self.replica, "at_ms": at})
        await self._objects.put(f"{key}.json", body)

    async def poll(self) -> list[Change]:
        """Changes by other replicas not delivered yet, oldest first."""
        floor = max(self._since_ms, _now_ms() - self._lookback_ms)
        keys: list[str] = []
        after = f"{CHANGES}{max(floor, 0):013d}"
        while True:
            page = await self._objects.list(CHANGES, start_after=after)
            keys.extend(page)
            if len(page) < 1000:
                break
            after = page[-1]
        out = []
        for key in keys:
            at_ms, replica, op, users = _parse_change_key(key)
            if key in self._seen or at_ms < self._since_ms:
                continue
            self._seen[key] = at_ms
            if replica == self.replica:
                continue
            if users is None:
                found = await self._objects.get(key)
                users = tuple(orjson.loads(found.body)["users"]) if found is not None else ()
            out.append(Change(key, at_ms, replica, users, op))
        self._forget_seen(floor)
        return out

    def _forget_seen(self, floor_ms: int) -> None:
        for key in [key for key, at in self._seen.items() if at < floor_ms]:
            del self._seen[key]

    async def cleanup(self, keep_s: float) -> int:
        """Delete changes older than ``keep_s`` (the lease holder does this); returns how many."""
        cutoff = f"{CHANGES}{_now_ms() - int(keep_s * 1000):013d}"
        old = [key for key in await self._objects.list(CHANGES) if key < cutoff]
        for key in old:
            await self._objects.delete(key)
        return len(old)


def _parse_change_key(key: str) -> tuple[int, str, str, tuple[str, ...] | None]:
    """(time, replica, op, users) of a change key; users None when only the object's body names them."""
    head, _, named = key.rsplit("/", 1)[-1].removesuffix(".json").partition("~")
    stamp, _, rest = head.partition("-")
    replica, _seq, op = rest.rsplit("-", 2)
    users = None
    if named:
        users = tuple(base64.urlsafe_b64decode(named + "=" * (-len(named) % 4)).decode().split("\n"))
    return int(stamp), replica, op, users


# --- the replicated store ------------------------------------------------------------------------------


class ReplicatedStore(MemoryStore):
    """A ``MemoryStore`` on a shared table: announces its writes, applies others', maintains only when leader."""

    def __init__(
        self,
        settings: StoreSettings,
        embedder: Any,
        cluster: ClusterSettings,
        objects: ObjectStore,
        replica: str,
        *,
        allow_mismatch: bool = False,
        health: StorageHealth | None = None,
    ) -> None:
        super().__init__(settings, embedder, allow_mismatch=allow_mismatch, health=health)
        shared = SharedTable(
            uri=cluster.location.child("lance"),
            storage_options=cluster.location.lance_options(),
            manifests=RemoteManifest(objects),
            read_consistency=timedelta(seconds=cluster.sync_interval_s),
            purge_cleanup=timedelta(seconds=max(60.0, 4 * cluster.sync_interval_s)),
        )
        self._lance = MemoryTable(
            settings.path / "lance", embedder.model_id, embedder.dim, allow_mismatch=allow_mismatch, shared=shared
        )
        self.cluster = cluster
        self.objects = objects
        self.feed = ChangeFeed(objects, replica, lookback_s=max(30.0, cluster.settle_s * 2))
        self.lease = Lease(objects, replica, cluster.lease_s)
        self._listeners: list[Callable[[str], Awaitable[object]]] = []
        self._forget_listeners: list[Callable[[str], Awaitable[object]]] = []

    def on_change(self, listener: Callable[[str], Awaitable[object]]) -> None:
        """Await ``listener(user_id)`` after the user's records changed elsewhere or were forgotten (read caches)."""
        self._listeners.append(listener)

    def on_forget(self, listener: Callable[[str], Awaitable[object]]) -> None:
        """Await ``listener(user_id)`` when another replica forgot the user (the local job queue)."""
        self._forget_listeners.append(listener)

    async def __aenter__(self) -> ReplicatedStore:
        self.feed.start_at(_now_ms())
        await super().__aenter__()
        return self

    # writes announce themselves before and after their commit ----------------------------------------

    async def _write_new(self, records: list[Any]) -> None:
        users = {record.user_id for record in records}
        await self.feed.publish(users)
        await super()._write_new(records)
        await self.feed.publish(users)

    async def update(self, user_id: str, id: str, **changes: Any) -> Any:
        """As ``MemoryStore.update``, announced to the other replicas."""
        await self.feed.publish([user_id])
        try:
            return await super().update(user_id, id, **changes)
        finally:
            await self.feed.publish([user_id])

    async def delete(self, user_id: str, id: str) -> bool:
        """As ``MemoryStore.delete``, announced to the other replicas."""
        await self.feed.publish([user_id])
        try:
            return await super().delete(user_id, id)
        finally:
            await self.feed.publish([user_id])

    async def forget_user(self, user_id: str, *, purge: bool = True) -> dict[str, int]:
        """Forget the user here and everywhere: the rows go at once, their bytes at the lease holder's purge.

        The purge (rewriting shared data files) is left to the lease holder's next maintenance round, which
        also removes old versions; until then the deleted rows are unreachable by any read.
        """
        await self.feed.publish([user_id], op="forget")
        await self._drain_writes()
        counts = await super().forget_user(user_id, purge=False)
        if any(counts.values()):  # the purge is the lease holder's, noted on object storage
            self._purge_path.unlink(missing_ok=True)
            await self.objects.put(f"purges/{_now_ms():013d}-{uuid.uuid4().hex[:8]}", b"1")
        await self._notify(user_id)
        await self.feed.publish([user_id], op="forget")
        return counts

    # what other replicas did --------------------------------------------------------------------------

    async def refresh_users(self, user_ids: Iterable[str]) -> None:
        """Make this replica's caches and keyword index agree with the table for these users (one commit)."""
        users = sorted(set(user_ids))
        if not users:
            return
        for user_id in users:
            self._cache.drop(user_id)
        async with self._lock:
            await self._lance.table.checkout_latest()
            docs = [doc for user_id in users async for batch in self._user_keyword_docs(user_id) for doc in batch]
            for user_id in users:
                await self._keyword.remove_user(user_id)
            await self._keyword.upsert(docs)
            await self._keyword.commit()
        for user_id in users:
            self._cache.drop(user_id)  # a load that started before the new version is not kept
            await self._notify(user_id)

    async def _notify(self, user_id: str) -> None:
        for listener in self._listeners:
            await listener(user_id)

    async def _user_keyword_docs(self, user_id: str) -> AsyncIterator[list[Any]]:
        async for batch in self._lance.batches(_REPAIR_COLUMNS, record_filter(user_id)):
            yield _keyword_docs(batch)

    async def _drain_writes(self) -> None:
        """Wait until every write submitted so far is flushed.

        A job stopped by a forget may have handed records to the batch writer already; they are written even
        though the job was cancelled, so the forget deletes after them, not before.
        """
        if self._writer is not None:
            await self._writer.submit([])

    async def apply_forget(self, user_id: str) -> None:
        """Another replica forgot the user: drop their queued jobs here, then any row a job wrote meanwhile."""
        for listener in self._forget_listeners:
            await listener(user_id)
        await self._drain_writes()
        async with self._lock:
            await self._lance.table.checkout_latest()
            if await self._lance.count(user_id):
                await self._lance.delete(user_id)
            self._cache.drop(user_id)
            self._touches.pop(user_id, None)
            await self._keyword.remove_user(user_id)
            await self._keyword.commit()
        await self._notify(user_id)

    # background work: only the lease holder ----------------------------------------------------------

    async def optimize(self) -> None:
        """Compaction, index builds and purges, on the lease holder only."""
        if not self.lease.held:
            if self._needs_repair:  # a local keyword-index write failed: that repair is ours
                async with self._lock:
                    await self.repair()
                    self._needs_repair = False
            return
        pending = await self.objects.list("purges/")
        if pending:
            self._purge_path.write_text("1")
        await super().optimize()
        for key in pending:
            await self.objects.delete(key)
        await self.feed.cleanup(self.cluster.changes_keep_s)


class LeaderInsightScheduler(InsightScheduler):
    """The weekly insight schedule, run by the lease holder only (activity triggers stay per replica)."""

    def __init__(self, store: ReplicatedStore, queue: JobQueue, settings: Any) -> None:
        super().__init__(store, queue, settings)
        self._lease = store.lease

    async def tick(self) -> list[str]:
        """Enqueue due users' jobs if this replica holds the lease."""
        if not self._lease.held:
            return []
        return await super().tick()


# --- journal -------------------------------------------------------------------------------------------


class Journal:
    """Acknowledged exchanges on object storage until their turns and facts are stored."""

    def __init__(self, objects: ObjectStore, replica: str, queue: JobQueue, dead_after_s: float) -> None:
        self._objects = objects
        self.replica = replica
        self._queue = queue
        self._dead_after_s = dead_after_s
        self.adopted = 0

    def _key(self, job_id: str, replica: str | None = None) -> str:
        return f"{JOURNAL}{replica or self.replica}/{job_id}.json"

    async def record(self, kind: str, user_id: str, payload: dict[str, Any]) -> str:
        """Enqueue locally, then write the journal entry; durable on object storage when this returns."""
        job_id = uuid.uuid4().hex
        await self._queue.enqueue(kind, user_id, payload, job_id=job_id)
        entry = {"job_id": job_id, "kind": kind, "user_id": user_id, "payload": payload}
        await self._objects.put(self._key(job_id), orjson.dumps(entry))
        return job_id

    async def heartbeat(self) -> None:
        """Tell the others this replica is alive."""
        await self._objects.put(f"{REPLICAS}{self.replica}.json", orjson.dumps({"at": time.time()}))

    async def sweep(self) -> int:
        """Remove entries whose exchange (and its facts) are done here; returns how many."""
        removed = 0
        for key in await self._objects.list(f"{JOURNAL}{self.replica}/"):
            job_id = key.rsplit("/", 1)[-1].removesuffix(".json")
            if await self._finished(job_id):
                await self._objects.delete(key)
                removed += 1
        return removed

    async def _finished(self, job_id: str) -> bool:
        job = await self._queue.get(job_id)
        if job is not None and job.get("state") not in ("done", "dead"):
            return False
        facts = await self._queue.get(f"{job_id}:facts")
        return facts is None or facts.get("state") in ("done", "dead")

    async def live_replicas(self) -> set[str]:
        """Replicas whose heartbeat is recent."""
        live = {self.replica}
        for key in await self._objects.list(REPLICAS):
            found = await self._objects.get(key)
            if found is not None and time.time() - float(orjson.loads(found.body)["at"]) < self._dead_after_s:
                live.add(key.rsplit("/", 1)[-1].removesuffix(".json"))
        return live

    async def adopt_orphans(self) -> int:
        """Take over the entries of dead replicas (each claimed by exactly one replica); returns how many."""
        live = await self.live_replicas()
        orphans = []
        for key in await self._objects.list(JOURNAL):
            owner, _, name = key.removeprefix(JOURNAL).partition("/")
            if owner not in live and name.endswith(".json"):
                orphans.append((key, name.removesuffix(".json")))
        random.shuffle(orphans)  # adopters racing for one dead replica's entries mostly take different ones
        limit = asyncio.Semaphore(8)

        async def adopt(key: str, job_id: str) -> bool:
            async with limit:
                return await self._adopt(key, job_id, live)

        taken = sum(await asyncio.gather(*(adopt(key, job_id) for key, job_id in orphans)))
        self.adopted += taken
        if taken:
            log.warning("cluster.journal_adopted", jobs=taken)
        return taken

    async def _adopt(self, key: str, job_id: str, live: set[str]) -> bool:
        if not await self._claim(job_id, live):
            return False
        found = await self._objects.get(key)
        if found is None:  # finished by its owner after all
            return False
        entry = orjson.loads(found.body)
        await self._queue.enqueue(entry["kind"], entry["user_id"], entry["payload"], job_id=job_id)
        await self._objects.put(self._key(job_id), found.body)
        await self._objects.delete(key)
        return True

    async def _claim(self, job_id: str, live: set[str]) -> bool:
        body = orjson.dumps({"by": self.replica, "at": time.time()})
        try:
            await self._objects.put(f"{CLAIMS}{job_id}", body, if_none_match=True)
            return True
        except PreconditionFailed:
            pass
        found = await self._objects.get(f"{CLAIMS}{job_id}")
        if found is None or orjson.loads(found.body).get("by") in live:
            return False
        try:  # the adopter died too: take it over from them
            await self._objects.put(f"{CLAIMS}{job_id}", body, if_match=found.etag)
        except PreconditionFailed:
            return False
        return True


# --- the runtime that owns the loops -------------------------------------------------------------------


class ClusterRuntime:
    """Owns the replica's loops: lease, change feed, journal heartbeat/sweep/adoption (``async with``)."""

    def __init__(self, store: ReplicatedStore, journal: Journal, settings: ClusterSettings) -> None:
        self.store = store
        self.journal = journal
        self.settings = settings
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = asyncio.Event()
        self._recheck: dict[str, float] = {}
        self.synced_at = 0.0

    async def __aenter__(self) -> ClusterRuntime:
        await self.journal.heartbeat()
        await self.store.lease.refresh()
        self._tasks = [
            asyncio.create_task(self._every(self.settings.lease_s / 3, self.store.lease.refresh), name="lease"),
            asyncio.create_task(self._every(self.settings.sync_interval_s, self.sync), name="replica-sync"),
            asyncio.create_task(self._every(self.settings.dead_after_s / 5, self.journal.heartbeat), name="heartbeat"),
            asyncio.create_task(self._every(2.0, self._journal_round), name="journal"),
        ]
        log.info(
            "cluster.joined",
            replica=self.journal.replica,
            leader=self.store.lease.held,
            **self.settings.location.describe(),
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._stopping.set()  # rounds finish (a keyword-index write must not be cut off mid-way)
        _, late = await asyncio.wait(self._tasks, timeout=30.0)
        for task in late:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        with contextlib.suppress(ObjectStoreError):
            await self.journal.sweep()
        await self.store.lease.release()

    def gauges(self) -> dict[str, float]:
        """This replica's view of the cluster, as plain numbers (``memproxy_cluster_*`` in /metrics)."""
        objects = self.store.objects
        return {
            "lease_held": float(self.store.lease.held),
            "sync_age_seconds": time.time() - self.synced_at if self.synced_at else -1.0,
            "journal_adopted": float(self.journal.adopted),
            "object_store_requests": float(objects.requests),
        }

    async def _every(self, interval_s: float, fn: Callable[[], Awaitable[object]]) -> None:
        while not self._stopping.is_set():
            try:
                await fn()
            except (MemoryLayerError, OSError) as error:  # object store down: try again next round
                log.warning("cluster.round_failed", task=fn.__name__, error=repr(error))
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(interval_s):
                    await self._stopping.wait()

    async def sync(self) -> None:
        """Apply other replicas' changes: forgets, then writes (now and again ``settle_s`` later)."""
        now = time.monotonic()
        changes = await self.store.feed.poll()
        for user in dict.fromkeys(u for change in changes if change.op == "forget" for u in change.users):
            await self.store.apply_forget(user)
        changed = {user for change in changes for user in change.users}
        due = {user for user, at in self._recheck.items() if at <= now}
        for user in due:
            del self._recheck[user]
        for user in changed:
            self._recheck[user] = now + self.settings.settle_s
        await self.store.refresh_users(changed | due)
        self.synced_at = time.time()

    async def _journal_round(self) -> None:
        await self.journal.sweep()
        await self.journal.adopt_orphans()
