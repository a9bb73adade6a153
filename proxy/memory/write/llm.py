"""The memory side's LLM calls: one narrow protocol for structured JSON output, and its implementations.

``LLMClient.complete_json`` sends chat messages with a strict ``json_schema`` response format and returns the
parsed JSON object. Two kinds of failure matter to the write path, and every implementation maps its own
errors onto them:

- ``LLMUnavailable``: the upstream could not be asked (connection refused, timeout, 408/429/5xx).
  The job waits with backoff and tries again later; nothing is lost.
- ``LLMBadOutput``: the upstream answered, but not with a usable object (invalid JSON, a refusal, an empty
  answer, another 4xx). The caller retries once, then gives up on that step.
- ``LLMConfigError`` (401/403): no key, or a key the upstream rejects. Retrying cannot help until the
  configuration or the key changes: the job waits, visibly, for a usable key (``proxy.memory.write.latest_chat``).

Keys: a configured key wins; without one, an OpenAI-compatible client asks its ``KeySource`` for the key of
the user whose job is running (the key of that user's latest chat on the same route, held in memory only).

``OpenAICompatibleLLM`` posts to ``{base_url}/chat/completions`` with aiohttp (the cheap path);
``LiteLLMClient`` goes through litellm for providers that need translation; ``PrefixRouter`` picks one by
model-name prefix with the chat's own rule (``proxy.memory.write.routing``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import Any, Protocol, runtime_checkable

import aiohttp
from pydantic import BaseModel, ConfigDict, Field, SecretStr

from proxy.memory.errors import MemoryLayerError
from proxy.memory.lazy import import_litellm
from proxy.memory.write.routing import route_index

JSON = dict[str, Any]
_UNAVAILABLE_STATUSES = frozenset({408, 409, 425, 429})
CONFIG_STATUSES = frozenset({401, 403})


class LLMError(MemoryLayerError):
    """Base of the memory-side LLM errors."""


class LLMUnavailable(LLMError):
    """The upstream could not be asked right now; try again later."""


class LLMBadOutput(LLMError):
    """The upstream answered with something other than the requested JSON object."""


class LLMConfigError(LLMError):
    """No key, or a key the upstream rejects (401/403): only a new key or configuration helps.

    ``reason`` is ``"no_key"`` when the call had no key at all, else ``"key_rejected"``.
    """

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


class KeySource(Protocol):
    """The held key for memory-side calls of the user whose job is running (see ``latest_chat``)."""

    def key(self, route: str) -> str | None:
        """The key to send on ``route``, or None."""
        ...

    def rejected(self, route: str, key: str) -> None:
        """``key`` got 401/403 on ``route``: stop using it."""
        ...


@runtime_checkable
class LLMClient(Protocol):
    """Asks a model for one JSON object that follows ``schema``."""

    async def complete_json(
        self, model: str, messages: list[dict[str, Any]], schema: dict[str, Any], schema_name: str
    ) -> dict[str, Any]:
        """The parsed object; raises ``LLMUnavailable`` or ``LLMBadOutput``."""
        ...


UsageObserver = Callable[[str, str, Mapping[str, Any]], None]  # (call, model, usage) of one answered call


def report_usage(observer: UsageObserver | None, call: str, model: str, body: Any) -> None:
    """Hand the ``usage`` of an answer (token counts, as OpenAI reports them) to ``observer``, if any."""
    if observer is not None and isinstance(body, Mapping):
        usage = body.get("usage")
        observer(call, model, usage if isinstance(usage, Mapping) else {})


def response_format(schema: Mapping[str, Any], schema_name: str) -> JSON:
    """The OpenAI ``response_format`` for strict structured output."""
    return {
        "type": "json_schema",
        "json_schema": {"name": schema_name, "schema": dict(schema), "strict": True},
    }


def parse_completion(body: Any) -> JSON:
    """The JSON object in a chat-completion response body, or ``LLMBadOutput`` saying what was wrong."""
    try:
        message = body["choices"][0]["message"]
    except (KeyError, IndexError, TypeError):
        raise LLMBadOutput("the response has no choices[0].message") from None
    if not isinstance(message, Mapping):
        raise LLMBadOutput("choices[0].message is not an object")
    if message.get("refusal"):
        raise LLMBadOutput(f"the model refused: {str(message['refusal'])[:200]}")
    return parse_json_object(message.get("content"))


def parse_json_object(content: Any) -> JSON:
    """``content`` parsed as one JSON object (code fences tolerated), or ``LLMBadOutput``."""
    if not isinstance(content, str) or not content.strip():
        raise LLMBadOutput("the model returned no content")
    text = content.strip()
    if text.startswith("```"):
        text = text.strip("`").removeprefix("json").strip()
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise LLMBadOutput(f"the model returned invalid JSON: {error.msg} at {error.pos}") from None
    if not isinstance(value, dict):
        raise LLMBadOutput(f"the model returned JSON {type(value).__name__}, not an object")
    return value


def status_error(status: int, body: str, *, sent_key: bool = True) -> LLMError:
    """The error for a non-200 answer: ``LLMConfigError`` for 401/403, ``LLMUnavailable`` for statuses worth
    waiting out, else bad output."""
    if status in CONFIG_STATUSES:  # the body is left out: providers quote (part of) the rejected key
        what = "rejected the key" if sent_key else "wants a key and none was sent"
        reason = "key_rejected" if sent_key else "no_key"
        return LLMConfigError(reason, f"upstream status {status}: the upstream {what}")
    detail = f"upstream status {status}: {body[:300]}"
    if status >= 500 or status in _UNAVAILABLE_STATUSES:
        return LLMUnavailable(detail)
    return LLMBadOutput(detail)


def pick_key(configured: SecretStr, keys: KeySource | None, route: str) -> tuple[str, bool]:
    """The key a memory-side call sends (the configured one, else the user's held key on ``route``) and whether
    it is a held client key."""
    if configured.get_secret_value() or keys is None:
        return configured.get_secret_value(), False
    held = keys.key(route)
    return held or "", held is not None


async def post_for_json(
    session: aiohttp.ClientSession,
    url: str,
    body: JSON,
    headers: Mapping[str, str],
    *,
    sent_key: bool,
    on_rejected: Callable[[], None] | None = None,
) -> Any:
    """POST ``body`` and parse the JSON answer: ``LLMUnavailable`` when unreachable, ``status_error`` for a
    non-200 (``on_rejected`` first, for 401/403), ``LLMBadOutput`` for a body that is not JSON."""
    try:
        async with session.post(url, json=body, headers=headers) as response:
            text, status = await response.text(), response.status
    except (aiohttp.ClientError, TimeoutError) as error:
        raise LLMUnavailable(f"cannot reach the memory LLM: {type(error).__name__}") from None
    if status != 200:
        if on_rejected is not None and status in CONFIG_STATUSES:
            on_rejected()
        raise status_error(status, text, sent_key=sent_key)
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise LLMBadOutput("the upstream answered with a body that is not JSON") from None


def rejecting(keys: KeySource | None, route: str, key: str, held: bool) -> Callable[[], None] | None:
    """What to do when the upstream rejects a held key: stop using it (nothing for a configured key)."""
    if not held or keys is None:
        return None
    return lambda: keys.rejected(route, key)


class OpenAICompatibleSettings(BaseModel):
    """An OpenAI-compatible server for memory-side calls."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    base_url: str = "https://api.openai.com/v1"
    api_key: SecretStr = SecretStr("")
    timeout_s: float = Field(default=60.0, gt=0)
    max_connections: int = Field(default=16, ge=1)
    temperature: float = Field(default=0.0, ge=0.0, le=2.0)


class OpenAICompatibleLLM:
    """``LLMClient`` over a raw aiohttp POST to ``/chat/completions``; owns one pooled session."""

    def __init__(
        self,
        settings: OpenAICompatibleSettings,
        *,
        route: str = "default",
        keys: KeySource | None = None,
        on_usage: UsageObserver | None = None,
    ) -> None:
        self._settings = settings
        self._on_usage = on_usage
        self._url = settings.base_url.rstrip("/") + "/chat/completions"
        self._session: aiohttp.ClientSession | None = None
        self._route = route
        self._keys = keys  # None: never a held key (another base_url than the chat's, or holding is off)

    async def __aenter__(self) -> OpenAICompatibleLLM:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=self._settings.max_connections),
            timeout=aiohttp.ClientTimeout(total=self._settings.timeout_s),
        )
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def complete_json(
        self, model: str, messages: list[dict[str, Any]], schema: dict[str, Any], schema_name: str
    ) -> dict[str, Any]:
        """POST the request and parse the answer (see the module doc for the errors)."""
        if self._session is None:
            raise LLMUnavailable("the memory LLM client is not open")
        body = {
            "model": model,
            "messages": messages,
            "temperature": self._settings.temperature,
            "response_format": response_format(schema, schema_name),
        }
        key, held = pick_key(self._settings.api_key, self._keys, self._route)
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        rejected = rejecting(self._keys, self._route, key, held)
        data = await post_for_json(self._session, self._url, body, headers, sent_key=bool(key), on_rejected=rejected)
        report_usage(self._on_usage, schema_name, model, data)
        return parse_completion(data)


class LiteLLMSettings(BaseModel):
    """Memory-side calls through litellm (providers that do not speak the OpenAI wire format)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    api_base: str | None = None
    api_key: SecretStr | None = None
    timeout_s: float = Field(default=60.0, gt=0)
    temperature: float = Field(default=0.0, ge=0.0, le=2.0)
    provider: str | None = None  # the route's fixed litellm provider: the model name cannot choose another


class LiteLLMClient:
    """``LLMClient`` over ``litellm.acompletion``; litellm is imported lazily, off the event loop."""

    def __init__(self, settings: LiteLLMSettings, *, on_usage: UsageObserver | None = None) -> None:
        self._settings = settings
        self._on_usage = on_usage
        self._litellm: Any = None
        self._import_lock = asyncio.Lock()

    async def _module(self) -> Any:
        async with self._import_lock:
            if self._litellm is None:
                self._litellm = await asyncio.to_thread(import_litellm)
        return self._litellm

    def _arguments(self, model: str, messages: list[dict[str, Any]], schema: JSON, name: str) -> JSON:
        args: JSON = {
            "model": model,
            "messages": messages,
            "response_format": response_format(schema, name),
            "temperature": self._settings.temperature,
            "timeout": self._settings.timeout_s,
        }
        if self._settings.provider:
            args["custom_llm_provider"] = self._settings.provider
            args["model"] = model.removeprefix(f"{self._settings.provider}/")
        if self._settings.api_base:
            args["api_base"] = self._settings.api_base
        if self._settings.api_key is not None:
            args["api_key"] = self._settings.api_key.get_secret_value()
        return args

    async def complete_json(
        self, model: str, messages: list[dict[str, Any]], schema: dict[str, Any], schema_name: str
    ) -> dict[str, Any]:
        """Call litellm and parse the answer (see the module doc for the errors)."""
        litellm = await self._module()
        try:
            result = await litellm.acompletion(**self._arguments(model, messages, schema, schema_name))
        except Exception as error:  # litellm raises many unrelated types; each must become one of ours
            raise _map_litellm_error(error) from None
        data = result.model_dump()
        report_usage(self._on_usage, schema_name, model, data)
        return parse_completion(data)


def _map_litellm_error(error: Exception) -> LLMError:
    status = getattr(error, "status_code", None)
    if isinstance(status, int) and 400 <= status < 600:
        return status_error(status, str(error))
    return LLMUnavailable(f"litellm call failed: {type(error).__name__}")


@dataclasses.dataclass(frozen=True)
class Route:
    """Models named ``prefix...`` go to ``client`` (with the prefix removed when ``strip_prefix``)."""

    prefix: str
    client: LLMClient
    strip_prefix: bool = False


class PrefixRouter:
    """``LLMClient`` that sends each model where the chat sends it (``route_index``), else to ``default``."""

    def __init__(self, default: LLMClient, routes: Sequence[Route] = ()) -> None:
        self._default = default
        self._routes = tuple(routes)
        self._prefixes = tuple(route.prefix for route in self._routes)

    def resolve(self, model: str) -> tuple[LLMClient, str]:
        """The client and the model name to send it."""
        index = route_index(self._prefixes, model)
        if index is None:
            return self._default, model
        route = self._routes[index]
        return route.client, model[len(route.prefix) :] if route.strip_prefix else model

    async def complete_json(
        self, model: str, messages: list[dict[str, Any]], schema: dict[str, Any], schema_name: str
    ) -> dict[str, Any]:
        """Delegate to the routed client."""
        client, name = self.resolve(model)
        return await client.complete_json(name, messages, schema, schema_name)
