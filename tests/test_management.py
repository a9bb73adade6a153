"""The management API in-process: the real app, the real memory engine, LanceDB and Tantivy in tmp dirs.

One engine serves the module (it takes seconds to load); each test works on its own user ids. The memory-side
LLM points at the fake upstream, so nothing leaves 127.0.0.1.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import quote

import pytest
import pytest_asyncio
from aiohttp.test_utils import TestClient, TestServer

from proxy.app import build_app
from proxy.management.memories import OPENAPI_PATH
from proxy.memory.store.records import Kind, MemoryRecord
from proxy.state import STATE
from tests.fake_upstream import FakeUpstream
from tests.support.live_app import admin_settings

pytestmark = pytest.mark.asyncio(loop_scope="module")

KEY = "adm-test-key-7f3a"
AUTH = {"Authorization": f"Bearer {KEY}"}
Client = TestClient[Any, Any]


async def _client(**sections: Any) -> Client:
    client = TestClient(TestServer(build_app(admin_settings(**sections)), host="127.0.0.1"))
    await client.start_server()
    return client


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def api(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Client]:
    """The proxy with memory on and the admin key set, shared by the module."""
    async with FakeUpstream() as upstream:
        client = await _client(
            upstream={"base_url": upstream.base_url},
            admin={"api_key": KEY},
            storage={"path": str(tmp_path_factory.mktemp("mgmt"))},
            retrieval={"arm_timeout_ms": 10_000},
        )  # a loaded CI box must not degrade arms
        yield client
        await client.close()


async def add(api: Client, user: str, text: str, **extra: Any) -> dict[str, Any]:
    """Add a fact through the API and return the created record."""
    response = await api.post(f"/v1/memory/users/{user}/memories", json={"text": text, **extra}, headers=AUTH)
    assert response.status == 201, await response.text()
    return dict(await response.json())


async def listed(api: Client, user: str, query: str = "") -> list[dict[str, Any]]:
    """The first page of the user's memories."""
    response = await api.get(f"/v1/memory/users/{user}/memories{query}", headers=AUTH)
    assert response.status == 200, await response.text()
    return list((await response.json())["data"])


async def error_of(response: Any, status: int) -> dict[str, Any]:
    """The OpenAI-style error object of ``response``, after checking its status."""
    assert response.status == status, await response.text()
    return dict((await response.json())["error"])


# --- access -------------------------------------------------------------------------------------------


async def test_missing_or_wrong_key_is_401(api: Client) -> None:
    """Without the right bearer key nothing is shown, and the answer is an OpenAI-style 401."""
    for headers in (
        {},
        {"Authorization": "Bearer nope"},
        {"Authorization": f"Basic {KEY}"},
        {"Authorization": KEY},
        {"Authorization": "Bearer " + KEY + "x"},
    ):
        error = await error_of(await api.get("/v1/memory/users/alice/memories", headers=headers), 401)
        assert error["code"] == "invalid_api_key"
        assert KEY not in error["message"]


async def test_no_admin_key_configured_turns_the_api_off() -> None:
    """With no admin key configured every management route says the API is off (503), even with a key."""
    client = await _client(memory={"enabled": False})
    try:
        for method, path in (
            ("GET", "/v1/memory/users"),
            ("DELETE", "/v1/memory/users/alice"),
            ("GET", "/v1/memory/openapi.json"),
        ):
            error = await error_of(await client.request(method, path, headers=AUTH), 503)
            assert error["code"] == "management_disabled"
            assert "MEMPROXY_ADMIN__API_KEY" in error["message"]
    finally:
        await client.close()


async def test_memory_disabled_is_503_memory_disabled() -> None:
    """With memory switched off, the management API answers that memory is disabled."""
    client = await _client(memory={"enabled": False}, admin={"api_key": KEY})
    try:
        error = await error_of(await client.get("/v1/memory/users/alice/memories", headers=AUTH), 503)
        assert error["code"] == "memory_disabled"
    finally:
        await client.close()


@pytest.mark.parametrize("user", ["has space", "x" * 129, "semi;colon", "quote'd", "%00"])
async def test_bad_user_id_is_400(api: Client, user: str) -> None:
    """A user id outside 1-128 safe characters is refused with a 400 naming user_id."""
    response = await api.get(f"/v1/memory/users/{quote(user, safe='')}/memories", headers=AUTH)
    error = await error_of(response, 400)
    assert error["param"] == "user_id"


# --- memories -----------------------------------------------------------------------------------------


async def test_added_fact_is_searchable_at_once(api: Client) -> None:
    """A fact added by hand is listed, readable by id, and injected for a related message right away."""
    record = await add(api, "ann", "Ann is allergic to peanuts", importance=9, category="health")
    assert record["kind"] == "fact"
    assert record["importance"] == 9
    assert record["category"] == "health"
    got = await api.get(f"/v1/memory/users/ann/memories/{record['id']}", headers=AUTH)
    assert (await got.json())["text"] == "Ann is allergic to peanuts"
    found = await api.post("/v1/memory/users/ann/search", json={"query": "can Ann eat peanuts?", "k": 5}, headers=AUTH)
    preview = await found.json()
    assert preview["results"][0]["id"] == record["id"]
    assert preview["results"][0]["arms"]
    assert "Ann is allergic to peanuts" in preview["injected_block"]
    assert "dense" in preview["arms"]


async def test_pages_walk_every_memory_once_newest_first(api: Client) -> None:
    """Paging with limit and next_cursor returns every memory exactly once, newest first."""
    texts = [f"Bo fact number {i}" for i in range(7)]
    for text in texts:
        await add(api, "bo", text)
    seen: list[str] = []
    cursor = None
    while True:
        query = "?limit=3" + (f"&cursor={cursor}" if cursor else "")
        page = await (await api.get(f"/v1/memory/users/bo/memories{query}", headers=AUTH)).json()
        seen += [record["text"] for record in page["data"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert seen == texts[::-1]


@pytest.mark.parametrize(
    ("query", "param"),
    [
        ("?limit=0", "limit"),
        ("?limit=501", "limit"),
        ("?kind=bogus", "kind"),
        ("?cursor=!!!", "cursor"),
        ("?colour=red", "colour"),
    ],
)
async def test_bad_list_query_is_400_naming_the_parameter(api: Client, query: str, param: str) -> None:
    """A malformed query parameter is a 400 whose param names it."""
    error = await error_of(await api.get(f"/v1/memory/users/bo/memories{query}", headers=AUTH), 400)
    assert error["param"] == param


async def test_kind_filter(api: Client) -> None:
    """Listing with kind shows only that kind."""
    memory = api.server.app[STATE].memory
    await memory.store.add([MemoryRecord(user_id="cy", kind=Kind.SUMMARY, text="Cy talked about trains")])
    await add(api, "cy", "Cy likes trains")
    assert [r["kind"] for r in await listed(api, "cy", "?kind=summary")] == ["summary"]
    assert [r["text"] for r in await listed(api, "cy", "?kind=fact")] == ["Cy likes trains"]


@pytest.mark.parametrize(("body", "param"), [
    ({}, "text"), ({"text": "   "}, "text"), ({"text": "x" * 4001}, "text"),
    ({"text": "ok", "importance": 11}, "importance"), ({"text": "ok", "importance": "5"}, "importance"),
    ({"text": "ok", "importance": None}, "importance"),
    ({"text": "ok", "kind": "turn"}, "kind"), ({"text": "ok", "colour": "red"}, "colour"),
    ({"text": "ok", "category": "Not A Category"}, "category"),
])  # fmt: skip
async def test_bad_new_memory_is_400_naming_the_field(api: Client, body: dict[str, Any], param: str | None) -> None:
    """An invalid body is refused with a 400 that names the offending field, and nothing is stored."""
    response = await api.post("/v1/memory/users/dee/memories", json=body, headers=AUTH)
    error = await error_of(response, 400)
    assert error["param"] == param
    assert await listed(api, "dee") == []


async def test_body_that_is_not_json_is_400(api: Client) -> None:
    """A body that is not JSON gets a 400 saying so."""
    response = await api.post("/v1/memory/users/dee/memories", data=b"{text:", headers=AUTH)
    assert (await error_of(response, 400))["code"] == "invalid_json"


async def test_text_edit_keeps_the_old_version_in_history(api: Client) -> None:
    """Editing text gives a new current record; the old one stays readable as history, superseded by it."""
    old = await add(api, "eve", "Eve lives in Paris", importance=6)
    response = await api.patch(
        f"/v1/memory/users/eve/memories/{old['id']}", json={"text": "Eve lives in Berlin"}, headers=AUTH
    )
    new = await response.json()
    assert response.status == 200
    assert new["text"] == "Eve lives in Berlin"
    assert new["id"] != old["id"]
    assert [r["id"] for r in await listed(api, "eve")] == [new["id"]]
    history = await (await api.get(f"/v1/memory/users/eve/memories/{old['id']}", headers=AUTH)).json()
    assert history["valid"] is False
    assert history["superseded_by"] == new["id"]
    assert {r["id"] for r in await listed(api, "eve", "?include_invalid=true")} == {old["id"], new["id"]}
    preview = await (
        await api.post("/v1/memory/users/eve/search", json={"query": "where does Eve live"}, headers=AUTH)
    ).json()
    assert "Berlin" in preview["injected_block"]
    assert "Paris" not in preview["injected_block"]


async def test_importance_edit_keeps_the_id(api: Client) -> None:
    """Changing only the importance edits the record in place."""
    record = await add(api, "fay", "Fay plays the cello", importance=3)
    response = await api.patch(f"/v1/memory/users/fay/memories/{record['id']}", json={"importance": 8}, headers=AUTH)
    edited = await response.json()
    assert edited["id"] == record["id"]
    assert edited["importance"] == 8


@pytest.mark.parametrize(("body", "param"), [({}, None), ({"text": ""}, "text"), ({"importance": 0}, "importance")])
async def test_bad_edit_is_400(api: Client, body: dict[str, Any], param: str | None) -> None:
    """An edit with nothing to change, or an invalid value, is a 400."""
    record = await add(api, "gus", "Gus drives a van")
    response = await api.patch(f"/v1/memory/users/gus/memories/{record['id']}", json=body, headers=AUTH)
    assert (await error_of(response, 400))["param"] == param


async def test_delete_one_and_scoping(api: Client) -> None:
    """Deleting removes one memory for good; another user's path can neither see nor delete it."""
    keep = await add(api, "hal", "Hal collects stamps")
    gone = await add(api, "hal", "Hal owns a red bike")
    for method in ("GET", "DELETE"):
        response = await api.request(method, f"/v1/memory/users/ivy/memories/{keep['id']}", headers=AUTH)
        await error_of(response, 404)
    response = await api.delete(f"/v1/memory/users/hal/memories/{gone['id']}", headers=AUTH)
    assert await response.json() == {"id": gone["id"], "deleted": True}
    await error_of(await api.get(f"/v1/memory/users/hal/memories/{gone['id']}", headers=AUTH), 404)
    await error_of(await api.delete(f"/v1/memory/users/hal/memories/{gone['id']}", headers=AUTH), 404)
    assert [r["id"] for r in await listed(api, "hal")] == [keep["id"]]
    preview = await (await api.post("/v1/memory/users/hal/search", json={"query": "Hal red bike"}, headers=AUTH)).json()
    assert gone["id"] not in {r["id"] for r in preview["results"]}


async def test_forget_user_erases_everything_and_only_them(api: Client) -> None:
    """Forgetting a user returns counts, and afterwards nothing of theirs is listed, exported or found."""
    for i in range(3):
        await add(api, "jo", f"Jo likes jazz record {i}")
    await add(api, "kim", "Kim likes jazz too")
    response = await api.delete("/v1/memory/users/jo", headers=AUTH)
    result = await response.json()
    assert response.status == 200
    assert result["deleted"]["fact"] == 3
    assert result["total"] == 3
    assert await listed(api, "jo") == []
    assert await (await api.get("/v1/memory/users/jo/export", headers=AUTH)).text() == ""
    preview = await (await api.post("/v1/memory/users/jo/search", json={"query": "jazz"}, headers=AUTH)).json()
    assert preview["results"] == []
    assert preview["injected_block"] == ""
    users = await (await api.get("/v1/memory/users", headers=AUTH)).json()
    assert "jo" not in {u["user_id"] for u in users["data"]}
    assert [r["text"] for r in await listed(api, "kim")] == ["Kim likes jazz too"]


async def test_export_is_jsonl_with_history(api: Client) -> None:
    """The export is newline-delimited JSON of every record, history included, as a download."""
    old = await add(api, "lee", "Lee works at a bakery")
    await api.patch(f"/v1/memory/users/lee/memories/{old['id']}", json={"text": "Lee works at a library"}, headers=AUTH)
    response = await api.get("/v1/memory/users/lee/export", headers=AUTH)
    assert response.headers["Content-Type"].startswith("application/x-ndjson")
    assert "attachment" in response.headers["Content-Disposition"]
    rows = [json.loads(line) for line in (await response.text()).splitlines()]
    assert [r["text"] for r in rows] == ["Lee works at a bakery", "Lee works at a library"]
    assert [r["valid"] for r in rows] == [False, True]
    assert all(r["user_id"] == "lee" and "embedding" not in r for r in rows)


async def test_user_ids_with_slashes_work(api: Client) -> None:
    """A user id with '/' and '|' (allowed by the proxy) is reachable when percent-encoded."""
    record = await add(api, "org%2Fteam%7Cmia", "Mia is on the platform team")
    assert record["user_id"] == "org/team|mia"
    assert [r["id"] for r in await listed(api, "org%2Fteam%7Cmia")] == [record["id"]]


async def test_users_list_pages(api: Client) -> None:
    """The users list is sorted and pages with next_cursor."""
    for user in ("zz-a", "zz-b", "zz-c"):
        await add(api, user, f"{user} exists")
    first = await (await api.get("/v1/memory/users?limit=1&cursor=zz-", headers=AUTH)).json()
    assert first["data"] == [{"user_id": "zz-a"}]
    assert first["next_cursor"] == "zz-a"
    rest = await (await api.get("/v1/memory/users?limit=5&cursor=zz-a", headers=AUTH)).json()
    assert [u["user_id"] for u in rest["data"]] == ["zz-b", "zz-c"]
    assert rest["next_cursor"] is None


async def test_search_body_is_validated(api: Client) -> None:
    """A search without a query, or with k out of range, is a 400 naming the field."""
    for body, param in (({}, "query"), ({"query": "x", "k": 0}, "k"), ({"query": "x", "k": 51}, "k")):
        response = await api.post("/v1/memory/users/ann/search", json=body, headers=AUTH)
        assert (await error_of(response, 400))["param"] == param


# --- insights -----------------------------------------------------------------------------------------


async def test_insights_show_confidence_dates_and_size(api: Client) -> None:
    """Current insights are listed with confidence, date range and cluster size; old ones are not."""
    start, end = datetime(2025, 1, 1, tzinfo=UTC), datetime(2025, 3, 1, tzinfo=UTC)
    current = MemoryRecord(
        user_id="nia",
        kind=Kind.INSIGHT,
        text="Nia cooks most evenings",
        confidence=0.8,
        start_at=start,
        end_at=end,
        cluster_size=12,
        generation_id="g2",
    )
    stale = MemoryRecord(
        user_id="nia",
        kind=Kind.INSIGHT,
        text="Nia rarely cooks",
        confidence=0.4,
        created_at=start - timedelta(days=1),
        valid=False,
        generation_id="g1",
    )
    await api.server.app[STATE].memory.store.add([current, stale])
    page = await (await api.get("/v1/memory/users/nia/insights", headers=AUTH)).json()
    assert page["next_cursor"] is None
    [insight] = page["data"]
    assert insight["text"] == "Nia cooks most evenings"
    assert insight["confidence"] == pytest.approx(0.8)
    assert insight["date_range"] == {"start": start.isoformat(), "end": end.isoformat()}
    assert insight["size"] == 12


async def test_regenerate_insights_is_queued(api: Client) -> None:
    """Asking for fresh insights answers 202 with the queued job's id."""
    response = await api.post("/v1/memory/users/nia/insights/regenerate", headers=AUTH)
    body = await response.json()
    assert response.status == 202
    assert body["status"] == "queued"
    assert body["job_id"]


# --- documents and page -------------------------------------------------------------------------------


async def test_openapi_document_is_served(api: Client) -> None:
    """The served OpenAPI document is the one kept in the repository."""
    response = await api.get("/v1/memory/openapi.json", headers=AUTH)
    assert await response.json() == json.loads(OPENAPI_PATH.read_text())
    await error_of(await api.get("/v1/memory/openapi.json"), 401)


async def test_web_page_is_served_with_a_strict_policy(api: Client) -> None:
    """/ui/ serves the page and its assets under a same-origin content policy; nothing else is reachable."""
    page = await api.get("/ui/")
    assert page.status == 200
    assert "text/html" in page.headers["Content-Type"]
    assert "default-src 'self'" in page.headers["Content-Security-Policy"]
    assert 'src="app.js"' in await page.text()
    for asset, kind in (("app.js", "javascript"), ("style.css", "text/css")):
        response = await api.get(f"/ui/{asset}")
        assert response.status == 200
        assert kind in response.headers["Content-Type"]
    redirect = await api.get("/ui", allow_redirects=False)
    assert redirect.status == 308
    assert redirect.headers["Location"] == "/ui/"
    assert (await api.get("/ui/..%2Fmanagement.py")).status == 404
