"""The journal: acknowledged exchanges kept on object storage until their turns and facts are stored.

Every acknowledged exchange is in the journal (``journal/<replica>/<job>.json``, written before ``record``
returns, removed when its turns and facts are stored). Each replica writes a heartbeat
(``replicas/<replica>.json``); the entries of a replica whose heartbeat is older than ``dead_after_s`` are
adopted by another one (claimed with ``If-None-Match``, so by exactly one) and replayed under the same job
id: record ids derive from it, so a replay neither duplicates nor loses a memory.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections.abc import Mapping
from typing import Any, Protocol

import orjson
import structlog

from proxy.memory.store.objectstore import ObjectStore, PreconditionFailed

log = structlog.get_logger("memproxy.cluster")

JOURNAL = "journal/"
CLAIMS = "journal-claims/"
REPLICAS = "replicas/"


class LocalJobQueue(Protocol):
    """What the journal needs of the local job queue (``proxy.memory.write``'s queue is one)."""

    async def enqueue(self, kind: str, user_id: str, payload: Mapping[str, Any], *, job_id: str | None = None) -> str:
        """Add a job and return its id once the commit is durable."""
        ...

    async def get(self, job_id: str) -> dict[str, Any] | None:
        """One job's row as a dict, or None."""
        ...


class Journal:
    """Acknowledged exchanges on object storage until their turns and facts are stored."""

    def __init__(self, objects: ObjectStore, replica: str, queue: LocalJobQueue, dead_after_s: float) -> None:
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
