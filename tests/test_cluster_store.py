"""Replicas over object storage: two stores on one moto S3 bucket, real LanceDB, Tantivy and the shipped model."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import lancedb
import pytest

from proxy.memory.embedders.base import BaseEmbedder
from proxy.memory.store import table as table_module
from proxy.memory.store.cluster import ClusterSettings
from proxy.memory.store.journal import Journal
from proxy.memory.store.lease import Lease
from proxy.memory.store.manifest import Manifest, RemoteManifest
from proxy.memory.store.memory_store import StoreSettings
from proxy.memory.store.objectstore import ObjectStore, StorageLocation
from proxy.memory.store.records import Kind, MemoryRecord, arrow_schema
from proxy.memory.store.replicated import ReplicatedStore
from proxy.memory.store.runtime import ClusterRuntime
from proxy.memory.write.job_types import JobQueueSettings
from proxy.memory.write.queue import JobQueue
from tests.support.s3 import bucket_uri, moto_server, s3_environ

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]


@pytest.fixture(scope="module")
def endpoint() -> Iterator[str]:
    """moto's S3 server on 127.0.0.1, shared by the module's tests."""
    with moto_server() as url:
        yield url


def _cluster(endpoint: str, uri: str) -> ClusterSettings:
    location = StorageLocation.from_settings(uri, {}, s3_environ(endpoint))
    return ClusterSettings(location, sync_interval_s=0.2, lease_s=3.0, settle_s=2.0, dead_after_s=3.0)


@contextlib.asynccontextmanager
async def replica(
    cluster: ClusterSettings, local: BaseEmbedder, path: Path, name: str
) -> AsyncIterator[tuple[ReplicatedStore, ClusterRuntime]]:
    """One replica: its store on the shared bucket, its own local disk, queue and loops."""
    objects = ObjectStore(cluster.location)
    await objects.ensure_bucket()
    store = ReplicatedStore(StoreSettings(path=path), local, cluster, objects, name)
    queue = JobQueue(JobQueueSettings(path=path / "jobs.sqlite3"))
    async with store, queue, ClusterRuntime(store, Journal(objects, name, queue, 3.0), cluster) as runtime:
        yield store, runtime
    objects.close()


@contextlib.asynccontextmanager
async def two_replicas(
    endpoint: str, local: BaseEmbedder, tmp_path: Path
) -> AsyncIterator[tuple[ReplicatedStore, ReplicatedStore]]:
    """Replicas A and B on a fresh bucket."""
    cluster = _cluster(endpoint, bucket_uri())
    async with (
        replica(cluster, local, tmp_path / "a", "a") as (a, _),
        replica(cluster, local, tmp_path / "b", "b") as (b, _),
    ):
        yield a, b


async def eventually(check: Callable[[], Awaitable[bool]], within_s: float = 10.0) -> float:
    """Seconds until ``check`` holds; fails after ``within_s``."""
    started = time.monotonic()
    while not await check():
        assert time.monotonic() - started < within_s, "condition not met in time"
        await asyncio.sleep(0.05)
    return time.monotonic() - started


def fact(user: str, text: str) -> MemoryRecord:
    """A fact of ``user``."""
    return MemoryRecord(user_id=user, kind=Kind.FACT, text=text)


async def found(store: ReplicatedStore, local: BaseEmbedder, user: str, query: str) -> dict[str, Any]:
    """What each arm of ``store`` returns for ``query`` (texts)."""
    vector = (await local.embed_query(query)).reshape(-1)
    dense = [hit.record.text for hit in await store.vector_search(user, vector, 5)]
    keyword = [hit.record.text for hit in await store.keyword_search(user, query, 5)]
    return {"dense": dense, "keyword": keyword}


async def test_lease_has_one_holder_and_passes_on(endpoint: str) -> None:
    """Two replicas race for the maintenance lease: one wins; it passes on at release and after expiry."""
    objects = ObjectStore(_cluster(endpoint, bucket_uri()).location)
    await objects.ensure_bucket()
    a, b = Lease(objects, "a", ttl_s=1.0), Lease(objects, "b", ttl_s=1.0)
    results = await asyncio.gather(a.refresh(), b.refresh())
    assert sorted(results) == [False, True]
    first, second = (a, b) if a.held else (b, a)
    assert await first.refresh()
    assert not await second.refresh()
    await first.release()
    assert await second.refresh()
    assert not await first.refresh()
    await asyncio.sleep(1.2)  # the holder stops renewing (killed): the lease expires
    assert await first.refresh()
    objects.close()


async def test_replicas_started_together_on_an_empty_bucket_all_open(
    endpoint: str, local: BaseEmbedder, tmp_path: Path
) -> None:
    """Three replicas open their stores at once on a fresh bucket: one creates the live table, the others open
    it, and the table has exactly one creation in its history (two creations both commit in LanceDB, the later
    as an Overwrite: a CI run saw the winner's first append fail on it)."""
    cluster = _cluster(endpoint, bucket_uri())
    async with contextlib.AsyncExitStack() as stack:
        stores = await asyncio.gather(
            *(stack.enter_async_context(replica(cluster, local, tmp_path / n, n)) for n in ("a", "b", "c"))
        )
        (a, _), (b, _), _ = stores
        [added] = await a.add([fact("alice", "Alice keeps bees on her roof")])

        async def b_has_it() -> bool:
            return await b.get("alice", added.id) is not None

        await eventually(b_has_it)
        assert await a._lance.table.count_rows() == 1  # a later creation would have overwritten it


async def test_a_replica_that_lost_the_claim_opens_the_winners_table(
    endpoint: str, local: BaseEmbedder, tmp_path: Path
) -> None:
    """A replica that finds the manifest claimed but the table not yet there waits for the claimant's table and
    opens it rather than creating one (which would overwrite what the claimant writes first)."""
    cluster = _cluster(endpoint, bucket_uri())
    objects = ObjectStore(cluster.location)
    await objects.ensure_bucket()
    assert await RemoteManifest(objects).claim(Manifest("memories_1", local.model_id, local.dim)) is None
    opening = asyncio.create_task(stack_open(cluster, local, tmp_path / "b", "b"))
    await asyncio.sleep(1.0)
    assert not opening.done()
    lance = await lancedb.connect_async(
        cluster.location.child("lance"), storage_options=cluster.location.lance_options()
    )
    assert list((await lance.list_tables()).tables) == []  # it waits: it created nothing
    created = await lance.create_table("memories_1", schema=arrow_schema(local.dim))
    b, stack = await asyncio.wait_for(opening, 30)
    try:
        assert await b._lance.table.version() == await created.version() == 1
    finally:
        await stack.aclose()
        objects.close()


async def test_a_claimant_that_never_creates_the_table_is_replaced(
    endpoint: str, local: BaseEmbedder, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """If the replica that claimed the manifest dies before creating the table, another creates it after waiting."""
    monkeypatch.setattr(table_module, "CREATOR_WAIT_S", 0.5)
    cluster = _cluster(endpoint, bucket_uri())
    objects = ObjectStore(cluster.location)
    await objects.ensure_bucket()
    assert await RemoteManifest(objects).claim(Manifest("memories_1", local.model_id, local.dim)) is None
    async with replica(cluster, local, tmp_path / "b", "b") as (b, _):
        [added] = await b.add([fact("alice", "Alice keeps bees on her roof")])
        assert await b.get("alice", added.id) is not None
    objects.close()


async def stack_open(
    cluster: ClusterSettings, local: BaseEmbedder, path: Path, name: str
) -> tuple[ReplicatedStore, contextlib.AsyncExitStack]:
    """A replica opened in the background: its store and the stack that closes it."""
    stack = contextlib.AsyncExitStack()
    store, _ = await stack.enter_async_context(replica(cluster, local, path, name))
    return store, stack


async def test_a_write_on_one_replica_is_found_on_the_other(endpoint: str, local: BaseEmbedder, tmp_path: Path) -> None:
    """A fact stored through replica A is found by both arms of replica B (whose cache was warm) within seconds."""
    async with two_replicas(endpoint, local, tmp_path) as (a, b):
        await a.add([fact("alice", "Alice keeps bees on her roof")])

        async def b_sees_bees() -> bool:  # and B's cache is warm for alice from then on
            return (await found(b, local, "alice", "bees"))["dense"] == ["Alice keeps bees on her roof"]

        await eventually(b_sees_bees)
        await a.add([fact("alice", "Alice is allergic to walnuts")])

        async def b_sees_both() -> bool:
            arms = await found(b, local, "alice", "walnuts allergy")
            return "Alice is allergic to walnuts" in arms["dense"] and "Alice is allergic to walnuts" in arms["keyword"]

        delay = await eventually(b_sees_both)
        assert delay < 5.0


async def test_concurrent_writes_for_one_user_neither_lose_nor_duplicate(
    endpoint: str, local: BaseEmbedder, tmp_path: Path
) -> None:
    """Two replicas writing 40 facts each for the same user at once: exactly 80 distinct records in the table."""
    async with two_replicas(endpoint, local, tmp_path) as (a, b):
        pairs = [(name, store) for name, store in (("a", a), ("b", b))]
        writes = [store.add([fact("bob", f"fact {name} {i}")]) for i in range(40) for name, store in pairs]
        await asyncio.gather(*writes)
        await a._lance.table.checkout_latest()
        ids = [r.id for r in (await a.list("bob", limit=500)).data]
        assert len(ids) == 80
        assert len(set(ids)) == 80


async def test_forget_user_reaches_the_other_replica(endpoint: str, local: BaseEmbedder, tmp_path: Path) -> None:
    """Forgetting a user through replica A leaves nothing that replica B's arms (warm cache) can return."""
    async with two_replicas(endpoint, local, tmp_path) as (a, b):
        await a.add([fact("carol", "Carol's locker code is 4471"), fact("dave", "Dave likes jazz")])

        async def b_has_carol() -> bool:
            return bool((await found(b, local, "carol", "locker code"))["keyword"])

        await eventually(b_has_carol)
        await a.forget_user("carol")

        async def b_forgot() -> bool:
            arms = await found(b, local, "carol", "locker code")
            return arms == {"dense": [], "keyword": []}

        await eventually(b_forgot)
        assert (await found(b, local, "dave", "jazz"))["dense"] == ["Dave likes jazz"]


async def test_a_dead_replicas_journal_is_replayed_by_exactly_one_other(endpoint: str, tmp_path: Path) -> None:
    """An exchange journaled by a replica that died is enqueued once, by one live replica, under its job id."""
    location = _cluster(endpoint, bucket_uri()).location
    objects = ObjectStore(location)
    await objects.ensure_bucket()
    queues = [JobQueue(JobQueueSettings(path=tmp_path / f"{n}.sqlite3")) for n in ("dead", "b", "c")]
    async with queues[0], queues[1], queues[2]:
        dead = Journal(objects, "dead", queues[0], dead_after_s=3.0)
        job_id = await dead.record("exchange", "erin", {"text": "hello"})
        b, c = Journal(objects, "b", queues[1], 3.0), Journal(objects, "c", queues[2], 3.0)
        await b.heartbeat()
        await c.heartbeat()
        taken = await asyncio.gather(b.adopt_orphans(), c.adopt_orphans())
        assert sorted(taken) == [0, 1]
        holders = [q for q in queues[1:] if await q.get(job_id) is not None]
        assert len(holders) == 1
        assert (await holders[0].get(job_id) or {})["user_id"] == "erin"
    objects.close()
