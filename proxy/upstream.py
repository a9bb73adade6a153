"""Upstream clients: a raw aiohttp passthrough for OpenAI-compatible servers, litellm for the rest.

Both answer ``open(body, headers)`` with an ``UpstreamReply`` (status, headers, an async iterator of raw
bytes) used as an async context manager, so that leaving the block early (client gone, error) closes the
upstream connection at once. ``map_client_errors`` is the one place that turns aiohttp's errors into ours.
The upstream URL comes from configuration only: nothing in a request can choose it. On litellm routes the
provider, ``api_base`` and key are the route's; request fields pass through an allow-list (``LITELLM_FIELDS``),
and fields that would steer the call (``LITELLM_STEERING_FIELDS``) are a 400.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from types import MappingProxyType
from typing import Any, Protocol

import aiohttp
import orjson

from proxy.config import RouteSettings, UpstreamSettings
from proxy.errors import (
    BadRequest,
    ProxyError,
    UpstreamStatusError,
    UpstreamTimeout,
    UpstreamUnreachable,
)
from proxy.memory import import_litellm
from proxy.memory.write import route_index
from proxy.sse import DONE_EVENT, data_event

# Request headers a client may pass on to an OpenAI-compatible upstream (lower case).
FORWARDED_REQUEST_HEADERS = frozenset(
    {
        "openai-organization",
        "openai-project",
        "openai-beta",
        "user-agent",
        "x-stainless-lang",
        "x-stainless-package-version",
        "x-stainless-os",
        "x-stainless-arch",
        "x-stainless-runtime",
        "x-stainless-runtime-version",
        "x-stainless-retry-count",
        "x-stainless-timeout",
        "idempotency-key",
        "traceparent",
        "tracestate",
    }  # W3C trace context: the client's trace continues upstream
)
# Request fields passed to litellm on a litellm route: OpenAI chat-completion parameters only. Everything else
# in ``litellm.acompletion``'s signature or its ``**kwargs`` (api_base, base_url, api_key, api_version,
# custom_llm_provider, extra_headers, headers, mock_response, model_list, deployment_id, metadata, aws_* /
# vertex_* credentials, litellm_params, ...) could choose where the call goes, with which key, or skip it.
LITELLM_FIELDS = frozenset(
    {"model", "messages", "functions", "function_call", "temperature", "top_p", "n", "stream", "stream_options",
     "stop", "max_tokens", "max_completion_tokens", "modalities", "prediction", "audio", "presence_penalty",
     "frequency_penalty", "logit_bias", "user", "response_format", "seed", "tools", "tool_choice",
     "parallel_tool_calls", "logprobs", "top_logprobs", "reasoning_effort", "verbosity", "safety_identifier",
     "service_tier", "store", "prompt_cache_key", "prompt_cache_retention", "thinking", "web_search_options"}
)  # fmt: skip
# Fields that would steer a litellm call: rejected with a 400 naming the field rather than silently dropped.
LITELLM_STEERING_FIELDS = frozenset(
    {"api_base", "base_url", "api_key", "api_version", "custom_llm_provider", "extra_headers", "headers",
     "mock_response", "mock_tool_calls", "model_list", "deployment_id", "litellm_params", "azure_ad_token",
     "organization", "aws_access_key_id", "aws_secret_access_key", "aws_region_name", "vertex_project",
     "vertex_location", "vertex_credentials", "extra_body"}
)  # fmt: skip
TRACE_HEADERS = ("traceparent", "tracestate")
CHAT_PATH = "/chat/completions"
RESPONSES_PATH = "/responses"
# Upstream response headers relayed to the client (lower case, or a prefix ending with "-").
RELAYED_RESPONSE_HEADERS = ("content-type", "openai-", "x-request-id", "x-ratelimit-", "retry-after")
# ``X-Request-Id`` on memproxy's answer is memproxy's own id (the one in its log lines); the upstream's id for the
# same exchange, which a provider's support asks for, is relayed under this name instead.
UPSTREAM_REQUEST_ID = "X-Upstream-Request-Id"
_RELAYED_NAMES = frozenset(h for h in RELAYED_RESPONSE_HEADERS if not h.endswith("-"))
_RELAYED_PREFIXES = tuple(h for h in RELAYED_RESPONSE_HEADERS if h.endswith("-"))


@contextlib.contextmanager
def map_client_errors() -> Iterator[None]:
    """Turn aiohttp and timeout errors into ``UpstreamUnreachable`` / ``UpstreamTimeout``."""
    try:
        yield
    except TimeoutError as exc:
        raise UpstreamTimeout("the upstream did not answer in time") from exc
    except aiohttp.ServerTimeoutError as exc:
        raise UpstreamTimeout("the upstream did not answer in time") from exc
    except aiohttp.ClientConnectorError as exc:
        raise UpstreamUnreachable(f"cannot connect to the upstream: {exc.os_error.strerror or exc}") from exc
    except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError) as exc:
        raise UpstreamUnreachable("the upstream closed the connection") from exc
    except aiohttp.ClientError as exc:
        raise UpstreamUnreachable(f"upstream connection failed: {type(exc).__name__}") from exc


def relayed_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """The upstream response headers worth passing to the client."""
    out = {}
    for name, value in headers.items():
        lower = name.lower()
        if lower in _RELAYED_NAMES or lower.startswith(_RELAYED_PREFIXES):
            out[UPSTREAM_REQUEST_ID if lower == "x-request-id" else name] = value
    return out


class UpstreamReply(Protocol):
    """An open upstream answer; leave its context to close the connection."""

    status: int
    headers: Mapping[str, str]
    ttfb_s: float

    def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives."""
        ...

    async def read(self) -> bytes:
        """The whole body."""
        ...


class Upstream(Protocol):
    """Something that answers chat completion requests."""

    name: str

    def open(
        self, body: dict[str, Any], raw: bytes | None, headers: Mapping[str, str], path: str = CHAT_PATH
    ) -> contextlib.AbstractAsyncContextManager[UpstreamReply]:
        """Send one request (chat completions, or ``path`` under the base URL); ``raw`` is the client's bytes
        when the body is unchanged."""
        ...


class AiohttpReply:
    """An aiohttp response as an ``UpstreamReply``."""

    def __init__(self, response: aiohttp.ClientResponse, ttfb_s: float) -> None:
        self._response = response
        self.status = response.status
        self.headers: Mapping[str, str] = response.headers
        self.ttfb_s = ttfb_s

    async def chunks(self) -> AsyncIterator[bytes]:
        with map_client_errors():
            async for chunk in self._response.content.iter_any():
                yield chunk

    async def read(self) -> bytes:
        with map_client_errors():
            return await self._response.read()


class OpenAICompatibleUpstream:
    """Raw passthrough to an OpenAI-compatible ``/chat/completions`` over one pooled session."""

    def __init__(
        self, name: str, base_url: str, api_key: str, session: aiohttp.ClientSession, strip_prefix: str | None = None
    ) -> None:
        self.name = name
        self._strip_prefix = strip_prefix
        self._base_url = base_url.rstrip("/")
        self._models_url = f"{self._base_url}/models"
        self._api_key = api_key
        self._session = session

    @property
    def base_url(self) -> str:
        """The base URL requests go under (``.../v1``)."""
        return self._base_url

    @property
    def session(self) -> aiohttp.ClientSession:
        """The pooled session (the passthrough of other ``/v1`` paths uses it too)."""
        return self._session

    def auth(self, client_headers: Mapping[str, str]) -> dict[str, str]:
        """The ``Authorization`` header to send: the configured key, else the client's own (or none)."""
        if self._api_key:
            return {"Authorization": f"Bearer {self._api_key}"}
        if "Authorization" in client_headers:
            return {"Authorization": client_headers["Authorization"]}
        return {}

    def _headers(self, client_headers: Mapping[str, str]) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        for name, value in client_headers.items():
            if name.lower() in FORWARDED_REQUEST_HEADERS:
                headers[name] = value
        headers.update(self.auth(client_headers))
        return headers

    @contextlib.asynccontextmanager
    async def open(
        self, body: dict[str, Any], raw: bytes | None, headers: Mapping[str, str], path: str = CHAT_PATH
    ) -> AsyncIterator[UpstreamReply]:
        if self._strip_prefix and str(body.get("model", "")).startswith(self._strip_prefix):
            body = {**body, "model": str(body["model"])[len(self._strip_prefix) :]}
            raw = None
        data = raw if raw is not None else orjson.dumps(body)
        started = time.perf_counter()
        url = self._base_url + path
        with map_client_errors():
            async with self._session.post(url, data=data, headers=self._headers(headers)) as response:
                yield AiohttpReply(response, time.perf_counter() - started)

    async def models(self, headers: Mapping[str, str]) -> tuple[int, bytes]:
        """The upstream's ``GET /models`` answer (status, body)."""
        auth = {k: v for k, v in self._headers(headers).items() if k != "Content-Type"}
        with map_client_errors():
            async with self._session.get(self._models_url, headers=auth) as response:
                return response.status, await response.read()


class _LiteLLMReply:
    def __init__(self, stream: bool, result: Any, ttfb_s: float) -> None:
        self.status = 200
        content_type = "text/event-stream" if stream else "application/json"
        self.headers: Mapping[str, str] = MappingProxyType({"Content-Type": content_type})
        self.ttfb_s = ttfb_s
        self._stream = stream
        self._result = result

    async def chunks(self) -> AsyncIterator[bytes]:
        if not self._stream:
            yield await self.read()
            return
        with map_litellm_errors():
            async for chunk in self._result:
                yield data_event(chunk.model_dump_json(exclude_none=True).encode())
        yield DONE_EVENT

    async def read(self) -> bytes:
        if self._stream:
            return b"".join([chunk async for chunk in self.chunks()])
        return self._result.model_dump_json(exclude_none=True).encode()  # type: ignore[no-any-return]


@contextlib.contextmanager
def map_litellm_errors() -> Iterator[None]:
    """Turn litellm's exceptions into relayed upstream errors with their status."""
    try:
        yield
    except ProxyError:
        raise
    except Exception as exc:  # litellm raises many unrelated types; every one must become an API error
        status = getattr(exc, "status_code", None)
        if isinstance(status, int) and 400 <= status < 600:
            body = orjson.dumps(
                {"error": {"message": str(exc)[:2000], "type": "upstream_error", "param": None, "code": None}}
            )
            raise UpstreamStatusError(status, body, "application/json") from exc
        if isinstance(exc, TimeoutError | asyncio.TimeoutError):
            raise UpstreamTimeout("the upstream did not answer in time") from exc
        raise UpstreamUnreachable(f"litellm route failed: {type(exc).__name__}") from exc


class LiteLLMUpstream:
    """A route through ``litellm.acompletion``, re-emitted in OpenAI wire format (streaming included)."""

    def __init__(self, route: RouteSettings, timeout_s: float) -> None:
        self.name = f"litellm:{route.prefix}"
        self._route = route
        self._timeout_s = timeout_s

    def _arguments(self, body: dict[str, Any]) -> dict[str, Any]:
        """litellm's arguments: the allowed request fields, then the route's own provider, address and key."""
        steering = sorted(LITELLM_STEERING_FIELDS.intersection(body))
        if steering:
            raise BadRequest(
                f"'{steering[0]}' is not accepted: the route fixes where and with which key a call goes",
                param=steering[0],
                code="unsupported_parameter",
            )
        args = {k: v for k, v in body.items() if k in LITELLM_FIELDS}
        model = str(args["model"])
        if self._route.strip_prefix:
            model = model[len(self._route.prefix) :]
        provider = self._route.pinned_provider
        args["model"] = model.removeprefix(f"{provider}/")
        args["custom_llm_provider"] = provider
        if self._route.base_url:
            args["api_base"] = self._route.base_url
        if self._route.api_key is not None:
            args["api_key"] = self._route.api_key.get_secret_value()
        args["timeout"] = self._timeout_s
        return args

    @contextlib.asynccontextmanager
    async def open(
        self, body: dict[str, Any], raw: bytes | None, headers: Mapping[str, str], path: str = CHAT_PATH
    ) -> AsyncIterator[UpstreamReply]:
        if path != CHAT_PATH:
            raise BadRequest(
                f"the route for {str(body.get('model'))[:80]!r} is a litellm route, which serves chat completions "
                "only: send this API to an OpenAI-compatible route",
                param="model",
                code="unsupported_route",
            )
        litellm = await asyncio.to_thread(import_litellm)
        started = time.perf_counter()
        trace = {name: headers[name] for name in TRACE_HEADERS if name in headers}
        with map_litellm_errors():
            result = await litellm.acompletion(**self._arguments(body), **({"extra_headers": trace} if trace else {}))
        stream = bool(body.get("stream"))
        reply = _LiteLLMReply(stream, result, time.perf_counter() - started)
        try:
            yield reply
        finally:
            if stream and hasattr(result, "aclose"):
                await result.aclose()


class Router:
    """Chooses the upstream for a model by the one routing rule (``route_index``), else the default."""

    def __init__(self, default: OpenAICompatibleUpstream, routes: list[tuple[RouteSettings, Upstream]]) -> None:
        self.default = default
        self._routes = routes
        self._prefixes = tuple(route.prefix for route, _ in routes)

    def pick(self, model: str) -> Upstream:
        """The upstream that serves ``model``."""
        index = route_index(self._prefixes, model)
        return self.default if index is None else self._routes[index][1]


def build_session(settings: UpstreamSettings) -> aiohttp.ClientSession:
    """The one pooled client session for every OpenAI-compatible upstream."""
    timeout = aiohttp.ClientTimeout(total=None, connect=settings.connect_timeout_s, sock_read=settings.timeout_s)
    connector = aiohttp.TCPConnector(
        limit=settings.max_connections, limit_per_host=settings.max_connections, ttl_dns_cache=300
    )
    return aiohttp.ClientSession(
        timeout=timeout, connector=connector, auto_decompress=True, skip_auto_headers=("User-Agent",)
    )


def build_router(
    settings: UpstreamSettings, routes: tuple[RouteSettings, ...], session: aiohttp.ClientSession
) -> Router:
    """The router for the configured default upstream and routes."""
    default = OpenAICompatibleUpstream("default", settings.base_url, settings.api_key.get_secret_value(), session)
    built: list[tuple[RouteSettings, Upstream]] = []
    for route in routes:
        if route.provider == "openai":
            key = route.api_key.get_secret_value() if route.api_key else ""
            built.append(
                (
                    route,
                    OpenAICompatibleUpstream(
                        f"openai:{route.prefix}",
                        route.base_url or settings.base_url,
                        key,
                        session,
                        route.prefix if route.strip_prefix else None,
                    ),
                )
            )
        else:
            built.append((route, LiteLLMUpstream(route, settings.timeout_s)))
    return Router(default, built)
