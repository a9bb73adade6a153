"""Replica leases: one holder at a time for the store's background work, by conditional writes on one object.

The lease (``leases/maintenance.json``) is taken and renewed with conditional writes: ``If-None-Match`` to
create it, ``If-Match`` on the ETag read to take over an expired one or renew our own.
"""

from __future__ import annotations

import contextlib
import time

import orjson
import structlog

from proxy.memory.store.objectstore import ObjectStore, ObjectStoreError, PreconditionFailed

log = structlog.get_logger("memproxy.cluster")

LEASE_KEY = "leases/maintenance.json"


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
