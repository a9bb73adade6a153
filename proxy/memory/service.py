"""The one seam between the HTTP shell and memory.

The shell asks ``MemoryService.inject`` for the messages to send upstream (read path) and hands the finished
exchange to ``MemoryService.record`` (write path). ``NullMemory`` is the pure passthrough used when memory is
switched off. The management API works through ``MemoryService.admin`` (``MemoryAdmin``): a service whose
``admin`` is None has no memory to manage. The shell's handlers never reach past this seam into the store or the
job queue (one exception left: the shadow evaluator, ``proxy/shadow.py``, runs retrieval on the engine's own parts).
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Mapping, Sequence
from datetime import datetime
from typing import Any, Protocol

from pydantic import SecretStr

from proxy.memory.features import FeatureBoard
from proxy.memory.read.placement import BlockPlan
from proxy.memory.store.records import Kind, MemoryRecord
from proxy.memory.write.stated import Stated


@dataclasses.dataclass(frozen=True, slots=True)
class Injection:
    """What the read path did for one request. An empty ``plan`` means: send the request unchanged."""

    plan: BlockPlan = dataclasses.field(default_factory=BlockPlan)
    injected_ids: tuple[str, ...] = ()
    arms: tuple[str, ...] = ()
    degraded: Mapping[str, str] = dataclasses.field(default_factory=dict)
    retrieval_ms: float = 0.0


@dataclasses.dataclass(frozen=True, slots=True)
class ReadRequest:
    """What the read path is asked for one request: whose memory, which conversation, the request's chat view
    (``messages``: chat-shaped, whatever the API), and whether the provider keeps the conversation's earlier
    turns itself (a Responses request continuing ``previous_response_id``)."""

    user_id: str
    conversation_id: str
    messages: Sequence[Mapping[str, Any]]
    provider_holds_history: bool = False


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
    traceparent: str | None = None  # the request's span (tracing on), so the write-side job joins its trace


class MemoryService(Protocol):
    """Memory as the HTTP shell sees it: the read path, the write path, and what the shell reports and manages.

    Every service implements all of it (the engine, ``NullMemory``, ``unavailable.UnavailableMemory``,
    ``shadow.ShadowMemory``), so the shell calls each member directly: a service without a storage, a feature
    board, management or a job queue says so with ``None`` (or 0 users released).
    """

    @property
    def ready(self) -> bool:
        """Whether every memory component has loaded."""
        ...

    @property
    def storage_fault(self) -> str | None:
        """``component:reason`` while writes to the data directory fail (the shell says so in the headers)."""
        ...

    @property
    def features(self) -> FeatureBoard | None:
        """Which memory features are live or off, and why (``/readyz``, the startup report); None: none."""
        ...

    @property
    def admin(self) -> MemoryAdmin | None:
        """The management operations; None when there is no memory to manage (the shell answers 503)."""
        ...

    def release_idle(self) -> int:
        """Drop what is cached for users not read lately (``proxy.heap`` asks); how many users were dropped."""
        ...

    async def jobs_busy(self) -> bool | None:
        """Whether a memory job is due or running now (``proxy.recycle`` restarts only when none is); None: the
        service has no job queue."""
        ...

    async def inject(self, request: ReadRequest) -> Injection:
        """Retrieve what is known about the request's user and plan where the memory goes in the request."""
        ...

    def carried(self, request: ReadRequest) -> Injection:
        """What the conversation already carries, without retrieving (the read failed or was skipped)."""
        ...

    async def record(self, exchange: Exchange) -> None:
        """Durably hand a finished exchange to the write path (returns once it is committed)."""
        ...


class RecordPage(Protocol):
    """One page of a user's records, newest first, and the cursor of the next (None at the end)."""

    @property
    def data(self) -> list[MemoryRecord]: ...

    @property
    def next_cursor(self) -> str | None: ...


@dataclasses.dataclass(frozen=True, slots=True)
class SearchPreview:
    """What the proxy would inject for a query, with the evidence behind each result."""

    results: list[dict[str, Any]]
    arms: list[str]
    injected_block: str


class MemoryOperations(Protocol):
    """What operators may see and do with what memory keeps (the management API and its operator routes)."""

    async def user_ids(self) -> list[str]:
        """Every user with at least one record."""
        ...

    async def get_memory(self, user_id: str, id: str) -> MemoryRecord | None:
        """One record of the user (history included), or None."""
        ...

    async def list_memories(
        self,
        user_id: str,
        kinds: Sequence[Kind] | None = None,
        *,
        limit: int = 50,
        cursor: str | None = None,
        include_invalid: bool = False,
    ) -> RecordPage:
        """The user's records, newest first, ``limit`` at a time (``ValueError`` for a bad cursor)."""
        ...

    def export_user(self, user_id: str) -> AsyncIterator[str]:
        """Every record of the user, history included, as JSON lines."""
        ...

    async def search(self, user_id: str, query: str, k: int = 10) -> SearchPreview:
        """What would be injected for a conversation whose last user message is ``query``."""
        ...

    async def add_fact(
        self,
        user_id: str,
        text: str,
        importance: int | None = None,
        category: str | None = None,
        expires_at: datetime | None = None,
    ) -> MemoryRecord:
        """A fact stated directly, searchable when this returns (never injected after ``expires_at``)."""
        ...

    async def add_many(self, user_id: str, records: Sequence[MemoryRecord]) -> list[str]:
        """Bulk add, idempotent by id; the ids that were new."""
        ...

    async def edit(
        self,
        user_id: str,
        id: str,
        text: str | None = None,
        importance: int | None = None,
        expires_at: datetime | None = None,
    ) -> MemoryRecord | None:
        """The edited record (a new one when the text changed), or None when there is no such valid record."""
        ...

    async def delete(self, user_id: str, id: str) -> bool:
        """Delete one record for good; whether it existed."""
        ...

    async def forget_user(self, user_id: str) -> dict[str, int]:
        """Every trace of the user; counts by kind (and ``jobs``)."""
        ...

    async def regenerate_insights(self, user_id: str) -> str:
        """Queue an insight regeneration for the user; the job's id."""
        ...

    async def dead_letters(self, limit: int = 100) -> list[dict[str, Any]]:
        """Memory jobs that failed every attempt, the most recently failed first."""
        ...

    async def requeue_dead_letter(self, job_id: str) -> bool:
        """Give a dead job a fresh set of attempts; whether there was one."""
        ...

    async def job(self, job_id: str) -> dict[str, Any] | None:
        """One job's row, or None."""
        ...


class MemoryAdmin(MemoryOperations, Protocol):
    """The management operations, and facts taken the way the write path takes them (the MCP server's tools)."""

    async def remember(self, user_id: str, text: str, expires_at: datetime | None = None) -> Stated:
        """Screen, reconcile and store ``text`` as one of the user's facts, the way the write path takes facts
        (the MCP server's ``add_memory``)."""
        ...


class NullMemory:
    """No memory: every request passes through unchanged and nothing is stored."""

    ready = True
    storage_fault = None
    features = None
    admin = None

    def release_idle(self) -> int:
        """Nothing cached."""
        return 0

    async def jobs_busy(self) -> None:
        """No job queue."""
        return

    async def inject(self, request: ReadRequest) -> Injection:
        """Nothing to inject."""
        return Injection()

    def carried(self, request: ReadRequest) -> Injection:
        """Nothing carried."""
        return Injection()

    async def record(self, exchange: Exchange) -> None:
        """Nothing to store."""
