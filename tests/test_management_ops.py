"""Bulk add and dead letters through the management API and the CLI: the real app, engine, LanceDB and Tantivy."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
import pytest_asyncio
from aiohttp.test_utils import TestClient, TestServer

from proxy.app import build_app
from proxy.state import STATE
from tests.fake_upstream import FakeUpstream
from tests.support import polling
from tests.support.live_app import admin_settings
from tests.support.processes import MEMPROXY, child_env

pytestmark = pytest.mark.asyncio(loop_scope="module")

KEY = "adm-ops-key-19c2"
AUTH = {"Authorization": f"Bearer {KEY}"}
Client = TestClient[Any, Any]


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def api(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Client]:
    """The proxy with memory on (a job with a corrupt payload gives up at once)."""
    async with FakeUpstream() as upstream:
        settings = admin_settings(
            upstream={"base_url": upstream.base_url},
            admin={"api_key": KEY},
            storage={"path": str(tmp_path_factory.mktemp("ops"))},
            memory={"retrieval_timeout_ms": 20_000, "read_queue_ms": 20_000},
            retrieval={"arm_timeout_ms": 20_000},
        )
        client = TestClient(TestServer(build_app(settings), host="127.0.0.1"))
        await client.start_server()
        yield client
        await client.close()


async def eventually(check: Callable[[], Awaitable[Any]], within_s: float = 30.0) -> Any:
    """The first truthy result of ``check``, polled every 100 ms until ``within_s``."""
    return await polling.eventually(check, within_s, every_s=0.1)


async def _batch(api: Client, user: str, items: list[dict[str, Any]]) -> Any:
    return await api.post(f"/v1/memory/users/{user}/memories:batch", json={"memories": items}, headers=AUTH)


async def test_batch_adds_searchable_facts_once(api: Client) -> None:
    """A batch of facts is searchable on return; sending it again adds nothing."""
    items = [
        {"text": "Grace keeps bees on her roof"},
        {"text": "Grace is allergic to penicillin", "importance": 9},
        {"text": "Grace moved to Oslo", "id": "grace-oslo", "created_at": "2024-05-01T12:00:00Z"},
    ]
    first = await _batch(api, "grace", items)
    assert first.status == 200, await first.text()
    body = await first.json()
    assert (body["added"], body["existing"]) == (3, 0)
    assert "grace-oslo" in body["ids"]
    again = await (await _batch(api, "grace", items)).json()
    assert (again["added"], again["existing"]) == (0, 3)
    listed = await (await api.get("/v1/memory/users/grace/memories", headers=AUTH)).json()
    assert len(listed["data"]) == 3
    oslo = next(m for m in listed["data"] if m["id"] == "grace-oslo")
    assert oslo["created_at"].startswith("2024-05-01T12:00:00")
    found = await (await api.post("/v1/memory/users/grace/search", json={"query": "bees"}, headers=AUTH)).json()
    assert "Grace keeps bees on her roof" in [r["text"] for r in found["results"]]


async def test_bad_batch_is_refused_whole(api: Client) -> None:
    """One bad item refuses the whole batch with its position named, and nothing of it is stored."""
    items = [{"text": "Hal owns a red kayak"}, {"text": "  "}]
    response = await _batch(api, "hal", items)
    assert response.status == 400
    error = (await response.json())["error"]
    assert error["param"].startswith("memories.1.text")
    listed = await (await api.get("/v1/memory/users/hal/memories", headers=AUTH)).json()
    assert listed["data"] == []


async def test_batch_cannot_take_another_users_id(api: Client) -> None:
    """An id already used by another user's memory is a 409 and writes nothing."""
    assert (await _batch(api, "ivy", [{"text": "Ivy paints", "id": "shared-id"}])).status == 200
    response = await _batch(api, "jon", [{"text": "Jon sings"}, {"text": "Jon paints", "id": "shared-id"}])
    assert response.status == 409
    listed = await (await api.get("/v1/memory/users/jon/memories", headers=AUTH)).json()
    assert listed["data"] == []


async def _dead(api: Client) -> list[dict[str, Any]]:
    response = await api.get("/v1/memory/dead-letters", headers=AUTH)
    assert response.status == 200
    return list((await response.json())["data"])


async def test_failed_memory_job_is_listed_and_requeued(api: Client) -> None:
    """A memory job that gave up is listed with its error; requeued, it runs again."""
    # an exchange whose stored payload is corrupt (as after a bad manual edit of the queue): the writer gives up
    await api.server.app[STATE].memory.jobs.enqueue("exchange", "kim", {"corrupt": True})
    [job] = await eventually(lambda: _dead(api))
    assert (job["user_id"], job["kind"], job["attempts"]) == ("kim", "exchange", 1)
    assert "invalid job payload" in job["last_error"]
    requeued = await api.post(f"/v1/memory/dead-letters/{job['id']}/requeue", headers=AUTH)
    assert requeued.status == 200
    assert (await requeued.json()) == {"id": job["id"], "kind": job["kind"], "status": "queued"}

    async def died_again() -> bool:
        return any(d["id"] == job["id"] and d["updated_at"] > job["updated_at"] for d in await _dead(api))

    await eventually(died_again)  # it ran again (and, its payload still corrupt, gave up again)
    missing = await api.post("/v1/memory/dead-letters/no-such-job/requeue", headers=AUTH)
    assert missing.status == 404
    assert (await api.get("/v1/memory/dead-letters", headers={})).status == 401


async def test_cli_lists_and_requeues_dead_letters(api: Client) -> None:
    """`memproxy dead-letters list` shows the dead job and `requeue ID` queues it again."""
    [job, *_] = await eventually(lambda: _dead(api))
    url = str(api.make_url("/"))
    env = child_env(MEMPROXY_ADMIN__API_KEY=KEY)

    async def run(*args: str) -> tuple[int, str]:
        proc = await asyncio.create_subprocess_exec(
            str(MEMPROXY),
            "dead-letters",
            *args,
            "--url",
            url,
            env=env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await proc.communicate()
        return int(proc.returncode or 0), out.decode() + err.decode()

    code, listed = await run("list", "--json")
    assert code == 0, listed
    assert job["id"] in [d["id"] for d in json.loads(listed)["data"]]
    code, text = await run("requeue", job["id"])
    assert code == 0, text
    assert f"requeued {job['id']}" in text
