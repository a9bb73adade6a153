"""HTTP handlers of the proxy: chat completions, models, health, readiness and metrics.

The chat handler is the hot path: parse once, ask the memory seam for injected messages (bounded by a
timeout, failures degrade to no memory), forward the client's own bytes when nothing changed, relay the
answer as it arrives, and hand the finished exchange to the write path before the client can have the end of
the answer (answered means stored): a non-streamed body is committed before its first byte is sent, a stream
before the event that completes it (finish reason or ``[DONE]``) and before the end of the body. The commit
runs in a task the app owns (``proxy.commit``), so a client that hangs up cannot cancel it.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

import orjson
import structlog
from aiohttp import web
from pydantic import SecretStr

from proxy.access import NAMESPACE, scoped
from proxy.bounds import capped_turn, check_json_depth, reject_duplicate_headers
from proxy.chat import arms_entries, earlier_messages, new_user_messages, parse_chat_request, system_prompt
from proxy.commit import Committed
from proxy.errors import PayloadTooLarge, ProxyError, UpstreamStatusError, sse_error_event
from proxy.feature_report import readiness
from proxy.identity import Identity, Mode, identify, log_user
from proxy.memory import spans
from proxy.memory.service import Exchange, Injection, StorageStatus
from proxy.sse import reply_from_completion
from proxy.state import STATE, AppState
from proxy.telemetry import record_retrieve
from proxy.tool_history import ToolReplyAssembler, new_tool_results, reply_tool_calls
from proxy.upstream import relayed_headers

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


async def _read_body(request: web.Request, limit: int) -> bytes:
    if request.content_length is not None and request.content_length > limit:
        raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes") from None


async def _inject(state: AppState, identity: Identity, body: Mapping[str, Any]) -> Injection:
    if identity.user_id is None or identity.conversation_id is None or not identity.mode.reads:
        return Injection()
    settings = state.settings
    rerank_ms = settings.rerank.timeout_ms if settings.rerank.enabled else 0.0
    timeout = (settings.memory.retrieval_timeout_ms + rerank_ms) / 1000
    started, deadline = time.perf_counter(), asyncio.get_running_loop().time() + timeout
    if not await _read_slot(state):  # more reads in flight than the machine serves in time: go on without
        return _degraded(state, "busy", started)
    try:  # the deadline counts from the request's arrival, the wait for a slot included
        async with asyncio.timeout_at(deadline):
            return await state.memory.inject(identity.user_id, identity.conversation_id, body)
    except TimeoutError:
        reason = "timeout"
    except Exception as exc:  # the chat never pays for memory failures; the reason goes to the headers
        log.warning("memory.inject_failed", error=type(exc).__name__, detail=str(exc)[:200])
        reason = type(exc).__name__
    finally:
        state.read_slots.release()
    return _degraded(state, reason, started)


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


def _degraded(state: AppState, reason: str, started: float) -> Injection:
    state.metrics.memory_degraded.labels("read").inc()
    return Injection(degraded={"memory": reason}, retrieval_ms=(time.perf_counter() - started) * 1000)


class ChatCall:
    """One chat completion request on its way through the proxy."""

    def __init__(self, request: web.Request, state: AppState) -> None:
        self.request = request
        self.state = state
        self.started = time.perf_counter()
        self.request_id = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        self.status = 0
        self.bytes_out = 0
        self.route = ""
        self.partial = False
        self.recorded = False  # one exchange per request, whichever of completion or hang-up comes first

    async def run(self) -> web.StreamResponse:
        """Serve the request end to end."""
        settings = self.state.settings
        raw = await _read_body(self.request, settings.server.max_body_bytes)
        check_json_depth(raw, settings.server.max_json_depth)  # before anything walks the body recursively
        reject_duplicate_headers(self.request.headers)
        body = parse_chat_request(raw)
        default_mode = Mode(settings.memory.default_mode) if settings.memory.enabled else Mode.OFF
        identity = scoped(identify(self.request.headers, body, default_mode), self.request.get(NAMESPACE))
        if not settings.memory.enabled:
            identity = Identity(identity.user_id, identity.conversation_id, Mode.OFF)
        self.state.metrics.observe("parse", time.perf_counter() - self.started)
        spans.record_span("memproxy.parse", time.perf_counter() - self.started)
        structlog.contextvars.bind_contextvars(
            request_id=self.request_id, user=log_user(identity.user_id, settings.logging.user_ids)
        )
        injection = await _inject(self.state, identity, body)
        if identity.mode.reads:
            self.state.metrics.observe("retrieve", injection.retrieval_ms / 1000)
            self.state.metrics.injected.observe(len(injection.injected_ids))
            record_retrieve(injection)
        outgoing = body if injection.messages is None else {**body, "messages": injection.messages}
        try:
            return await self._forward(body, outgoing, None if injection.messages else raw, identity, injection)
        finally:
            self._log(body, identity, injection, len(raw))

    async def _forward(
        self,
        body: dict[str, Any],
        outgoing: dict[str, Any],
        raw: bytes | None,
        identity: Identity,
        injection: Injection,
    ) -> web.StreamResponse:
        upstream = self.state.router.pick(body["model"])
        self.route = upstream.name
        headers = memory_headers(identity, injection)
        headers["X-Request-Id"] = self.request_id
        if identity.mode.writes:
            _say_write_degraded(headers, self._write_degraded())
        opened = time.perf_counter()
        try:
            async with upstream.open(outgoing, raw, self.request.headers) as reply:
                self.state.metrics.observe_upstream(self.route, body.get("model"), reply.ttfb_s)
                if reply.status >= 400:
                    self.state.metrics.upstream_errors.labels(str(reply.status)).inc()
                    raise UpstreamStatusError(reply.status, await reply.read(), reply.headers.get("Content-Type", ""))
                headers.update(relayed_headers(reply.headers))
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
        self, reply: Any, headers: dict[str, str], body: dict[str, Any], identity: Identity
    ) -> web.StreamResponse:
        data = await reply.read()
        self.status = reply.status
        if _stores(identity):  # committed before the client has a byte of the answer
            completion = _loads_or_none(data)
            committed = await self._record(
                body,
                identity,
                reply_from_completion(completion),
                partial=False,
                tool_calls=reply_tool_calls(completion),
            )
            if committed is not Committed.DURABLE:
                _say_write_degraded(headers, self._write_degraded() or committed.value)
        # One write for the status line, headers and body (a StreamResponse sends its headers on their own at
        # prepare: a second send per request, ~10% of memproxy-off's CPU at c=1 in ``make bench-profile``)
        response = web.Response(status=reply.status, headers=headers, body=data)
        await response.prepare(self.request)
        self.bytes_out = len(data)
        await response.write_eof()
        return response

    async def _relay_stream(
        self, reply: Any, headers: dict[str, str], body: dict[str, Any], identity: Identity
    ) -> web.StreamResponse:
        response = web.StreamResponse(status=reply.status, headers=headers)
        await response.prepare(self.request)
        self.status = reply.status
        # The reply is put together from the events only when it will be stored (a mode that writes, a known
        # user and conversation): otherwise the bytes pass untouched (parsing them was ~5% of a streamed
        # memproxy-off request's CPU).
        assembler = ToolReplyAssembler() if _stores(identity) else None
        try:
            failure = await self._pump(reply, response, assembler, body, identity)
        except (asyncio.CancelledError, ConnectionResetError):
            self.partial = True
            await self._record_stream(body, identity, assembler, partial=True)
            raise
        if assembler is not None:  # before the error event or the end of the body (a complete stream is committed)
            await self._record_stream(body, identity, assembler, partial=not assembler.complete)
        if failure is not None:
            await response.write(sse_error_event(failure))
        await response.write_eof()
        return response

    async def _pump(
        self,
        reply: Any,
        response: web.StreamResponse,
        assembler: ToolReplyAssembler | None,
        body: dict[str, Any],
        identity: Identity,
    ) -> ProxyError | None:
        first = True
        try:
            async for chunk in reply.chunks():
                if first:
                    self.state.metrics.observe("first_chunk", time.perf_counter() - self.started)
                    first = False
                if assembler is not None:
                    was_complete = assembler.complete
                    assembler.feed(chunk)
                    if assembler.complete and not was_complete:  # the event that completes the answer waits
                        await self._record_stream(body, identity, assembler, partial=False)
                await response.write(chunk)
                self.bytes_out += len(chunk)
        except ProxyError as exc:
            self.state.metrics.upstream_errors.labels("mid_stream").inc()
            log.warning("upstream.stream_failed", error=exc.message)
            self.partial = True
            return exc
        return None

    async def _record_stream(
        self, body: dict[str, Any], identity: Identity, assembler: ToolReplyAssembler | None, *, partial: bool
    ) -> None:
        if assembler is not None and (assembler.text or assembler.tool_texts) and not self.recorded:
            await self._record(body, identity, assembler.text, partial=partial, tool_calls=assembler.tool_texts)

    async def _record(
        self, body: dict[str, Any], identity: Identity, text: str, *, partial: bool, tool_calls: tuple[str, ...] = ()
    ) -> Committed:
        if identity.user_id is None or identity.conversation_id is None or self.recorded:
            return Committed.DURABLE
        self.recorded = True
        messages, cap = body["messages"], self.state.settings.memory.max_turn_chars
        exchange = Exchange(
            request_id=self.request_id,
            user_id=identity.user_id,
            conversation_id=identity.conversation_id,
            model=body["model"],
            route=self.route,
            user_messages=tuple(capped_turn(m, cap) for m in new_user_messages(messages)),
            assistant_text=capped_turn(text, cap),
            partial=partial,
            finished_at=datetime.now(UTC),
            system_prompt=capped_turn(system_prompt(messages) or "", cap) or None,
            context=tuple((role, capped_turn(t, cap)) for role, t in earlier_messages(messages)),
            client_key=bearer_key(self.request.headers),
            tool_calls=tool_calls,
            tool_results=new_tool_results(messages),
            traceparent=spans.current_traceparent(),
        )
        return await self.state.commits.commit(exchange)

    def _write_degraded(self) -> str | None:
        return storage_degraded(self.state)

    def _log(self, body: dict[str, Any], identity: Identity, injection: Injection, bytes_in: int) -> None:
        total = time.perf_counter() - self.started
        self.state.metrics.observe("total", total)
        self.state.metrics.observe_chat(self.route, body.get("model"), total)
        log.info(
            "request.completed",
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
    fault = memory.storage_fault if isinstance(memory, StorageStatus) else None
    commits = getattr(state, "commits", None)
    return (commits.degraded if commits is not None else None) or fault


def bearer_key(headers: Mapping[str, str]) -> SecretStr | None:
    """The client's ``Authorization: Bearer`` key, masked, or None."""
    scheme, _, key = headers.get("Authorization", "").partition(" ")
    return SecretStr(key.strip()) if scheme.lower() == "bearer" and key.strip() else None


def _say_write_degraded(headers: dict[str, str], reason: str | None) -> None:
    """Add ``degraded=write:<reason>`` to ``X-Memory-Arms`` (the exchange is not, or not yet, stored)."""
    arms = headers.get("X-Memory-Arms", "")
    if reason and "degraded=write:" not in arms:
        headers["X-Memory-Arms"] = ",".join(p for p in (arms, f"degraded=write:{reason}") if p)


def _loads_or_none(data: bytes) -> Any:
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return None


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """``POST /v1/chat/completions``."""
    state = request.app[STATE]
    call = ChatCall(request, state)
    try:
        response = await call.run()
    except ProxyError as exc:
        call.status = exc.status
        state.metrics.requests.labels("chat", str(exc.status)).inc()
        raise
    finally:
        structlog.contextvars.clear_contextvars()
    state.metrics.requests.labels("chat", str(response.status)).inc()
    return response


async def list_models(request: web.Request) -> web.Response:
    """``GET /v1/models``: the default upstream's list, relayed."""
    state = request.app[STATE]
    status, data = await state.router.default.models(request.headers)
    return web.Response(status=status, body=data, content_type="application/json")


async def healthz(request: web.Request) -> web.Response:
    """``GET /healthz``: the process is alive."""
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    """``GET /readyz``: ready when the chat path is (memory off for a storage fault included); every memory
    feature listed as live or off, with why, and a storage fault named."""
    state = request.app[STATE]
    memory = state.memory
    storage = storage_degraded(state)
    ready = not state.stopping
    features = readiness(getattr(memory, "features", None), state.settings)
    body: dict[str, Any] = {"status": "ready" if ready else "not ready", "memory": memory.ready, "features": features}
    if storage:
        body["storage"] = storage
    return web.json_response(body, status=200 if ready else 503)


async def metrics(request: web.Request) -> web.Response:
    """``GET /metrics``: Prometheus text."""
    state = request.app[STATE]
    await state.metrics.refresh()
    return web.Response(body=state.metrics.render(), content_type="text/plain", charset="utf-8")


def add_routes(app: web.Application) -> None:
    """Register the proxy's routes."""
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/chat/completions", chat_completions)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
