"""Anthropic's Messages API answered by a chat-completions upstream (``proxy.dialects.translate``)."""

from __future__ import annotations

import json

from proxy.dialects.base import EventStream
from proxy.dialects.translate import StreamTranslator, to_chat, to_message
from tests.fake_upstream import chunk


def test_request_translation_covers_system_tools_and_results() -> None:
    """System, tool use, tool results, tools and tool choice become their chat-completion forms."""
    body = {
        "model": "gpt-x",
        "max_tokens": 20,
        "system": [{"type": "text", "text": "Be kind."}],
        "tools": [{"name": "get_weather", "description": "w", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "any"},
        "stop_sequences": ["END"],
        "messages": [
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_weather", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "18C"}]},
        ],
    }
    chat = to_chat(body)
    assert chat["messages"][0] == {"role": "system", "content": "Be kind."}
    assert chat["messages"][2]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": "{}"}
    assert chat["messages"][3] == {"role": "tool", "tool_call_id": "t1", "content": "18C"}
    assert chat["tools"][0]["function"]["parameters"] == {"type": "object"}
    assert chat["tool_choice"] == "required"
    assert chat["stop"] == ["END"]
    assert chat["max_tokens"] == 20


def test_completion_becomes_a_message_with_tool_use() -> None:
    """A chat completion's text and tool calls become text and tool_use blocks, finish reasons stop reasons."""
    completion = {
        "choices": [{"finish_reason": "tool_calls", "message": {"content": "ok", "tool_calls": [
            {"id": "c1", "function": {"name": "f", "arguments": '{"a": 1}'}}]}}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2},
    }  # fmt: skip
    message = to_message(completion, "gpt-x")
    assert message["content"] == [{"type": "text", "text": "ok"},
                                  {"type": "tool_use", "id": "c1", "name": "f", "input": {"a": 1}}]  # fmt: skip
    assert message["stop_reason"] == "tool_use"
    assert message["usage"] == {"input_tokens": 3, "output_tokens": 2}


def test_stream_translation_emits_anthropic_events_in_order() -> None:
    """Text and tool-call deltas become content blocks; the stream ends with message_delta and message_stop."""
    translator = StreamTranslator("gpt-x")
    chat = b"".join([
        chunk("gpt-x", {"role": "assistant", "content": "Hel"}),
        chunk("gpt-x", {"content": "lo"}),
        chunk("gpt-x", {"tool_calls": [{"index": 0, "id": "c1", "function": {"name": "f", "arguments": '{"a"'}}]}),
        chunk("gpt-x", {"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}),
        chunk("gpt-x", {}, "tool_calls"),
    ])  # fmt: skip
    out = translator.feed(chat) + translator.finish()
    events = EventStream().feed(out)
    kinds = [name for name, _ in events]
    assert kinds == ["message_start", "content_block_start", "content_block_delta", "content_block_delta",
                     "content_block_stop", "content_block_start", "content_block_delta", "content_block_delta",
                     "content_block_stop", "message_delta", "message_stop"]  # fmt: skip
    text = "".join(d["delta"].get("text", "") for n, d in events if n == "content_block_delta")
    arguments = "".join(d["delta"].get("partial_json", "") for n, d in events if n == "content_block_delta")
    assert text == "Hello"
    assert json.loads(arguments) == {"a": 1}
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"
