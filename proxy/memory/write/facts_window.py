"""The user's facts window: exchanges waiting for one extraction call, kept in the queue's per-user state.

Facts are extracted over a window of a user's exchanges, one model call per window. The window lives under
``WINDOW_KEY`` in the queue's per-user state; each function here returns the pure update that
``JobQueue.update_state`` applies in one transaction. A facts job marks the exchanges it takes with its job id
(``taken_by``), so that a retry takes the same ones, and removes them when it is done.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from proxy.memory.write.payloads import ExchangePayload
from proxy.memory.write.prefilter import asks_to_remember

WINDOW_KEY = "facts:window"
_MAX_ITEMS = 1000
State = dict[str, Any]
Update = Callable[[State | None], State]


def window_item(job_id: str, p: ExchangePayload, source_ids: Sequence[str], reply_chars: int) -> dict[str, Any]:
    """What the facts window keeps of one exchange (the reply cut to what extraction is shown)."""
    return {
        "job": job_id, "conversation_id": p.conversation_id, "model": p.model, "request_id": p.request_id,
        "user_messages": list(p.user_messages), "reply": p.reply[:reply_chars], "added_at": time.time(),
        "source_ids": list(source_ids), "remember": asks_to_remember(p.user_messages),
    }  # fmt: skip


def add_to_window(item: dict[str, Any]) -> Update:
    """Add one exchange to the window (once per job: a replayed exchange job adds nothing)."""

    def update(state: dict[str, Any] | None) -> dict[str, Any]:
        state = state or {"items": [], "jobs": []}
        if item["job"] not in state["jobs"]:
            state["items"] = [*state["items"], item][-_MAX_ITEMS:]
            state["jobs"] = [*state["jobs"], item["job"]][-200:]
        return state

    return update


def take_window(job_id: str, size: int) -> Update:
    """Mark the oldest ``size`` exchanges no job has taken as taken by ``job_id`` (a retry finds its own)."""

    def update(state: dict[str, Any] | None) -> dict[str, Any]:
        state = state or {"items": [], "jobs": []}
        free = size - sum(1 for item in state["items"] if item.get("taken_by") == job_id)
        items = []
        for item in state["items"]:
            if free > 0 and not item.get("taken_by"):
                item, free = {**item, "taken_by": job_id}, free - 1
            items.append(item)
        return {**state, "items": items}

    return update


def done_with_window(job_id: str) -> Update:
    """Remove the exchanges ``job_id`` took (its facts are stored)."""

    def update(state: dict[str, Any] | None) -> dict[str, Any]:
        state = state or {"items": [], "jobs": []}
        return {**state, "items": [item for item in state["items"] if item.get("taken_by") != job_id]}

    return update


def untaken(state: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    """The window's exchanges that no facts job has taken yet."""
    return [item for item in (state or {}).get("items", []) if not item.get("taken_by")]
