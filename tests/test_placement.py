"""Placement of the memory block (``proxy.memory.read.placement``): the cached placement keeps every earlier
forwarded request a prefix of the next, and the dialects write a plan without touching the app's own parts."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

from proxy.dialects import CHAT, MESSAGES, RESPONSES
from proxy.memory.read.block import MemoryItem, Section
from proxy.memory.read.placement import (
    BlockPlan,
    CachedBudgets,
    ConversationLedger,
    ConversationMemory,
    Placement,
    TurnBlock,
    plan_cached,
    plan_simple,
)

BUDGETS = CachedBudgets(turn=200, conversation=3000)


def item(n: int, score: float = 1.0) -> MemoryItem:
    """A memory line."""
    return MemoryItem(f"m{n}", Section.PAST, f"memory number {n} about topic {n}", "May 2025", score)


def forwarded(messages: list[dict[str, Any]], plan: BlockPlan) -> str:
    """The forwarded chat request as text."""
    body = CHAT.apply({"model": "m", "messages": messages}, CHAT.view({"messages": messages}), plan)
    return json.dumps(body["messages"])


def chat_turns(count: int) -> list[list[dict[str, Any]]]:
    """A growing chat: the messages of each of ``count`` requests."""
    history: list[dict[str, Any]] = [{"role": "system", "content": "Be kind."}]
    requests = []
    for n in range(count):
        requests.append([*history, {"role": "user", "content": f"question {n}"}])
        history += [{"role": "user", "content": f"question {n}"}, {"role": "assistant", "content": f"answer {n}"}]
    return requests


def test_cached_placement_keeps_each_request_a_prefix_of_the_next() -> None:
    """Every forwarded request, up to its last user message, is the byte prefix of the next one."""
    entry: ConversationMemory | None = None
    previous = None
    for n, messages in enumerate(chat_turns(8)):
        planned = plan_cached(messages, [item(n), item(n + 100, 0.5)], entry, BUDGETS)
        entry = planned.entry or entry
        text = forwarded(messages, planned.plan)
        if previous is not None:
            cut = previous.rindex('{"role": "user"')
            assert text.startswith(previous[:cut])
        previous = text


def test_first_request_puts_the_block_in_the_system_prompt_and_it_stays() -> None:
    """The stable part is the first request's block, unchanged by later retrievals."""
    first, second = chat_turns(2)
    planned = plan_cached(first, [item(1)], None, BUDGETS)
    assert "memory number 1" in planned.plan.system
    assert planned.entry is not None
    later = plan_cached(second, [item(2)], planned.entry, BUDGETS)
    assert later.plan.system == planned.plan.system
    assert [t.index for t in later.plan.turns] == [len(second) - 1]
    assert "memory number 2" in later.plan.turns[0].text


def test_items_already_carried_are_not_repeated() -> None:
    """A memory the conversation carries is not added again; it still counts as carried, first in the ids."""
    first, second = chat_turns(2)
    planned = plan_cached(first, [item(1)], None, BUDGETS)
    later = plan_cached(second, [item(1)], planned.entry, BUDGETS)
    assert later.plan.turns == ()
    assert later.carried == ("m1",)
    assert later.entry is None


def test_an_edited_history_drops_the_parts_it_moved() -> None:
    """A turn part whose user message changed is not attached to another message."""
    first, second, third = chat_turns(3)
    entry = plan_cached(first, [item(1)], None, BUDGETS).entry
    entry = plan_cached(second, [item(2)], entry, BUDGETS).entry
    assert entry is not None
    third[len(second) - 1] = {"role": "user", "content": "an edited question"}
    later = plan_cached(third, [], entry, BUDGETS)
    assert later.plan.turns == ()


def test_the_conversation_budget_bounds_what_is_added() -> None:
    """Past the conversation's budget nothing more is attached."""
    first, second = chat_turns(2)
    entry = plan_cached(first, [item(1)], None, CachedBudgets(turn=200, conversation=10)).entry
    later = plan_cached(second, [item(2)], entry, CachedBudgets(turn=200, conversation=10))
    assert later.plan.turns == ()


def test_provider_held_history_gets_only_the_new_part() -> None:
    """A Responses request continuing ``previous_response_id`` gets the stable part and only its new turn part."""
    first, second = chat_turns(2)
    entry = plan_cached(first, [item(1)], None, BUDGETS).entry
    entry = plan_cached(second, [item(2)], entry, BUDGETS).entry
    only_new = [{"role": "user", "content": "question 2"}]
    planned = plan_cached(only_new, [item(3)], entry, BUDGETS, provider_holds_history=True)
    assert [t.index for t in planned.plan.turns] == [0]
    assert "memory number 3" in planned.plan.turns[0].text
    assert planned.plan.system


def test_simple_placements() -> None:
    """``system`` puts the whole block in the system prompt, ``user`` on the latest user message."""
    [messages] = chat_turns(1)
    assert plan_simple(Placement.SYSTEM, messages, [item(1)]).plan.system
    user = plan_simple(Placement.USER, messages, [item(1)]).plan
    assert user.system == ""
    assert user.turns[0].index == len(messages) - 1


def test_ledger_is_bounded_in_bytes_and_forgets_users() -> None:
    """Least recently used conversations go past the byte bound; forgetting a user drops all of theirs."""
    ledger = ConversationLedger(max_bytes=3000)
    for n in range(10):
        ledger.put("u1", f"c{n}", ConversationMemory("x" * 500, ("m1",)))
    assert ledger.bytes <= 3000
    assert ledger.get("u1", "c9") is not None
    assert ledger.get("u1", "c0") is None
    ledger.put("u2", "c", ConversationMemory("y", ()))
    assert ledger.forget_user("u1") > 0
    assert ledger.get("u2", "c") is not None


def test_messages_dialect_keeps_cache_control_and_adds_blocks() -> None:
    """Anthropic: the app's system block and its ``cache_control`` stay; parts are added as text blocks."""
    system = [{"type": "text", "text": "Be kind.", "cache_control": {"type": "ephemeral"}}]
    body = {"model": "c", "max_tokens": 5, "system": system, "messages": [{"role": "user", "content": "hi"}]}
    view = MESSAGES.view(body)
    out = MESSAGES.apply(body, view, BlockPlan("SYSTEM PART", (TurnBlock(1, "TURN PART"),)))
    assert out["system"][0] == system[0]
    assert out["system"][1] == {"type": "text", "text": "SYSTEM PART"}
    assert out["messages"][0]["content"] == [{"type": "text", "text": "hi"}, {"type": "text", "text": "TURN PART"}]
    assert body["messages"][0]["content"] == "hi"


def test_responses_dialect_uses_instructions_and_input_items() -> None:
    """Responses: the system part follows ``instructions``; a turn part goes on its input message."""
    body = {"model": "g", "instructions": "Be kind.", "input": [{"role": "user", "content": "hi"}]}
    view = RESPONSES.view(body)
    assert view.messages == [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "hi"}]
    out = RESPONSES.apply(body, view, BlockPlan("SYSTEM PART", (TurnBlock(1, "TURN PART"),)))
    assert out["instructions"] == "Be kind.\n\nSYSTEM PART"
    assert out["input"][0]["content"] == "hi\n\nTURN PART"
    text = RESPONSES.apply({"model": "g", "input": "hi"}, RESPONSES.view({"model": "g", "input": "hi"}),
                           BlockPlan("", (TurnBlock(0, "P"),)))  # fmt: skip
    assert text["input"] == "hi\n\nP"


def test_responses_view_reads_tool_items() -> None:
    """``function_call`` / ``function_call_output`` items are tool calls and tool messages."""
    body = {"model": "g", "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "18C"},
    ]}  # fmt: skip
    messages = RESPONSES.view(body).messages
    assert messages[0] == {"role": "user", "content": "weather?"}
    assert messages[1]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert messages[2] == {"role": "tool", "tool_call_id": "c1", "content": "18C"}


def test_a_conversation_carrying_an_expiring_memory_knows_when_it_expires() -> None:
    """The entry remembers the earliest ``expires_at`` it carries (the engine starts a new stable part then)."""
    soon = datetime(2030, 1, 1, tzinfo=UTC)
    expiring = MemoryItem("m9", Section.ABOUT_USER, "a memory that expires", "May 2025", 1.0, expires_at=soon)
    [messages] = chat_turns(1)
    entry = plan_cached(messages, [item(1), expiring], None, BUDGETS).entry
    assert entry is not None
    assert entry.expires_at == soon
    assert not entry.expired(soon - timedelta(seconds=1))
    assert entry.expired(soon)
