"""The MCP server's tools over the management seam: what an agent may read and change of one user's memory.

- ``search_memories(query, limit)``: the memories the proxy finds for ``query`` (the chat's own retrieval), best
  first, without those past their ``expires_at``;
- ``add_memory(text, expires_at?)``: a fact taken the way the write path takes an extracted one (screens,
  reconcile, subjects: ``proxy.memory.write.stated``); the user's next chat can carry it;
- ``delete_memory(id)``: one memory gone for good (never injected again);
- ``list_memories(limit)``: the user's current facts, newest first;
- ``get_profile()``: the user's facts and insights in one answer.

Every tool acts for the one user the HTTP request names (``proxy.mcp.server``); no tool takes a user argument.
Tools answer structured JSON; a refusal is a tool error naming the reason.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any

import mcp.types as types
from mcp.server.lowlevel import Server

from proxy.memory import MemoryAdmin, MemoryService
from proxy.memory.store import Kind, MemoryRecord, newest_generation, utcnow

USER_KEY = "memproxy_user"  # where the shell puts the request's user in the ASGI scope's state

_TEXT = {"type": "string", "minLength": 1, "maxLength": 4000}
_EXPIRES = {"type": "string", "format": "date-time", "description": "RFC 3339; never injected after it"}
TOOLS = (
    types.Tool(
        name="search_memories",
        description="Search what memproxy remembers about the user: the memories a chat would be given, best first.",
        inputSchema={
            "type": "object",
            "properties": {"query": _TEXT, "limit": {"type": "integer", "minimum": 1, "maximum": 50, "default": 10}},
            "required": ["query"],
        },
    ),
    types.Tool(
        name="add_memory",
        description="Remember a fact about the user (screened and reconciled with what is already known).",
        inputSchema={
            "type": "object",
            "properties": {"text": _TEXT, "expires_at": _EXPIRES},
            "required": ["text"],
        },
    ),
    types.Tool(
        name="delete_memory",
        description="Forget one memory of the user for good, by its id.",
        inputSchema={
            "type": "object",
            "properties": {"id": {"type": "string", "minLength": 1, "maxLength": 128}},
            "required": ["id"],
        },
    ),
    types.Tool(
        name="list_memories",
        description="The user's current facts, newest first.",
        inputSchema={
            "type": "object",
            "properties": {"limit": {"type": "integer", "minimum": 1, "maximum": 200, "default": 50}},
        },
    ),
    types.Tool(
        name="get_profile",
        description="What memproxy knows about the user: their facts and the insights drawn from their chats.",
        inputSchema={"type": "object", "properties": {}},
    ),
)


class ToolRefused(Exception):
    """A tool call that cannot be done; the message is the tool error the agent sees."""


def memory_dict(record: MemoryRecord) -> dict[str, Any]:
    """A memory as the tools show it."""
    return {
        "id": record.id,
        "kind": str(record.kind),
        "text": record.text,
        "created_at": record.created_at.isoformat(),
        "expires_at": record.expires_at.isoformat() if record.expires_at is not None else None,
    }


def _live(record: MemoryRecord, now: datetime) -> bool:
    return record.valid and record.flagged is None and (record.expires_at is None or record.expires_at > now)


def _expired(row: Mapping[str, Any], now: datetime) -> bool:
    expires = row.get("expires_at")
    return expires is not None and datetime.fromisoformat(str(expires)) <= now


def _expiry(raw: Any) -> datetime | None:
    if raw is None:
        return None
    try:
        parsed = datetime.fromisoformat(str(raw).replace("Z", "+00:00"))
    except ValueError:
        raise ToolRefused("expires_at: not an RFC 3339 date-time") from None
    return parsed.replace(tzinfo=UTC) if parsed.tzinfo is None else parsed.astimezone(UTC)


class MemoryTools:
    """The tools of one memory service (read when each call comes: it opens after the routes are built)."""

    def __init__(self, memory: Callable[[], MemoryService]) -> None:
        self._memory = memory

    def _admin(self) -> MemoryAdmin:
        admin = self._memory().admin
        if admin is None:
            raise ToolRefused("memory is disabled or not available on this server")
        return admin

    async def call(self, name: str, user_id: str, arguments: Mapping[str, Any]) -> dict[str, Any]:
        """Run tool ``name`` for ``user_id``."""
        tool = getattr(self, f"_{name}", None)
        if name not in {t.name for t in TOOLS} or tool is None:
            raise ToolRefused(f"no tool named {name!r}")
        result: dict[str, Any] = await tool(user_id, arguments)
        return result

    async def _search_memories(self, user_id: str, arguments: Mapping[str, Any]) -> dict[str, Any]:
        limit = int(arguments.get("limit", 10))
        preview = await self._admin().search(user_id, str(arguments["query"]), min(50, limit * 2))
        now = utcnow()
        rows = [row for row in preview.results if not row.get("flagged") and not _expired(row, now)]
        keys = ("id", "kind", "text", "created_at", "expires_at", "score")
        return {"memories": [{key: row.get(key) for key in keys} for row in rows[:limit]]}

    async def _add_memory(self, user_id: str, arguments: Mapping[str, Any]) -> dict[str, Any]:
        stated = await self._admin().remember(user_id, str(arguments["text"]), _expiry(arguments.get("expires_at")))
        if stated.record is None:
            raise ToolRefused(f"not stored: {stated.reason or stated.outcome}")
        return {"outcome": stated.outcome, "memory": memory_dict(stated.record)}

    async def _delete_memory(self, user_id: str, arguments: Mapping[str, Any]) -> dict[str, Any]:
        record_id = str(arguments["id"])
        if not await self._admin().delete(user_id, record_id):
            raise ToolRefused(f"no memory {record_id[:128]!r} for this user")
        return {"id": record_id, "deleted": True}

    async def _list_memories(self, user_id: str, arguments: Mapping[str, Any]) -> dict[str, Any]:
        page = await self._admin().list_memories(user_id, [Kind.FACT], limit=int(arguments.get("limit", 50)))
        now = utcnow()
        return {"memories": [memory_dict(r) for r in page.data if _live(r, now)]}

    async def _get_profile(self, user_id: str, arguments: Mapping[str, Any]) -> dict[str, Any]:
        admin, now = self._admin(), utcnow()
        facts = await admin.list_memories(user_id, [Kind.FACT], limit=200)
        insights = await admin.list_memories(user_id, [Kind.INSIGHT], limit=50)
        return {
            "user": user_id,
            "facts": [memory_dict(r) for r in facts.data if _live(r, now)],
            "insights": [memory_dict(r) for r in newest_generation(insights.data)],
        }


def build_server(tools: MemoryTools, version: str) -> Server[Any, Any]:
    """The MCP server (the SDK's low-level one) whose tools are ``tools``, for the user each request names."""
    server: Server[Any, Any] = Server("memproxy", version=version)

    async def list_tools() -> list[types.Tool]:
        return list(TOOLS)

    async def call_tool(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
        request = server.request_context.request
        user_id = str(request.scope["state"][USER_KEY]) if request is not None else ""
        if not user_id:
            raise ToolRefused("no user: send the header X-Memory-User on the MCP connection")
        return await tools.call(name, user_id, arguments)

    server.list_tools()(list_tools)  # type: ignore[no-untyped-call]
    server.call_tool()(call_tool)
    return server
