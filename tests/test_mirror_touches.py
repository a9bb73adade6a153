"""The writer's end of ``proxy.mirror``: access times a chat process sends, with which of them are young."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, cast

import orjson
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from proxy.memory.store import Kind, MemoryRecord, MemoryStore, StoreSettings
from proxy.memory.write import JobQueue, LatestChats
from proxy.mirror import Mirror, writer_routes
from tests.support.embedder import HashingEmbedder

T0 = datetime(2025, 3, 1, tzinfo=UTC)


def fact(text: str, hours: int = 0) -> MemoryRecord:
    return MemoryRecord(user_id="alice", kind=Kind.FACT, text=text, created_at=T0 + timedelta(hours=hours))


async def test_the_writer_writes_the_access_times_the_chat_process_did_not_call_young(tmp_path: Path) -> None:
    """A chat process (which caches the user; the writer may not) says which records are young: the writer shows
    their access time and never writes it; the others reach LanceDB at the next flush."""
    at = T0 + timedelta(days=2, minutes=5)
    async with MemoryStore(StoreSettings(path=tmp_path), HashingEmbedder()) as store:
        young, old = await store.add([fact("Alice drinks oat milk", hours=48), fact("Alice rows")])
        app = web.Application()
        writer_routes(app, Mirror(), LatestChats(()), cast("JobQueue", None), store)
        async with TestClient(TestServer(app)) as client:
            body = orjson.dumps([["alice", [young.id, old.id], at.isoformat(), [young.id]]])
            response = await client.post("/_memproxy/touches", data=body)
            assert response.status == 204
        assert [r.last_accessed_at for r in await store.read_many("alice", [young.id, old.id])] == [at, at]
    async with MemoryStore(StoreSettings(path=tmp_path), HashingEmbedder()) as store:
        stored: dict[str, Any] = {r.id: r.last_accessed_at for r in await store.read_many("alice", [young.id, old.id])}
        assert stored == {young.id: None, old.id: at}
