"""Webhook deliveries against receivers on 127.0.0.1: signed bodies, no redirects, only configured URLs."""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
from aiohttp import web

from proxy.memory.events import event_body
from proxy.memory.store.records import Kind, MemoryRecord, utcnow
from proxy.memory.write.job_types import GiveUp
from proxy.memory.write.queue import Job
from proxy.memory.write.webhooks import DeliveryFailed, Webhooks, WebhookSettings, signature


@asynccontextmanager
async def serving(handler: Any) -> AsyncIterator[str]:
    """``handler`` at ``/hook`` on 127.0.0.1 port 0; yields the base URL."""
    app = web.Application()
    app.router.add_post("/hook", handler)
    app.router.add_post("/elsewhere", handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


def _job(url: str, body: bytes) -> Job:
    payload = {"url": url, "event": "memory.created", "body": body.decode()}
    return Job("d-1", "webhook", "ann", payload, 1, 0.0, {}, queue=None)  # type: ignore[arg-type]


def _body() -> bytes:
    record = MemoryRecord(user_id="ann", kind=Kind.FACT, text="Ann plays the oboe")
    return event_body("memory.created", "ann", "d-1", utcnow(), record, {})


def test_the_signature_is_hmac_sha256_of_the_raw_body() -> None:
    """The header a receiver checks: ``sha256=`` and the hex HMAC-SHA256 of exactly the bytes sent."""
    body = b'{"event":"memory.created"}'
    assert signature("s3", body) == "sha256=" + hmac.new(b"s3", body, hashlib.sha256).hexdigest()


def test_an_event_body_carries_the_memory_as_stored() -> None:
    """The body names the event, the user, the delivery and the memory's id, kind and text."""
    body = json.loads(_body())
    assert (body["event"], body["user"], body["delivery_id"]) == ("memory.created", "ann", "d-1")
    assert body["memory"]["text"] == "Ann plays the oboe"
    assert body["memory"]["kind"] == "fact"


async def test_a_delivery_is_signed_and_a_2xx_is_success() -> None:
    """The receiver gets the body, the delivery id and a signature it can check with the secret."""
    seen: list[tuple[dict[str, str], bytes]] = []

    async def receive(request: web.Request) -> web.Response:
        seen.append((dict(request.headers), await request.read()))
        return web.Response(status=202)

    async with serving(receive) as base:
        hooks = Webhooks([WebhookSettings(url=base + "/hook", secret="s3")], queue=None)  # type: ignore[arg-type]
        async with hooks:
            body = _body()
            await hooks.deliver(_job(base + "/hook", body))
    [(headers, sent)] = seen
    assert sent == body
    assert headers["X-Memproxy-Delivery"] == "d-1"
    assert headers["X-Memproxy-Signature"] == signature("s3", body)


async def test_a_redirect_is_not_followed_and_counts_as_a_failure() -> None:
    """A receiver that redirects elsewhere gets no second request: the attempt failed (and is retried)."""
    calls: list[str] = []

    async def redirect(request: web.Request) -> web.Response:
        calls.append(request.path)
        raise web.HTTPTemporaryRedirect("/elsewhere")

    async with serving(redirect) as base:
        hooks = Webhooks([WebhookSettings(url=base + "/hook", secret="s3")], queue=None)  # type: ignore[arg-type]
        async with hooks:
            with pytest.raises(DeliveryFailed, match="307"):
                await hooks.deliver(_job(base + "/hook", _body()))
    assert calls == ["/hook"]


async def test_a_delivery_to_an_unconfigured_url_is_given_up() -> None:
    """A job naming a URL that is not (or no longer) configured is never sent: it goes to the dead letters."""
    hooks = Webhooks([WebhookSettings(url="http://127.0.0.1:9/hook", secret="s3")], queue=None)  # type: ignore[arg-type]
    async with hooks:
        with pytest.raises(GiveUp):
            await hooks.deliver(_job("http://127.0.0.1:9/other", _body()))


def test_only_http_urls_and_known_events_are_accepted() -> None:
    """A ``[[webhooks]]`` entry refuses other schemes and unknown event names."""
    with pytest.raises(ValueError, match="url"):
        WebhookSettings(url="file:///etc/passwd", secret="s")
    with pytest.raises(ValueError, match="events"):
        WebhookSettings(url="https://x.example/h", secret="s", events=("memory.exploded",))  # type: ignore[arg-type]
