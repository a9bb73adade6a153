"""The turns an exchange adds after the user's own messages: tool results, the reply, the reply's tool calls.

The texts come already bounded from the HTTP shell (``proxy.tool_history``); here they get their roles and
order: the request's tool results (role ``tool``: what the app's tools returned since the last reply), then
the assistant's text (marked partial when cut short), then the tool calls it made (role ``assistant``).
"""

from __future__ import annotations

from collections.abc import Sequence


def tool_turn_texts(
    tool_results: Sequence[str], reply: str, partial: bool, tool_calls: Sequence[str]
) -> list[tuple[str, str, bool]]:
    """(role, text, partial) of each turn after the user's messages, in conversation order."""
    turns = [("tool", text, False) for text in tool_results if text.strip()]
    if reply.strip():
        turns.append(("assistant", reply, partial))
    turns += [("assistant", text, partial) for text in tool_calls if text.strip()]
    return turns
