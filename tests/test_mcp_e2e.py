"""End to end: an MCP client (the official SDK, streamable HTTP) against the real ``memproxy serve`` at ``/mcp``."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client

from tests.fake_upstream import FakeUpstream
from tests.support.processes import memproxy_process

pytestmark = pytest.mark.e2e


def _env(upstream: str, data: Path) -> dict[str, str]:
    return {
        "MEMPROXY_UPSTREAM__BASE_URL": upstream,
        "MEMPROXY_STORAGE__PATH": str(data),
        "MEMPROXY_UPSTREAM__API_KEY": "sk-upstream-e2e",
        "MEMPROXY_MEMORY__RETRIEVAL_TIMEOUT_MS": "20000",
        "MEMPROXY_RETRIEVAL__ARM_TIMEOUT_MS": "20000",
        "MEMPROXY_MEMORY__READ_QUEUE_MS": "20000",
    }


@asynccontextmanager
async def mcp_session(url: str, user: str) -> AsyncIterator[ClientSession]:
    """An initialized MCP session at ``url`` for ``user`` (the header on every request of the connection)."""
    async with (
        httpx.AsyncClient(headers={"X-Memory-User": user}, timeout=60) as http,
        streamable_http_client(url, http_client=http) as (read, write, _),
        ClientSession(read, write) as session,
    ):
        await session.initialize()
        yield session


async def _call(session: ClientSession, tool: str, **arguments: Any) -> dict[str, Any]:
    result = await session.call_tool(tool, arguments)
    assert not result.isError, result.content
    assert result.structuredContent is not None
    return result.structuredContent


async def _chat(client: openai.AsyncOpenAI, fake: FakeUpstream, user: str, text: str) -> str:
    """Ask as ``user``; what the upstream received (every message's text, joined)."""
    await client.chat.completions.create(
        model="fake-echo", messages=[{"role": "user", "content": text}], extra_headers={"X-Memory-User": user}
    )
    return "\n".join(str(m.get("content")) for m in fake.requests[-1]["json"]["messages"])


async def test_an_agent_adds_finds_and_deletes_a_memory_the_chat_carries(tmp_path: Path) -> None:
    """A memory added over MCP is in the user's next chat, found by search, unseen by another user, and gone
    from the chat once deleted; a foreign Origin is refused."""
    async with FakeUpstream() as fake:
        with memproxy_process(_env(fake.base_url, tmp_path)) as (_, url):
            mcp_url = url.removesuffix("/v1") + "/mcp"
            client = openai.AsyncOpenAI(base_url=url, api_key="sk-client", max_retries=0)
            async with mcp_session(mcp_url, "ann") as ann:
                names = {tool.name for tool in (await ann.list_tools()).tools}
                assert {"search_memories", "add_memory", "delete_memory"} <= names
                added = await _call(ann, "add_memory", text="My favourite tea is genmaicha from Kyoto.")
                memory_id = added["memory"]["id"]
                assert added["outcome"] == "added"
                assert "genmaicha" in await _chat(client, fake, "ann", "Which tea should I buy for the weekend?")
                found = await _call(ann, "search_memories", query="favourite tea", limit=5)
                assert memory_id in [m["id"] for m in found["memories"]]
            async with mcp_session(mcp_url, "ben") as ben:
                found = await _call(ben, "search_memories", query="favourite tea genmaicha", limit=5)
                assert memory_id not in [m["id"] for m in found["memories"]]
                assert (await _call(ben, "list_memories"))["memories"] == []
                refused = await ben.call_tool("delete_memory", {"id": memory_id})
                assert refused.isError  # not ben's memory
            async with client, mcp_session(mcp_url, "ann") as ann:
                assert (await _call(ann, "delete_memory", id=memory_id))["deleted"] is True
                assert "genmaicha" not in await _chat(client, fake, "ann", "Which tea should I buy for the weekend?")
            async with httpx.AsyncClient() as http:
                foreign = await http.post(
                    mcp_url,
                    json={"jsonrpc": "2.0", "id": 1, "method": "ping"},
                    headers={"Origin": "https://evil.example", "X-Memory-User": "ann",
                             "Accept": "application/json, text/event-stream"},
                )  # fmt: skip
                assert foreign.status_code == 403
                nobody = await http.post(
                    mcp_url,
                    json={"jsonrpc": "2.0", "id": 1, "method": "ping"},
                    headers={"Accept": "application/json, text/event-stream"},
                )
                assert nobody.status_code == 400
                metrics = (await http.get(url.removesuffix("/v1") + "/metrics")).text
                # every change was applied by every chat process before it answered, none after a timeout
                assert "memproxy_mirror_unsettled_total 0.0" in metrics
