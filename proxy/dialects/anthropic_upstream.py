"""Anthropic's API as an upstream: ``POST <anthropic_base_url>/v1/messages`` (and its other paths), raw.

The key is the configured ``upstream.anthropic_api_key``, else the client's own ``x-api-key`` (or its
``Authorization`` bearer token, as the SDK's ``auth_token`` sends it); ``anthropic-version`` and
``anthropic-beta`` go along as the client sent them (``anthropic-version`` defaults to the SDK's own).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

import aiohttp
import orjson

from proxy.upstream import AiohttpReply, UpstreamReply, map_client_errors

MESSAGES_PATH = "/v1/messages"
DEFAULT_VERSION = "2023-06-01"
# Request headers the client may pass on to Anthropic (lower case), beside the key.
FORWARDED = frozenset(
    {"anthropic-version", "anthropic-beta", "user-agent", "idempotency-key", "traceparent", "tracestate"}
    | {f"x-stainless-{part}" for part in ("lang", "package-version", "os", "arch", "runtime", "runtime-version")}
    | {"x-stainless-retry-count", "x-stainless-timeout"}
)
# Response headers relayed to the client (lower case, or a prefix ending with "-").
RELAYED_PREFIXES = ("anthropic-", "retry-after", "request-id")


class AnthropicUpstream:
    """Raw passthrough to Anthropic's API over the shared pooled session."""

    name = "anthropic"

    def __init__(self, base_url: str, api_key: str, session: aiohttp.ClientSession) -> None:
        self.base_url = base_url.rstrip("/")
        self._api_key = api_key
        self.session = session

    def headers(self, client: Mapping[str, str], *, json: bool = True) -> dict[str, str]:
        """The request headers for Anthropic: the key, the version, the client's passable headers."""
        out = {"Content-Type": "application/json"} if json else {}
        out.update({name: value for name, value in client.items() if name.lower() in FORWARDED})
        if not any(name.lower() == "anthropic-version" for name in out):
            out["anthropic-version"] = DEFAULT_VERSION
        if self._api_key:
            out["x-api-key"] = self._api_key
        elif "x-api-key" in client:
            out["x-api-key"] = client["x-api-key"]
        elif "Authorization" in client:
            out["Authorization"] = client["Authorization"]
        return out

    @contextlib.asynccontextmanager
    async def open(
        self, body: dict[str, Any], raw: bytes | None, headers: Mapping[str, str], path: str = MESSAGES_PATH
    ) -> AsyncIterator[UpstreamReply]:
        data = raw if raw is not None else orjson.dumps(body)
        started = time.perf_counter()
        with map_client_errors():
            async with self.session.post(self.base_url + path, data=data, headers=self.headers(headers)) as response:
                yield AiohttpReply(response, time.perf_counter() - started)


def relayed_anthropic_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """Anthropic's response headers worth passing to the client (its request id, rate limits, retry-after)."""
    return {
        name: value
        for name, value in headers.items()
        if name.lower().startswith(RELAYED_PREFIXES) or name.lower() == "content-type"
    }
