"""``proxy.mirror``'s settle: a management change answers only once every chat process applied what it wrote."""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, cast

import aiohttp
from aiohttp import web

from proxy.memory.store import Kind, MemoryRecord, MemoryStore, StoreSettings
from proxy.memory.write import JobQueue, LatestChats
from proxy.mirror import WRITER_SOCKET, Mirror, WriterLink, writer_routes
from tests.support.embedder import HashingEmbedder


@asynccontextmanager
async def writer(directory: Path, mirror: Mirror, store: MemoryStore) -> AsyncIterator[None]:
    """The writer's end of the link on ``directory``'s socket."""
    app = web.Application()
    writer_routes(app, mirror, LatestChats(()), cast("JobQueue", None), store)
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=0.1)  # as the writer runs it
    await runner.setup()
    await web.UnixSite(runner, str(directory / WRITER_SOCKET)).start()
    try:
        yield
    finally:
        mirror.close()
        await runner.cleanup()


async def _nothing() -> None:
    return None


async def test_a_delete_settles_only_once_a_slow_chat_process_applied_it(tmp_path: Path) -> None:
    """The follower takes 0.2 s an op: the writer's delete returns from ``settled`` after the follower's cache
    and keyword index took it, not before."""
    mirror, applied = Mirror(), []
    with tempfile.TemporaryDirectory(prefix="mp-") as short:  # a Unix socket's path is short
        directory = Path(short)
        async with (
            MemoryStore(StoreSettings(path=tmp_path), HashingEmbedder()) as store,
            writer(directory, mirror, store),
            MemoryStore(StoreSettings(path=tmp_path), HashingEmbedder(), follower=True) as follower,
        ):
            store.mirror_to(mirror.emit)
            follow = follower.follow

            async def slow_follow(op: str, args: tuple[Any, ...]) -> None:
                await asyncio.sleep(0.2)
                await follow(op, args)
                applied.append(op)

            follower.follow = slow_follow  # type: ignore[method-assign]
            async with WriterLink(directory, follower, LatestChats(()), lambda *_: None, _nothing) as link:
                assert await link.wait_connected(5)
                record = MemoryRecord(user_id="ann", kind=Kind.FACT, text="Ann likes genmaicha",
                                      created_at=datetime(2026, 1, 1, tzinfo=UTC))  # fmt: skip
                (stored,) = await store.add([record])
                assert await mirror.settled()
                assert {"upsert", "keyword"} <= set(applied)
                applied.clear()
                assert await store.delete_many("ann", [stored.id]) == [stored.id]
                assert applied == []  # the ops are on their way, not applied yet
                assert await mirror.settled()
                assert applied == ["remove", "keyword"]
                hits = await follower.keyword_search("ann", "genmaicha", 5)
                assert hits == []


async def test_settled_gives_up_on_a_follower_that_never_says_so_and_not_on_one_that_left(tmp_path: Path) -> None:
    """A stream whose reader never acknowledges: ``settled`` is False after its timeout (and counted); once that
    stream is gone, nothing is waited for."""
    mirror = Mirror()
    assert await mirror.settled(0.1)  # nobody follows: nothing to wait for
    with tempfile.TemporaryDirectory(prefix="mp-") as short:
        directory = Path(short)
        async with (
            MemoryStore(StoreSettings(path=tmp_path), HashingEmbedder()) as store,
            writer(directory, mirror, store),
            aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(directory / WRITER_SOCKET))) as http,
        ):
            response = await http.get("http://writer/_memproxy/changes")
            await response.content.readexactly(4)  # the hello's length: the stream is followed
            assert not await mirror.settled(0.2)
            assert mirror.unsettled == 1
            waiting = asyncio.create_task(mirror.settled(10))
            await asyncio.sleep(0.05)
            response.close()  # the follower goes (it empties its caches when it comes back)
            assert await asyncio.wait_for(waiting, 5)
