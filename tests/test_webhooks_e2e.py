"""End to end: webhooks from the real ``memproxy serve`` to a receiver on 127.0.0.1, and memories that expire."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from aiohttp import web

from tests.fake_upstream import FakeUpstream
from tests.support.processes import memproxy_process

pytestmark = pytest.mark.e2e

SECRET = "whsec-e2e"
ADMIN = "admin-e2e"


class Receiver:
    """A webhook receiver that answers 500 to its first ``failures`` requests, then 200, keeping each one."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.attempts: list[tuple[dict[str, str], bytes]] = []
        self.accepted: list[tuple[dict[str, str], bytes]] = []
        self.arrived = asyncio.Event()

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        self.attempts.append((dict(request.headers), body))
        if len(self.attempts) <= self.failures:
            return web.Response(status=500)
        self.accepted.append((dict(request.headers), body))
        self.arrived.set()
        return web.Response(status=204)

    async def next_event(self, event: str, within_s: float = 30.0) -> tuple[dict[str, str], dict[str, Any]]:
        """The first accepted delivery of ``event`` (waiting for it)."""
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            for headers, body in self.accepted:
                if json.loads(body)["event"] == event:
                    assert headers["X-Memproxy-Signature"] == _signature(body)
                    return headers, json.loads(body)
            self.arrived.clear()
            await asyncio.wait_for(self.arrived.wait(), timeout=max(0.1, deadline - time.monotonic()))
        raise AssertionError(f"no {event} delivery")


def _signature(body: bytes) -> str:
    return "sha256=" + hmac.new(SECRET.encode(), body, hashlib.sha256).hexdigest()


@asynccontextmanager
async def receiver_at(receiver: Receiver) -> AsyncIterator[str]:
    """``receiver`` served on 127.0.0.1 port 0; yields its URL."""
    app = web.Application()
    app.router.add_post("/hook", receiver.handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}/hook"
    finally:
        await runner.cleanup()


def _config(path: Path, hook: str, dead_hook: str) -> Path:
    config = path / "memproxy.toml"
    config.write_text(
        f"""
[jobs]
backoff_base_s = 0.2
backoff_max_s = 1.0
max_attempts = 3

[[webhooks]]
url = "{hook}"
secret = "{SECRET}"

[[webhooks]]
url = "{dead_hook}"
secret = "other"
events = ["user.forgotten"]
"""
    )
    return config


def _env(upstream: str, data: Path) -> dict[str, str]:
    return {
        "MEMPROXY_UPSTREAM__BASE_URL": upstream,
        "MEMPROXY_STORAGE__PATH": str(data),
        "MEMPROXY_UPSTREAM__API_KEY": "sk-upstream-e2e",
        "MEMPROXY_ADMIN__API_KEY": ADMIN,
        "MEMPROXY_MEMORY__RETRIEVAL_TIMEOUT_MS": "20000",
        "MEMPROXY_RETRIEVAL__ARM_TIMEOUT_MS": "20000",
        "MEMPROXY_MEMORY__READ_QUEUE_MS": "20000",
    }


async def _upstream_saw(client: openai.AsyncOpenAI, fake: FakeUpstream, user: str, text: str) -> str:
    await client.chat.completions.create(
        model="fake-echo", messages=[{"role": "user", "content": text}], extra_headers={"X-Memory-User": user}
    )
    return "\n".join(str(m.get("content")) for m in fake.requests[-1]["json"]["messages"])


async def test_webhooks_retry_sign_and_dead_letter_and_memories_expire(tmp_path: Path) -> None:
    """``memory.created`` reaches a receiver failing twice on the third attempt, signed; a forget is announced;
    a receiver that never answers ends as a dead letter; a memory is injected until its ``expires_at``, never
    after."""
    receiver = Receiver(failures=2)
    async with FakeUpstream() as fake, receiver_at(receiver) as hook:
        config = _config(tmp_path, hook, "http://127.0.0.1:9/closed")
        with memproxy_process(_env(fake.base_url, tmp_path / "data"), ["--config", str(config)]) as (_, url):
            base = url.removesuffix("/v1")
            admin = {"Authorization": f"Bearer {ADMIN}"}
            expires = datetime.now(UTC) + timedelta(seconds=6)
            async with (
                httpx.AsyncClient(base_url=base, headers=admin, timeout=60) as api,
                openai.AsyncOpenAI(base_url=url, api_key="sk-client", max_retries=0) as client,
            ):
                added = await api.post(
                    "/v1/memory/users/ann/memories",
                    json={
                        "text": "My gym locker is number 42 at the Riverside club.",
                        "expires_at": expires.isoformat(),
                    },
                )
                assert added.status_code == 201, added.text
                memory = added.json()
                assert datetime.fromisoformat(memory["expires_at"]) == expires
                assert "Riverside" in await _upstream_saw(client, fake, "ann", "Which club is my gym locker at?")

                headers, created = await receiver.next_event("memory.created")
                assert len(receiver.attempts) >= 3  # two failures, then the delivery that was accepted
                assert created["user"] == "ann"
                assert created["memory"]["id"] == memory["id"]
                assert created["memory"]["text"] == memory["text"]
                assert headers["X-Memproxy-Delivery"] == created["delivery_id"]

                await asyncio.sleep(max(0.0, (expires - datetime.now(UTC)).total_seconds()) + 0.5)
                assert "Riverside" not in await _upstream_saw(client, fake, "ann", "Which club is my gym locker at?")

                assert (await api.delete("/v1/memory/users/ann")).status_code == 200
                _, forgotten = await receiver.next_event("user.forgotten")
                assert forgotten["user"] == "ann"
                assert forgotten["memory"] is None

                deadline = time.monotonic() + 30
                dead: list[dict[str, Any]] = []
                while time.monotonic() < deadline and not dead:
                    rows = (await api.get("/v1/memory/dead-letters")).json()["data"]
                    dead = [row for row in rows if row["kind"] == "webhook"]
                    await asyncio.sleep(0.3)
                assert dead, "the delivery to the closed port never became a dead letter"
