"""The README quick start, end to end: the real CLI, the real openai SDK, a fake hosted API that wants a key.

The proxy gets the quick start's configuration and nothing more about keys or models: the upstream URL (plus
the admin key the README gives for the management API, and the test's clock: a summary after 1 s of quiet, an
insight schedule of seconds instead of a week). The app sends its own key, as the README shows.
"""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.support.hosted_upstream import HostedUpstream, hosted_upstream
from tests.support.insight_scenario import TOPICS
from tests.support.processes import Process, memproxy_process

pytestmark = pytest.mark.e2e

ADMIN = "admin-quickstart"
APP_KEY = "sk-app-own-key-0123456789"
FEATURES = ("retrieval", "turns", "facts", "summaries", "insights")
TEST_CLOCK = {
    "MEMPROXY_WRITER__SUMMARY_IDLE_S": "1",
    "MEMPROXY_WRITER__SUMMARY_MIN_TURNS": "2",
    "MEMPROXY_WRITER__FACTS_WINDOW_WAIT_S": "1",
    "MEMPROXY_INSIGHTS__SCHEDULE_CHECK_S": "1",
    "MEMPROXY_INSIGHTS__SCHEDULE_INTERVAL_S": "4",
    # behaviour, not speed, is under test (the machine is shared; benchmarks measure speed)
    "MEMPROXY_MEMORY__RETRIEVAL_TIMEOUT_MS": "20000",
    "MEMPROXY_RETRIEVAL__ARM_TIMEOUT_MS": "20000",
    "MEMPROXY_MEMORY__READ_QUEUE_MS": "20000",
}


def quick_start_env(upstream: str) -> dict[str, str]:
    """The README quick start's environment (upstream URL and admin key) and the test's clock."""
    return {"MEMPROXY_UPSTREAM__BASE_URL": upstream, "MEMPROXY_ADMIN__API_KEY": ADMIN, **TEST_CLOCK}


def call(url: str, path: str, method: str = "GET") -> tuple[int, Any]:
    """An admin call to the proxy at ``url`` (ending in /v1 or not); (status, JSON body)."""
    base = url.removesuffix("/v1")
    request = urllib.request.Request(  # noqa: S310 - 127.0.0.1 only
        base + path,
        method=method,
        headers={"Authorization": f"Bearer {ADMIN}"},
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:  # noqa: S310
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"null")


def eventually(check: Callable[[], Any], within_s: float = 120.0, proc: Process | None = None) -> Any:
    """``check()``'s first truthy value, polled; fails after ``within_s`` (with ``proc``'s job log lines)."""
    deadline = time.monotonic() + within_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            lines = [line for line in (proc.lines if proc else []) if '"job.' in line or "insights" in line]
            raise AssertionError("condition not reached in time; log:\n" + "\n".join(lines[-30:]))
        time.sleep(0.2)


def memories(url: str, user: str, kind: str) -> list[dict[str, Any]]:
    """The user's memories of one kind, via the management API."""
    status, body = call(url, f"/v1/memory/users/{user}/memories?kind={kind}&limit=500")
    assert status == 200
    return list(body["data"])


def insight_runs(proc: Process, reason: str) -> list[int]:
    """How many insights each finished run of ``reason`` produced, from the log."""
    runs = []
    for line in proc.lines:
        if '"insights.ran"' in line and f'"reason": "{reason}"' in line.replace('":"', '": "'):
            runs.append(int(json.loads(line)["insights"]))
    return runs


def feature_lines(proc: Process) -> dict[str, dict[str, Any]]:
    """The start-up ``memory.feature`` lines by feature."""
    found = {}
    for line in proc.lines:
        if re.search(r'"event":\s*"memory.feature"', line):
            event = json.loads(line)
            found.setdefault(event["feature"], event)
    return found


def chat(client: openai.OpenAI, text: str, user: str, conversation: str) -> None:
    """One chat as the README shows it."""
    reply = client.chat.completions.create(
        model="gpt-4o-mini",
        messages=[{"role": "user", "content": text}],
        extra_headers={"X-Memory-User": user, "X-Memory-Conversation": conversation},
    )
    assert reply.choices[0].message.content == f"echo: {text}"


def test_quick_start_makes_facts_a_summary_and_insights(tmp_path: Path) -> None:
    """Only the upstream URL set, the app's own key: facts, a summary, insights on schedule and on demand."""
    with hosted_upstream() as fake, memproxy_process(quick_start_env(fake.base_url), cwd=tmp_path) as (proc, url):
        status, ready = call(url, "/readyz")
        assert status == 200
        assert {name: ready["features"][name]["live"] for name in FEATURES} == dict.fromkeys(FEATURES, True)
        assert {name: event["live"] for name, event in feature_lines(proc).items()} == dict.fromkeys(FEATURES, True)
        client = openai.OpenAI(base_url=url, api_key=APP_KEY, max_retries=0)
        chat(client, "Remember that I'm vegetarian.", "alice", "food")
        for topic in TOPICS:
            for text in topic.messages:
                chat(client, text, "alice", topic.name)
        eventually(lambda: any("vegetarian" in m["text"] for m in memories(url, "alice", "fact")))
        eventually(lambda: memories(url, "alice", "summary"))
        eventually(lambda: len(memories(url, "alice", "turn")) >= 2 * (1 + sum(len(t.messages) for t in TOPICS)))
        # a scheduled run that started while turns were still being stored saw too few: activity since it
        # makes the user due again on the next schedule
        chat(client, "My sourdough starter finally doubled overnight!", "alice", "sourdough")
        eventually(lambda: any(insight_runs(proc, "schedule")), within_s=180, proc=proc)
        _check_insights(url, fake)
        before = {i["id"] for i in call(url, "/v1/memory/users/alice/insights")[1]["data"]}
        assert call(url, "/v1/memory/users/alice/insights/regenerate", "POST")[0] == 202
        eventually(lambda: any(insight_runs(proc, "manual")), within_s=180, proc=proc)
        after = {i["id"] for i in call(url, "/v1/memory/users/alice/insights")[1]["data"]}
        assert after
        assert after.isdisjoint(before)
        _check_keys_stay_in_memory(fake, proc, tmp_path)
        status, ready = call(url, "/readyz")
        assert {name: ready["features"][name]["live"] for name in FEATURES} == dict.fromkeys(FEATURES, True)


def _check_insights(url: str, fake: HostedUpstream) -> None:
    status, body = call(url, "/v1/memory/users/alice/insights")
    assert status == 200
    texts = " ".join(item["text"] for item in body["data"])
    assert "sourdough" in texts
    assert all(0 < item["confidence"] <= 1 and item["date_range"]["start"] for item in body["data"])
    assert {m["model"] for m in fake.structured_calls} == {"gpt-4o-mini"}  # the chat's own model


def _check_keys_stay_in_memory(fake: HostedUpstream, proc: Process, data: Path) -> None:
    for schema in ("memory_facts", "memory_summary", "memory_insight"):
        keys = fake.memory_keys(schema)
        assert keys
        assert set(keys) == {APP_KEY}
    assert APP_KEY not in proc.output
    assert [p for p in data.rglob("*") if p.is_file() and APP_KEY.encode() in p.read_bytes()] == []


def metric(url: str, line_start: str) -> float | None:
    """The value of the first /metrics line starting with ``line_start``."""
    with urllib.request.urlopen(url.removesuffix("/v1") + "/metrics", timeout=30) as response:  # noqa: S310
        for line in response.read().decode().splitlines():
            if line.startswith(line_start):
                return float(line.rsplit(" ", 1)[1])
    return None


def test_memory_calls_impossible_are_named_and_jobs_wait(tmp_path: Path) -> None:
    """Memory-side calls to an upstream that rejects every key: start-up log and /readyz say which features are
    off and why, /metrics counts the waiting jobs, and nothing is dead-lettered."""
    with hosted_upstream() as chat_api, hosted_upstream(keys=set()) as memory_api:
        env = {
            **quick_start_env(chat_api.base_url),
            "MEMPROXY_MEMORY_LLM__BASE_URL": memory_api.base_url,
            "MEMPROXY_MEMORY_LLM__API_KEY": "sk-memory-revoked-000",
        }
        with memproxy_process(env, cwd=tmp_path) as (proc, url):
            lines = feature_lines(proc)
            assert {name: lines[name]["live"] for name in FEATURES} == {
                "retrieval": True,
                "turns": True,
                "facts": False,
                "summaries": False,
                "insights": False,
            }
            assert "rejects the configured memory key (HTTP 401 on GET /models)" in lines["facts"]["reason"]
            status, ready = call(url, "/readyz")
            assert status == 200
            assert ready["status"] == "ready"
            assert ready["features"]["insights"]["live"] is False
            assert "401" in ready["features"]["insights"]["reason"]
            client = openai.OpenAI(base_url=url, api_key=APP_KEY, max_retries=0)
            chat(client, "Remember that I'm vegetarian.", "alice", "food")
            # the facts and the summary of the exchange wait
            eventually(lambda: metric(url, 'memproxy_jobs_waiting{reason="key_rejected"}') == 2, proc=proc)
            assert metric(url, "memproxy_jobs_dead_letters ") == 0
            assert metric(url, 'memproxy_memory_feature_live{feature="facts"}') == 0
            assert metric(url, 'memproxy_memory_feature_live{feature="turns"}') == 1
            assert memories(url, "alice", "turn")  # the chat and its turns are unharmed
            assert '"job.dead"' not in proc.output
            assert APP_KEY not in {key for _, key, _ in memory_api.calls}  # the app's key never went elsewhere


def test_a_tool_calling_exchange_is_stored_and_found(tmp_path: Path) -> None:
    """Through the proxy with the openai SDK: the tool call and the tool's result are turns, found by search."""
    tools: Any = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    with hosted_upstream() as fake, memproxy_process(quick_start_env(fake.base_url), cwd=tmp_path) as (_, url):
        client = openai.OpenAI(base_url=url, api_key=APP_KEY, max_retries=0)
        headers = {"X-Memory-User": "bob", "X-Memory-Conversation": "trip"}
        asked: Any = [{"role": "user", "content": "I fly to Paris tonight: what's the weather there?"}]
        first = client.chat.completions.create(model="fake-tools", messages=asked, tools=tools, extra_headers=headers)
        [call] = first.choices[0].message.tool_calls or []
        answered = [
            *asked,
            first.choices[0].message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "sunny", "temp_c": 18}'},
        ]
        client.chat.completions.create(model="gpt-4o-mini", messages=answered, tools=tools, extra_headers=headers)
        wanted = {
            ("assistant", 'tool call get_weather({"city": "Paris"})'),
            ("tool", 'tool result get_weather: {"sky": "sunny", "temp_c": 18}'),
        }
        eventually(lambda: wanted <= {(m["role"], m["text"]) for m in memories(url, "bob", "turn")})
        request = urllib.request.Request(  # noqa: S310
            url.removesuffix("/v1") + "/v1/memory/users/bob/search",
            method="POST",
            data=json.dumps({"query": "was it sunny in Paris"}).encode(),
            headers={"Authorization": f"Bearer {ADMIN}", "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=30) as response:  # noqa: S310
            found = [row["text"] for row in json.loads(response.read())["results"]]
        assert 'tool result get_weather: {"sky": "sunny", "temp_c": 18}' in found

        def said() -> list[str]:  # what the window extraction calls were given as the user's words
            return [
                text
                for body in fake.structured_calls
                if '"exchanges"' in body["messages"][-1]["content"]
                for item in json.loads(body["messages"][-1]["content"])["exchanges"]
                for text in item["user"]
            ]

        eventually(lambda: said())
        assert said() == ["I fly to Paris tonight: what's the weather there?"]  # facts only from the user's own words
