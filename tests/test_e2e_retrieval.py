"""End to end through the real CLI (issue 12): retrieval under real time, and subjects from a normal exchange.

The chat goes to the fake upstream process; the memory-side model (extraction, reconciliation) is a scripted
fake in this test's event loop, so the facts are known; embeddings, LanceDB and Tantivy are the real ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import urllib.request
from collections.abc import AsyncIterator, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import openai
import pytest
import pytest_asyncio

from proxy.memory.embedders.factory import build_embedder
from proxy.memory.embedders.settings import EmbedderSettings
from proxy.memory.store.memory_store import MemoryStore, StoreSettings
from proxy.memory.store.records import Kind, utcnow
from tests.support.fake_llm import DEFAULTS, FakeLLM, fact, facts, user_payload
from tests.support.processes import fake_upstream_process, memproxy_process
from tests.test_answered_stored import wait_for_drain

pytestmark = pytest.mark.e2e

ADMIN_KEY = "sk-admin-e2e-retrieval"
LOCKER = [f"My locker code word number {i} is zebra{i}x." for i in range(12)]
LONDON = "I live in London, near the river."
PARIS = "I moved from London to Paris last week."
SAM = "My friend Sam Okafor is training for the Lisbon marathon."
# Other things the user told in the same weeks (a user has more history than the one fact under test).
HISTORY = {
    "I work as a nurse on night shifts.": "User works as a nurse on night shifts.",
    "I play the cello in an amateur orchestra.": "User plays the cello in an amateur orchestra.",
    "My favourite food is ramen.": "User's favourite food is ramen.",
    "I have a cat called Miso.": "User has a cat called Miso.",
    "I am learning Portuguese on weekends.": "User is learning Portuguese on weekends.",
    "I drive an old green Volvo.": "User drives an old green Volvo.",
    "My parents live in a small village by the sea.": "User's parents live in a small village by the sea.",
}
# What the scripted extraction model answers for each user message.
EXTRACTED = {
    **{text: fact(f"User's locker code word number {i} is zebra{i}x.", category="possession")
       for i, text in enumerate(LOCKER)},
    LONDON: fact("User lives in London.", category="location", entities=["London"]),
    PARIS: fact("User lives in Paris.", category="location",
                entities=["Paris", "London"]),
    **{said: fact(text) for said, text in HISTORY.items()},
    SAM: fact("User's friend Sam Okafor is training for the Lisbon marathon.", category="relationship",
              entities=["Sam Okafor", "Lisbon"]),
}  # fmt: skip


def _extraction(name: str, body: dict[str, Any]) -> Any:
    """The scripted memory-side model: the fact of the user's message; reconciliation always adds."""
    if name == "memory_facts":  # a window of exchanges: each known message's fact, naming its exchange
        said = [(item["n"], text) for item in user_payload(body)["exchanges"] for text in item["user"]]
        return facts(*({**EXTRACTED[text], "exchange": n} for n, text in said if text in EXTRACTED))
    return DEFAULTS.get(name, {})


@pytest.fixture(scope="module")
def upstream() -> Iterator[str]:
    """The fake chat upstream for the module."""
    with fake_upstream_process() as (_, url):
        yield url


@pytest_asyncio.fixture
async def memory_llm() -> AsyncIterator[FakeLLM]:
    """The scripted memory-side model, served from this test's event loop."""
    async with FakeLLM(_extraction) as llm:
        yield llm


def _env(upstream: str, llm: FakeLLM, data: Path) -> dict[str, str]:
    return {"MEMPROXY_UPSTREAM__BASE_URL": upstream, "MEMPROXY_UPSTREAM__API_KEY": "sk-upstream-e2e",
            "MEMPROXY_MEMORY_LLM__BASE_URL": llm.base_url, "MEMPROXY_STORAGE__PATH": str(data),
            "MEMPROXY_ADMIN__API_KEY": ADMIN_KEY, "MEMPROXY_WRITER__FACTS_WINDOW_WAIT_S": "1",
            # behaviour, not speed, is under test here (the machine is shared; benchmarks measure speed)
            "MEMPROXY_MEMORY__RETRIEVAL_TIMEOUT_MS": "20000", "MEMPROXY_RETRIEVAL__ARM_TIMEOUT_MS": "20000",
            "MEMPROXY_MEMORY__READ_QUEUE_MS": "20000"}  # fmt: skip


@contextlib.asynccontextmanager
async def _proxy(env: dict[str, str]) -> AsyncIterator[tuple[str, openai.AsyncOpenAI]]:
    """``memproxy serve`` with ``env``, and an openai client of it (closed before the process stops)."""
    with memproxy_process(env) as (_, url):
        async with openai.AsyncOpenAI(base_url=url, api_key="sk-client", max_retries=0) as client:
            yield url, client


async def _say(client: openai.AsyncOpenAI, text: str, user: str, conversation: str) -> list[str]:
    """One chat turn through the proxy; the ids of the memories it injected, in block order."""
    raw = await client.chat.completions.with_raw_response.create(
        model="fake-echo", messages=[{"role": "user", "content": text}],
        extra_headers={"X-Memory-User": user, "X-Memory-Conversation": conversation},
    )  # fmt: skip
    ids = raw.headers.get("X-Memory-Ids", "")
    return [i for i in ids.split(",") if i]


def _admin(url: str, path: str) -> Any:
    """GET a management API path (JSON)."""
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    request = urllib.request.Request(url.removesuffix("/v1") + path, headers=headers)  # noqa: S310 - 127.0.0.1
    with urllib.request.urlopen(request, timeout=30) as response:  # noqa: S310 - 127.0.0.1 only
        return json.loads(response.read())


async def _memories(url: str, user: str, kind: str) -> list[dict[str, Any]]:
    """Every memory of one kind of the user, through the management API."""
    page = await asyncio.to_thread(_admin, url, f"/v1/memory/users/{user}/memories?kind={kind}&limit=200")
    return list(page["data"])


async def _facts_stored(url: str, user: str, count: int) -> list[dict[str, Any]]:
    """Wait until the user has ``count`` valid facts (the write path runs after each reply)."""
    for _ in range(600):
        found = [m for m in await _memories(url, user, "fact") if m["valid"]]
        if len(found) >= count:
            return found
        await asyncio.sleep(0.1)
    raise AssertionError(f"{count} facts were not stored")


async def _age(user: str, data: Path, by: timedelta) -> None:
    """Move every memory of the user ``by`` into the past, in the store's own timestamps (proxy stopped)."""
    async with build_embedder(EmbedderSettings()) as embedder, MemoryStore(StoreSettings(path=data), embedder) as store:
        page = await store.list(user, None, limit=100)
        for record in page.data:
            await store.update(user, record.id, created_at=record.created_at - by)


async def test_the_asked_one_of_twelve_near_identical_facts_is_injected(
    upstream: str, memory_llm: FakeLLM, tmp_path: Path
) -> None:
    """Twelve locker code words told one after the other: asking for number 0 injects number 0, not the newest."""
    async with _proxy(_env(upstream, memory_llm, tmp_path)) as (url, client):
        for text in LOCKER:
            await _say(client, text, "lena", "telling")
        stored = await _facts_stored(url, "lena", len(LOCKER))
        injected = await _say(client, "What is locker code word number 0?", "lena", "asking")
    text_of = {m["id"]: m["text"] for m in stored}
    facts_injected = [text_of[i] for i in injected if i in text_of]
    assert "User's locker code word number 0 is zebra0x." in facts_injected
    assert facts_injected[0] == "User's locker code word number 0 is zebra0x."


async def test_a_fact_changed_weeks_later_wins_over_the_old_one(
    upstream: str, memory_llm: FakeLLM, tmp_path: Path
) -> None:
    """Told "I live in London" (among other things) five weeks ago and "I moved from London to Paris" now,
    "where do I live?" puts Paris first in the block."""
    async with _proxy(_env(upstream, memory_llm, tmp_path)) as (url, client):
        for said in [LONDON, *HISTORY]:
            await _say(client, said, "omar", "spring")
        stored = await _facts_stored(url, "omar", 1 + len(HISTORY))
        london = next(m for m in stored if "London" in m["text"])
    # Five weeks pass: the store's own timestamps of what was told then are moved back (the proxy is stopped).
    await _age("omar", tmp_path, timedelta(weeks=5))
    async with _proxy(_env(upstream, memory_llm, tmp_path)) as (url, client):
        await _say(client, PARIS, "omar", "summer")
        stored = await _facts_stored(url, "omar", 2 + len(HISTORY))
        # a user not in the read cache lists a fact once LanceDB holds it, a moment before the keyword index has it:
        await wait_for_drain(url, within_s=60.0)  # ranked once every arm has it, not on the dense arm's word only
        injected = await _say(client, "Where do I live?", "omar", "later")
    paris = next(m for m in stored if "Paris" in m["text"])
    assert london["id"] in {m["id"] for m in stored}  # both facts stand: the ranking, not a deletion, decides
    assert paris["id"] in injected
    assert london["id"] not in injected or injected.index(paris["id"]) < injected.index(london["id"])


async def test_a_normal_exchange_creates_subjects_linked_to_their_facts(
    upstream: str, memory_llm: FakeLLM, tmp_path: Path
) -> None:
    """A fact naming a person and a place creates one subject record each, linked to that fact, and asking
    about the person by name injects the fact."""
    async with _proxy(_env(upstream, memory_llm, tmp_path)) as (url, client):
        await _say(client, SAM, "pia", "first")
        [told] = await _facts_stored(url, "pia", 1)
        subjects: list[dict[str, Any]] = []
        for _ in range(100):
            subjects = await _memories(url, "pia", str(Kind.SUBJECT))
            if len(subjects) >= 2:
                break
            await asyncio.sleep(0.1)
        injected = await _say(client, "How is Sam Okafor doing?", "pia", "second")
    by_name = {s["text"]: s for s in subjects}
    assert set(by_name) == {"Sam Okafor", "Lisbon"}
    assert by_name["Sam Okafor"]["source_ids"] == [told["id"]]
    assert by_name["Sam Okafor"]["subject_kind"] == "person"
    assert told["id"] in injected
    assert utcnow().year >= 2024  # the records carry real dates (sanity of the clock the test relies on)
