"""Where each dialect's requests go.

- chat completions: the model's route (``Router.pick``), ``<base_url>/chat/completions`` or litellm;
- Responses: the model's route, ``<base_url>/responses`` (OpenAI-compatible routes only);
- Messages: Anthropic's API (``upstream.anthropic_base_url``), or, with that empty, translated to chat
  completions on the model's route and answered in Anthropic's shape (``translate``).
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import AsyncIterator, Mapping
from typing import Any, Protocol

from multidict import CIMultiDict

from proxy.dialects.anthropic_upstream import AnthropicUpstream, relayed_anthropic_headers
from proxy.dialects.translate import TranslatedReply, to_chat
from proxy.upstream import CHAT_PATH, RESPONSES_PATH, Router, Upstream, UpstreamReply, relayed_headers


class Target(Protocol):
    """One upstream as a dialect's requests see it."""

    name: str

    def open(
        self, body: dict[str, Any], raw: bytes | None, headers: Mapping[str, str]
    ) -> contextlib.AbstractAsyncContextManager[UpstreamReply]:
        """Send the request (``raw``: the client's bytes when the body is unchanged)."""
        ...

    def relayed_headers(self, headers: Mapping[str, str]) -> dict[str, str]:
        """The upstream's response headers worth passing to the client."""
        ...


class RoutedTarget:
    """An OpenAI-style path on a route's upstream (named ``responses:<route>`` for the Responses API, so that the
    memory side can answer in the same dialect)."""

    def __init__(self, upstream: Upstream, path: str) -> None:
        self.name = upstream.name if path == CHAT_PATH else f"responses:{upstream.name}"
        self._upstream = upstream
        self._path = path

    def open(
        self, body: dict[str, Any], raw: bytes | None, headers: Mapping[str, str]
    ) -> contextlib.AbstractAsyncContextManager[UpstreamReply]:
        """The route's answer."""
        return self._upstream.open(body, raw, headers, self._path)

    def relayed_headers(self, headers: Mapping[str, str]) -> dict[str, str]:
        """OpenAI's headers."""
        return relayed_headers(headers)


class AnthropicTarget:
    """Anthropic's Messages API, raw."""

    def __init__(self, upstream: AnthropicUpstream) -> None:
        self.name = upstream.name
        self._upstream = upstream

    def open(
        self, body: dict[str, Any], raw: bytes | None, headers: Mapping[str, str]
    ) -> contextlib.AbstractAsyncContextManager[UpstreamReply]:
        """Anthropic's answer."""
        return self._upstream.open(body, raw, headers)

    def relayed_headers(self, headers: Mapping[str, str]) -> dict[str, str]:
        """Anthropic's headers."""
        return relayed_anthropic_headers(headers)


class TranslatedTarget:
    """A Messages request answered by a chat-completions route, in Anthropic's shape (named as the route: the
    memory side uses the same route, as for a chat)."""

    def __init__(self, upstream: Upstream) -> None:
        self.name = upstream.name
        self._upstream = upstream

    @contextlib.asynccontextmanager
    async def open(
        self, body: dict[str, Any], raw: bytes | None, headers: Mapping[str, str]
    ) -> AsyncIterator[UpstreamReply]:
        """The chat route's answer, translated (a client's ``x-api-key`` goes on as its bearer key)."""
        if "x-api-key" in headers and "Authorization" not in headers:
            bearer = CIMultiDict(headers)
            bearer["Authorization"] = f"Bearer {headers['x-api-key']}"
            headers = bearer
        async with self._upstream.open(to_chat(body), None, headers, CHAT_PATH) as reply:
            yield TranslatedReply(reply, str(body["model"]), bool(body.get("stream")))

    def relayed_headers(self, headers: Mapping[str, str]) -> dict[str, str]:
        """Nothing of the chat route's own headers (they describe another API)."""
        return {}


class Targets:
    """Picks the target of a dialect's request for a model."""

    def __init__(self, router: Router, anthropic: AnthropicUpstream | None) -> None:
        self.router = router
        self.anthropic = anthropic
        self._anthropic_target = AnthropicTarget(anthropic) if anthropic is not None else None
        self._targets: dict[tuple[str, Upstream], Target] = {}  # per dialect and upstream: made once, on first use

    def pick(self, dialect: str, model: str) -> Target:
        """Where a ``dialect`` request for ``model`` goes."""
        if dialect == "messages" and self._anthropic_target is not None:
            return self._anthropic_target
        upstream = self.router.pick(model)
        target = self._targets.get((dialect, upstream))
        if target is None:
            target = self._targets[(dialect, upstream)] = self._target(dialect, upstream)
        return target

    @staticmethod
    def _target(dialect: str, upstream: Upstream) -> Target:
        if dialect == "messages":
            return TranslatedTarget(upstream)
        return RoutedTarget(upstream, RESPONSES_PATH if dialect == "responses" else CHAT_PATH)


class ResponseChains:
    """Which conversation each Responses answer belongs to (``previous_response_id`` chains), the oldest
    dropped past ``max_entries``; in process memory only."""

    def __init__(self, max_entries: int = 100_000) -> None:
        self._max = max_entries
        self._conversations: OrderedDict[str, str] = OrderedDict()

    def get(self, response_id: str) -> str | None:
        """The conversation of a response, or None."""
        return self._conversations.get(response_id)

    def put(self, response_id: str, conversation_id: str) -> None:
        """Note the conversation of a response."""
        self._conversations[response_id] = conversation_id
        self._conversations.move_to_end(response_id)
        while len(self._conversations) > self._max:
            self._conversations.popitem(last=False)
