"""The one seam between the HTTP shell and memory.

The shell asks ``MemoryService.inject`` for the messages to send upstream (read path) and hands the finished
exchange to ``MemoryService.record`` (write path). ``NullMemory`` is the pure passthrough used when memory is
switched off. The shell never reaches past this seam into the store.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from datetime import datetime
from typing import Any, Protocol, runtime_checkable

from pydantic import SecretStr


@dataclasses.dataclass(frozen=True, slots=True)
class Injection:
    """What the read path did for one request. ``messages`` None means: send the request unchanged."""

    messages: list[dict[str, Any]] | None = None
    injected_ids: tuple[str, ...] = ()
    arms: tuple[str, ...] = ()
    degraded: Mapping[str, str] = dataclasses.field(default_factory=dict)
    retrieval_ms: float = 0.0


@dataclasses.dataclass(frozen=True, slots=True)
class Exchange:
    """One finished request/reply pair, as the write path receives it."""

    request_id: str
    user_id: str
    conversation_id: str
    model: str
    route: str
    user_messages: tuple[str, ...]
    assistant_text: str
    partial: bool
    finished_at: datetime
    system_prompt: str | None = None
    context: tuple[tuple[str, str], ...] = ()  # (role, text) of the messages just before, oldest first
    tool_calls: tuple[str, ...] = ()  # the reply's tool calls, as bounded turn texts (proxy.tool_history)
    tool_results: tuple[str, ...] = ()  # the request's new tool results, as bounded turn texts
    client_key: SecretStr | None = None  # the client's own key: held in memory for memory-side calls, never stored


class MemoryService(Protocol):
    """Read path and write path as the HTTP shell sees them."""

    @property
    def ready(self) -> bool:
        """Whether every memory component has loaded."""
        ...

    async def inject(self, user_id: str, conversation_id: str, body: Mapping[str, Any]) -> Injection:
        """Retrieve what is known about ``user_id`` and return the messages to send upstream."""
        ...

    async def record(self, exchange: Exchange) -> None:
        """Durably hand a finished exchange to the write path (returns once it is committed)."""
        ...


@runtime_checkable
class StorageStatus(Protocol):
    """A memory service that can say its storage is failing (the shell then says so in the headers)."""

    @property
    def storage_fault(self) -> str | None:
        """``component:reason`` while writes to the data directory fail, else None."""
        ...


class NullMemory:
    """No memory: every request passes through unchanged and nothing is stored."""

    ready = True

    async def inject(self, user_id: str, conversation_id: str, body: Mapping[str, Any]) -> Injection:
        """Nothing to inject."""
        return Injection()

    async def record(self, exchange: Exchange) -> None:
        """Nothing to store."""
