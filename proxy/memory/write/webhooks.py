"""Webhooks: each memory event, as a signed POST to the receivers configured for it, from the durable job queue.

``[[webhooks]]`` entries name a ``url``, a ``secret`` and the ``events`` they want. ``Webhooks.emit`` turns an
event into one ``webhook`` job per receiver that wants it (the body built then, so it holds the memory as it was
stored); the job runner delivers it: ``POST url`` with the body, ``Content-Type: application/json``,
``X-Memproxy-Event``, ``X-Memproxy-Delivery`` (the delivery id, also the job id and in the body) and
``X-Memproxy-Signature: sha256=<hex HMAC-SHA256(secret, raw body)>``.

A receiver that fails (a network error, a timeout, any status but 2xx; redirects are not followed) is tried again
with the queue's backoff, and after ``jobs.max_attempts`` the delivery is a dead letter (the management API's
dead-letter list, requeue included). Deliveries run in the job runner, never on a chat's path. A delivery goes
only to a URL configured now: a job whose receiver left the configuration is dropped as a dead letter.
"""

from __future__ import annotations

import hashlib
import hmac
import uuid
from collections.abc import Sequence
from types import TracebackType
from typing import Annotated, Any

import aiohttp
import structlog
from pydantic import BaseModel, ConfigDict, Field, SecretStr, StringConstraints

from proxy.memory.events import EVENTS, Event, event_body
from proxy.memory.store.records import MemoryRecord, utcnow
from proxy.memory.write.job_kinds import WEBHOOK_JOB
from proxy.memory.write.job_types import GiveUp, JobError
from proxy.memory.write.queue import Handler, Job, JobQueue

log = structlog.get_logger("memproxy.webhooks")

WebhookURL = Annotated[str, StringConstraints(strip_whitespace=True, pattern=r"^https?://[^\s/?#]+[^\s]*$")]


class WebhookSettings(BaseModel):
    """One ``[[webhooks]]`` entry: where to POST which events, and the secret that signs them."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    url: WebhookURL
    secret: SecretStr = Field(min_length=1)
    events: tuple[Event, ...] = EVENTS
    timeout_s: float = Field(default=10.0, gt=0)


class DeliveryFailed(JobError):
    """The receiver did not take the delivery (the queue tries again, or dead-letters it)."""


def signature(secret: str, body: bytes) -> str:
    """``sha256=<hex HMAC-SHA256(secret, body)>``, the ``X-Memproxy-Signature`` header's value."""
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


class Webhooks:
    """The configured receivers: ``emit`` enqueues deliveries, ``handlers`` delivers them (see the module doc)."""

    def __init__(self, hooks: Sequence[WebhookSettings], queue: JobQueue) -> None:
        self._hooks = tuple(hooks)
        self._by_url = {hook.url: hook for hook in hooks}
        self._queue = queue
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Webhooks:
        if self._hooks:
            self._session = aiohttp.ClientSession(auto_decompress=False)
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def handlers(self) -> dict[str, Handler]:
        """The job kind this delivers, for the ``JobRunner``."""
        return {WEBHOOK_JOB: self.deliver}

    async def emit(self, event: Event, user_id: str, records: Sequence[MemoryRecord] = (), **extra: Any) -> None:
        """One delivery job per record (one without a record when none) for each receiver of ``event``."""
        hooks = [hook for hook in self._hooks if event in hook.events]
        for hook in hooks:
            for record in records or (None,):
                delivery = uuid.uuid4().hex
                body = event_body(event, user_id, delivery, utcnow(), record, extra)
                payload = {"url": hook.url, "event": event, "body": body.decode()}
                await self._queue.enqueue(WEBHOOK_JOB, user_id, payload, job_id=delivery)

    async def deliver(self, job: Job) -> None:
        """POST one delivery, signed; raise when the receiver did not answer 2xx."""
        hook = self._by_url.get(str(job.payload.get("url")))
        if hook is None or self._session is None:
            raise GiveUp("the receiver is no longer among the configured [[webhooks]]")
        body = str(job.payload["body"]).encode()
        headers = {
            "Content-Type": "application/json",
            "User-Agent": "memproxy-webhooks",
            "X-Memproxy-Event": str(job.payload["event"]),
            "X-Memproxy-Delivery": job.id,
            "X-Memproxy-Signature": signature(hook.secret.get_secret_value(), body),
        }
        timeout = aiohttp.ClientTimeout(total=hook.timeout_s)
        try:
            async with self._session.post(
                hook.url, data=body, headers=headers, allow_redirects=False, timeout=timeout
            ) as response:
                status = response.status
        except (aiohttp.ClientError, TimeoutError) as error:
            raise DeliveryFailed(f"{type(error).__name__}: {str(error)[:200]}") from None
        if not 200 <= status < 300:
            raise DeliveryFailed(f"the receiver answered {status}")
        log.info("webhook.delivered", event_name=job.payload["event"], attempt=job.attempt, status=status)
