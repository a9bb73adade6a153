"""Shared fixtures: the fake upstream, an in-process proxy built by the real app factory, the shipped model."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
import pytest_asyncio
from aiohttp.test_utils import TestClient, TestServer

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

from proxy.app import MemoryFactory, build_app
from proxy.config import load_settings
from proxy.memory.embedders.base import BaseEmbedder
from proxy.memory.embedders.factory import build_embedder
from proxy.memory.embedders.settings import EmbedderSettings
from tests.fake_upstream import APP_KEY, FakeUpstream

ProxyFactory = Callable[..., Awaitable[TestClient[Any, Any]]]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def local() -> AsyncIterator[BaseEmbedder]:
    """The shipped default embedder (the static model distilled from all-MiniLM-L6-v2), loaded once per module."""
    async with build_embedder(EmbedderSettings()) as embedder:
        yield embedder


@pytest.fixture
async def fake() -> AsyncIterator[FakeUpstream]:
    """A fresh fake upstream on 127.0.0.1."""
    async with FakeUpstream() as upstream:
        yield upstream


@pytest.fixture
async def make_proxy(fake: FakeUpstream, tmp_path: Any) -> AsyncIterator[ProxyFactory]:
    """Build a proxy in-process against ``fake``; keyword overrides are nested settings dicts. Its client sends
    ``app_key`` as an app's OpenAI client does (None: no key), which the proxy passes to the fake upstream
    (as every hosted API, it refuses a chat request without one) unless ``upstream.api_key`` is set."""
    clients: list[TestClient[Any, Any]] = []

    async def build(
        memory_factory: MemoryFactory | None = None, *, app_key: str | None = APP_KEY, **overrides: Any
    ) -> TestClient[Any, Any]:
        # Generous read-path deadlines: tests check behaviour, not speed, on a shared 2-core machine
        # (speed is the benchmarks' job).
        tree: dict[str, Any] = {
            "upstream": {"base_url": fake.base_url},
            "storage": {"path": str(tmp_path)},
            "memory": {"retrieval_timeout_ms": 20_000, "read_queue_ms": 20_000},
            "retrieval": {"arm_timeout_ms": 20_000},
            # facts of a window of exchanges are extracted 0.2 s after its first exchange
            # (the product waits 20 s to gather more; the window tests set their own)
            "writer": {"facts_window_wait_s": 0.2},
        }
        for section, values in overrides.items():
            tree[section] = {**tree.get(section, {}), **values} if isinstance(values, dict) else values
        settings = load_settings(None, environ={}, overrides=tree)
        server = TestServer(
            build_app(settings, memory_factory=memory_factory), host="127.0.0.1", handler_cancellation=True
        )
        client = TestClient(server, headers={"Authorization": f"Bearer {app_key}"} if app_key else None)
        await client.start_server()
        clients.append(client)
        return client

    yield build
    for client in clients:
        await client.close()
