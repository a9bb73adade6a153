"""One request through the proxy with memory, whatever its dialect (chat completions, Responses, Messages).

The hot path: parse once, ask the memory seam for a placement plan (bounded by a timeout; a failed read keeps
what the conversation already carries and says so), write it into the dialect's body (or forward the client's
own bytes when nothing changed), relay the answer as it arrives, and hand the finished exchange to the write
path before the client can have the end of the answer (answered means stored): a non-streamed body is
committed before its first byte is sent, a stream before the event that completes it and before the end of
the body. The commit runs in a task the app owns (``proxy.commit``), so a client that hangs up cannot cancel it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
import uuid
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

import structlog
from aiohttp import web
from pydantic import SecretStr

from proxy.access import NAMESPACE, scoped
from proxy.bounds import capped_turn, check_json_depth, reject_duplicate_headers
from proxy.chat import arms_entries, earlier_messages, new_user_messages, system_prompt
from proxy.commit import Committed
from proxy.dialects import ChatView, Dialect, Reply, ReplyReader
from proxy.errors import PayloadTooLarge, ProxyError, UpstreamStatusError, stream_error_event
from proxy.identity import Identity, Mode, identify, log_user
from proxy.memory import Exchange, Injection, ReadRequest, spans
from proxy.memory.store import valid_app_id
from proxy.state import AppState
from proxy.telemetry import record_retrieve
from proxy.tool_history import new_tool_results
from proxy.upstream import UpstreamReply

log = structlog.get_logger("memproxy.request")


def memory_headers(identity: Identity, injection: Injection) -> dict[str, str]:
    """The ``X-Memory-*`` response headers for one request."""
    return {
        "X-Memory-Mode": identity.mode.value,
        "X-Memory-Injected": str(len(injection.injected_ids)),
        "X-Memory-Ids": ",".join(injection.injected_ids),
        "X-Memory-Arms": ",".join(arms_entries(injection.arms, injection.degraded)),
        "X-Memory-Retrieval-Ms": f"{injection.retrieval_ms:.2f}",
    }


async def read_body(request: web.Request, limit: int) -> bytes:
    """The whole request body, or a 413 past ``limit``."""
    if request.content_length is not None and request.content_length > limit:
        raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes") from None


async def _inject(state: AppState, identity: Identity, view: ChatView) -> Injection:
    if identity.user_id is None or identity.conversation_id is None or not identity.mode.reads:
        return Injection()
    settings = state.settings
    rerank_ms = settings.rerank.timeout_ms if settings.rerank.enabled else 0.0
    timeout = (settings.memory.retrieval_timeout_ms + rerank_ms) / 1000
    started, deadline = time.perf_counter(), asyncio.get_running_loop().time() + timeout
    holds = view.provider_holds_history
    if not await _read_slot(state):  # more reads in flight than the machine serves in time: go on without
        return _degraded(state, identity, view, "busy", started)
    try:  # the deadline counts from the request's arrival, the wait for a slot included
        async with asyncio.timeout_at(deadline):
            read = ReadRequest(identity.user_id, identity.conversation_id, view.messages, holds)
            return await state.memory.inject(read)
    except TimeoutError:
        reason = "timeout"
    except Exception as exc:  # the chat never pays for memory failures; the reason goes to the headers
        log.warning("memory.inject_failed", error=type(exc).__name__, detail=str(exc)[:200])
        reason = type(exc).__name__
    finally:
        state.read_slots.release()
    return _degraded(state, identity, view, reason, started)


async def _read_slot(state: AppState) -> bool:
    """Take one of the read path's slots, waiting at most ``memory.read_queue_ms``; False if none came free."""
    if not state.read_slots.locked():  # a free slot: taken at once, no timer armed and cancelled
        await state.read_slots.acquire()
        return True
    try:
        async with asyncio.timeout(state.settings.memory.read_queue_ms / 1000):
            await state.read_slots.acquire()
    except TimeoutError:
        return False
    return True


def _degraded(state: AppState, identity: Identity, view: ChatView, reason: str, started: float) -> Injection:
    """No retrieval this time: what the conversation already carries (so its cached prefix stays whole)."""
    state.metrics.memory_degraded.labels("read").inc()
    user, conversation, holds = identity.user_id or "", identity.conversation_id or "", view.provider_holds_history
    carried = Injection()
    with contextlib.suppress(Exception):  # the chat never pays for memory failures
        carried = state.memory.carried(ReadRequest(user, conversation, view.messages, holds))
    return Injection(
        plan=carried.plan, degraded={"memory": reason}, retrieval_ms=(time.perf_counter() - started) * 1000
    )


def conversation_hint(state: AppState, body: Mapping[str, Any], view: ChatView) -> str | None:
    """The conversation a Responses request names: its ``conversation``, else the root of its
    ``previous_response_id`` chain (as remembered here, else the previous id itself); None for other dialects."""
    named = view.conversation
    previous = body.get("previous_response_id")
    if named is None and isinstance(previous, str) and previous:
        named = state.response_chains.get(previous) or previous
    if named is None or valid_app_id(named):
        return named
    return "cv-" + hashlib.sha256(named.encode("utf-8", "surrogatepass")).hexdigest()[:24]


class MemoryCall:
    """One request with memory on its way through the proxy."""

    def __init__(self, request: web.Request, state: AppState, dialect: Dialect) -> None:
        self.request = request
        self.state = state
        self.dialect = dialect
        self.started = time.perf_counter()
        self.request_id = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        self.status = 0
        self.bytes_out = 0
        self.route = ""
        self.partial = False
        self.recorded = False  # one exchange per request, whichever of completion or hang-up comes first
        self.relayed = False  # served by the user's own chat process (``chat_routing``)
        self.view = ChatView([])

    async def run(self) -> web.StreamResponse:
        """Serve the request end to end."""
        settings = self.state.settings
        raw = await read_body(self.request, settings.server.max_body_bytes)
        check_json_depth(raw, settings.server.max_json_depth)  # before anything walks the body recursively
        reject_duplicate_headers(self.request.headers)
        body = self.dialect.parse(raw)
        self.view = view = self.dialect.view(body)
        identity = self._identity(body, view)
        router = self.state.chat_router
        if router is not None and identity.mode is not Mode.OFF:
            owner = router.owner(self.request, identity.user_id)
            if owner is not None and await router.hand_off(self.request, raw, owner):
                self.relayed = True  # the connection is the owner's now: it answers, logs and counts
                return web.Response()  # (never sent: this process has let the connection go)
            relayed = None if owner is None else await router.relay(self.request, raw, owner)
            if relayed is not None:  # served, logged and counted by the user's own chat process
                self.relayed = True
                return relayed
        self.state.metrics.observe("parse", time.perf_counter() - self.started)
        spans.record_span("memproxy.parse", time.perf_counter() - self.started)
        structlog.contextvars.bind_contextvars(
            request_id=self.request_id, user=log_user(identity.user_id, settings.logging.user_ids)
        )
        injection = await _inject(self.state, identity, view)
        if identity.mode.reads:
            self.state.metrics.observe("retrieve", injection.retrieval_ms / 1000)
            self.state.metrics.injected.observe(len(injection.injected_ids))
            record_retrieve(injection)
        outgoing = self.dialect.apply(body, view, injection.plan) if injection.plan else body
        try:
            return await self._forward(body, outgoing, None if injection.plan else raw, identity, injection)
        finally:
            self._log(body, identity, injection, len(raw))

    def _identity(self, body: dict[str, Any], view: ChatView) -> Identity:
        settings = self.state.settings
        default_mode = Mode(settings.memory.default_mode) if settings.memory.enabled else Mode.OFF
        hint = conversation_hint(self.state, body, view)
        found = identify(self.request.headers, body, default_mode, messages=view.messages, conversation=hint)
        identity = scoped(found, self.request.get(NAMESPACE))
        if not settings.memory.enabled:
            identity = Identity(identity.user_id, identity.conversation_id, Mode.OFF)
        return identity

    async def _forward(
        self,
        body: dict[str, Any],
        outgoing: dict[str, Any],
        raw: bytes | None,
        identity: Identity,
        injection: Injection,
    ) -> web.StreamResponse:
        target = self.state.targets.pick(self.dialect.name, body["model"])
        self.route = target.name
        headers = memory_headers(identity, injection)
        headers["X-Request-Id"] = self.request_id
        if identity.mode.writes:
            _say_write_degraded(headers, storage_degraded(self.state))
        opened = time.perf_counter()
        try:
            async with target.open(outgoing, raw, self.request.headers) as reply:
                self.state.metrics.observe_upstream(self.route, body.get("model"), reply.ttfb_s)
                if reply.status >= 400:
                    self.state.metrics.upstream_errors.labels(str(reply.status)).inc()
                    raise UpstreamStatusError(reply.status, await reply.read(), reply.headers.get("Content-Type", ""))
                headers.update(target.relayed_headers(reply.headers))
                if body.get("stream"):
                    return await self._relay_stream(reply, headers, body, identity)
                return await self._relay_json(reply, headers, body, identity)
        except ProxyError as exc:
            self.status = exc.status
            if not isinstance(exc, UpstreamStatusError):
                self.state.metrics.upstream_errors.labels(type(exc).__name__).inc()
            raise
        finally:
            spans.record_span("memproxy.upstream", time.perf_counter() - opened, **{"memproxy.route": self.route})

    async def _relay_json(
        self, reply: UpstreamReply, headers: dict[str, str], body: dict[str, Any], identity: Identity
    ) -> web.StreamResponse:
        data = await reply.read()
        self.status = reply.status
        if _stores(identity):  # committed before the client has a byte of the answer
            committed = await self._record(body, identity, self.dialect.reply(data), partial=False)
            if committed is not Committed.DURABLE:
                _say_write_degraded(headers, storage_degraded(self.state) or committed.value)
        elif identity.user_id is not None and self.dialect.name == "responses":
            self._chain(identity, self.dialect.reply(data))
        # One write for the status line, headers and body (a StreamResponse sends its headers on their own)
        response = web.Response(status=reply.status, headers=headers, body=data)
        await response.prepare(self.request)
        self.bytes_out = len(data)
        await response.write_eof()
        return response

    async def _relay_stream(
        self, reply: UpstreamReply, headers: dict[str, str], body: dict[str, Any], identity: Identity
    ) -> web.StreamResponse:
        response = web.StreamResponse(status=reply.status, headers=headers)
        await response.prepare(self.request)
        self.status = reply.status
        # The reply is put together from the events only when it will be stored (a mode that writes, a known
        # user and conversation) or, for the Responses API, its id remembered: otherwise the bytes pass untouched.
        watch = _stores(identity) or (identity.user_id is not None and self.dialect.name == "responses")
        reader = self.dialect.reader() if watch else None
        try:
            failure = await self._pump(reply, response, reader, body, identity)
        except (asyncio.CancelledError, ConnectionResetError):
            self.partial = True
            await self._record_stream(body, identity, reader, partial=True)
            raise
        if reader is not None:  # before the error event or the end of the body (a complete stream is committed)
            await self._record_stream(body, identity, reader, partial=not reader.complete)
        if failure is not None:
            await response.write(stream_error_event(self.dialect.name, failure))
        await response.write_eof()
        return response

    async def _pump(
        self,
        reply: UpstreamReply,
        response: web.StreamResponse,
        reader: ReplyReader | None,
        body: dict[str, Any],
        identity: Identity,
    ) -> ProxyError | None:
        first = True
        try:
            async for chunk in reply.chunks():
                if first:
                    self.state.metrics.observe("first_chunk", time.perf_counter() - self.started)
                    first = False
                if reader is not None:
                    was_complete = reader.complete
                    reader.feed(chunk)
                    if reader.complete and not was_complete:  # the event that completes the answer waits
                        await self._record_stream(body, identity, reader, partial=False)
                await response.write(chunk)
                self.bytes_out += len(chunk)
        except ProxyError as exc:
            self.state.metrics.upstream_errors.labels("mid_stream").inc()
            log.warning("upstream.stream_failed", error=exc.message)
            self.partial = True
            return exc
        return None

    async def _record_stream(
        self, body: dict[str, Any], identity: Identity, reader: ReplyReader | None, *, partial: bool
    ) -> None:
        if reader is None:
            return
        reply = reader.reply
        if not _stores(identity):
            self._chain(identity, reply)
        elif (reply.text or reply.tool_calls) and not self.recorded:
            await self._record(body, identity, reply, partial=partial)

    def _chain(self, identity: Identity, reply: Reply) -> None:
        """Remember which conversation a Responses answer belongs to (its id may come back as
        ``previous_response_id``)."""
        if reply.response_id and identity.conversation_id is not None and self.dialect.name == "responses":
            self.state.response_chains.put(reply.response_id, identity.conversation_id)

    async def _record(self, body: dict[str, Any], identity: Identity, reply: Reply, *, partial: bool) -> Committed:
        self._chain(identity, reply)
        if identity.user_id is None or identity.conversation_id is None or self.recorded:
            return Committed.DURABLE
        self.recorded = True
        messages, cap = self.view.messages, self.state.settings.memory.max_turn_chars
        exchange = Exchange(
            request_id=self.request_id,
            user_id=identity.user_id,
            conversation_id=identity.conversation_id,
            model=body["model"],
            route=self.route,
            user_messages=tuple(capped_turn(m, cap) for m in new_user_messages(messages)),
            assistant_text=capped_turn(reply.text, cap),
            partial=partial,
            finished_at=datetime.now(UTC),
            system_prompt=capped_turn(system_prompt(messages) or "", cap) or None,
            context=tuple((role, capped_turn(t, cap)) for role, t in earlier_messages(messages)),
            client_key=client_key(self.request.headers),
            tool_calls=reply.tool_calls,
            tool_results=new_tool_results(messages),
            traceparent=spans.current_traceparent(),
        )
        return await self.state.commits.commit(exchange)

    def _log(self, body: dict[str, Any], identity: Identity, injection: Injection, bytes_in: int) -> None:
        total = time.perf_counter() - self.started
        self.state.metrics.observe("total", total)
        self.state.metrics.observe_chat(self.route, body.get("model"), total)
        log.info(
            "request.completed",
            api=self.dialect.name,
            model=body.get("model"),
            route=self.route,
            status=self.status,
            mode=identity.mode.value,
            injected=len(injection.injected_ids),
            retrieval_ms=round(injection.retrieval_ms, 2),
            total_ms=round(total * 1000, 2),
            bytes_in=bytes_in,
            bytes_out=self.bytes_out,
            partial=self.partial,
            degraded=dict(injection.degraded) or None,
        )


def _stores(identity: Identity) -> bool:
    """Whether the request's exchange is stored: a mode that writes, for a known user and conversation."""
    return identity.mode.writes and identity.user_id is not None and identity.conversation_id is not None


def storage_degraded(state: AppState) -> str | None:
    """Why stored writes fail now: the commit path's reason (exchanges spooled), else the data directory's
    fault; None when writes work (or before start-up has made the commit path)."""
    memory = state.memory
    fault = memory.storage_fault
    commits = getattr(state, "commits", None)
    return (commits.degraded if commits is not None else None) or fault


def client_key(headers: Mapping[str, str]) -> SecretStr | None:
    """The client's own key (``Authorization: Bearer``, else Anthropic's ``x-api-key``), masked, or None."""
    scheme, _, key = headers.get("Authorization", "").partition(" ")
    if scheme.lower() == "bearer" and key.strip():
        return SecretStr(key.strip())
    api_key = headers.get("x-api-key", "").strip()
    return SecretStr(api_key) if api_key else None


def _say_write_degraded(headers: dict[str, str], reason: str | None) -> None:
    """Add ``degraded=write:<reason>`` to ``X-Memory-Arms`` (the exchange is not, or not yet, stored)."""
    arms = headers.get("X-Memory-Arms", "")
    if reason and "degraded=write:" not in arms:
        headers["X-Memory-Arms"] = ",".join(p for p in (arms, f"degraded=write:{reason}") if p)
