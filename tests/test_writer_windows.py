"""What the write path spends on learning: facts over windows of exchanges, the pre-filter, summaries only for
conversations long enough, and reconciliation without a model call when nothing stored is near."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from proxy.memory.store.records import Kind
from tests.support.fake_llm import FakeLLM, decision, fact, facts, user_payload, window_user_messages
from tests.test_writer import Harness, running

FACTS = {
    "I have a dog named Rex": "The user has a dog named Rex",
    "My sister lives in Oslo": "The user's sister lives in Oslo",
    "I work night shifts as a nurse": "The user works night shifts as a nurse",
}


def window_facts(name: str, body: dict[str, Any]) -> Any:
    """One fact per known message, naming the exchange it came from; reconciliation: everything is new."""
    if name == "memory_facts":
        return facts(*[fact(FACTS[text], exchange=n) for n, text in window_user_messages(body) if text in FACTS])
    if name == "memory_reconcile_many":
        return {"decisions": []}
    if name == "memory_summary":
        return {"summary": "The user planned a trip to Rome.", "topics": ["travel"]}
    return decision("ADD")


async def wait_for(h: Harness, kind: Kind, count: int, within_s: float = 5.0) -> None:
    """Wait until the user has ``count`` records of ``kind``."""
    deadline = time.monotonic() + within_s
    while len(await h.records(kind)) < count:
        assert time.monotonic() < deadline, f"fewer than {count} {kind} records after {within_s} s"
        await asyncio.sleep(0.05)


async def test_a_window_of_exchanges_is_one_extraction_call(tmp_path: Path) -> None:
    """Four exchanges make one extraction call; each fact is sourced to the turn it came from; chatter is left out."""
    async with FakeLLM(window_facts) as llm, running(tmp_path, llm, facts_window_exchanges=3) as h:
        for text in ("I have a dog named Rex", "Thanks!", "My sister lives in Oslo", "I work night shifts as a nurse"):
            await h.chat(text, reply="Got it.")
        await h.settle()
        stored = {f.text: f.source_ids for f in await h.facts()}
        turns = {t.text: t.id for t in await h.records(Kind.TURN) if t.role == "user"}
    (call,) = llm.calls("memory_facts")
    assert [text for _, text in window_user_messages(call)] == list(FACTS)
    assert stored == {FACTS[text]: (turns[text],) for text in FACTS}


async def test_a_window_waits_at_most_its_wait(tmp_path: Path) -> None:
    """A lone exchange is extracted once the window's wait is over, without more exchanges arriving."""
    settings = {"facts_window_wait_s": 0.3, "facts_window_exchanges": 8}
    async with FakeLLM(window_facts) as llm, running(tmp_path, llm, **settings) as h:
        await h.chat("I have a dog named Rex")
        await wait_for(h, Kind.FACT, 1)
        assert [f.text for f in await h.facts()] == ["The user has a dog named Rex"]


async def test_exchanges_with_nothing_to_learn_cost_no_call(tmp_path: Path) -> None:
    """Tasks and acknowledgements are stored as turns but never sent to extraction."""
    async with FakeLLM(window_facts) as llm, running(tmp_path, llm) as h:
        for text in ("Write a haiku about autumn leaves", "Thanks!", "What is the capital of Australia?"):
            await h.chat(text)
        await h.settle()
        turns = await h.records(Kind.TURN)
        depth = (await h.queue.metrics()).depth_by_kind
    assert len(turns) == 6
    assert llm.calls("memory_facts") == []
    assert "facts" not in depth


async def test_short_conversations_get_no_summary(tmp_path: Path) -> None:
    """A one-exchange conversation is never summarised; a conversation of enough turns is."""
    async with FakeLLM(window_facts) as llm, running(tmp_path, llm, summary_min_turns=6, summary_idle_s=0.2) as h:
        await h.chat("Which wine goes with trout?", conversation="short")
        for text in ("Plan a trip to Rome", "Which month is best?", "Book a hotel near the Pantheon"):
            await h.chat(text, reply="Sure.", conversation="long")
        await wait_for(h, Kind.SUMMARY, 1)
        await asyncio.sleep(0.5)
        summaries = await h.records(Kind.SUMMARY)
    assert [s.conversation_id for s in summaries] == ["long"]
    assert len(llm.calls("memory_summary")) == 1


async def test_reconcile_needs_no_model_when_nothing_is_near(tmp_path: Path) -> None:
    """Unrelated facts are added without a reconciliation call; facts near stored ones share one call (a fact
    the model leaves out of its answer is added)."""
    async with FakeLLM(window_facts) as llm, running(tmp_path, llm, facts_window_exchanges=3) as h:
        for text in FACTS:
            await h.chat(text)
        await h.settle()
        assert len(await h.facts()) == 3
        assert llm.calls("memory_reconcile") == llm.calls("memory_reconcile_many") == []
        llm.script(
            "memory_facts",
            facts(fact("The user has a dog named Rex, a beagle", exchange=1),
                  fact("The user's sister lives in Oslo with her husband", exchange=2)),
        )  # fmt: skip
        update = {"fact": 1, **decision("UPDATE", 1, "The user has a beagle named Rex")}
        llm.script("memory_reconcile_many", {"decisions": [update]})
        for text in ("Rex is my beagle", "My sister and her husband live in Oslo", "I love that city"):
            await h.chat(text)
        await h.settle()
        current = sorted(f.text for f in await h.facts())
    (call,) = llm.calls("memory_reconcile_many")
    assert [item["text"] for item in user_payload(call)["new_facts"]] == [
        "The user has a dog named Rex, a beagle",
        "The user's sister lives in Oslo with her husband",
    ]
    assert llm.calls("memory_reconcile") == []
    assert current == sorted(
        ["The user has a beagle named Rex", "The user's sister lives in Oslo",
         "The user's sister lives in Oslo with her husband", "The user works night shifts as a nurse"]
    )  # fmt: skip


def item_facts(name: str, body: dict[str, Any]) -> Any:
    """One fact per "I own item number N" message, naming its exchange; everything is new."""
    if name == "memory_facts":
        found = window_user_messages(body)
        return facts(*[fact(text.replace("I own", "The user owns"), exchange=n) for n, text in found])
    if name == "memory_reconcile_many":
        return {"decisions": []}
    return decision("ADD")


async def test_many_exchanges_are_each_stored_once_and_searchable(tmp_path: Path) -> None:
    """A burst of 60 exchanges from 6 users: every turn stored once and found by keyword, every fact once, in
    windows (far fewer extraction calls than exchanges)."""
    settings = {"facts_window_exchanges": 5, "facts_window_wait_s": 1.0}
    async with FakeLLM(item_facts) as llm, running(tmp_path, llm, **settings) as h:
        chats = [h.chat(f"I own item number {n}", user=f"u{n % 6}", reply=f"Reply {n}") for n in range(60)]
        await asyncio.gather(*chats)
        await h.settle(within_s=60)
        deadline = time.monotonic() + 20
        while sum([len(await h.facts(f"u{u}")) for u in range(6)]) < 60:
            assert time.monotonic() < deadline, "facts missing"
            await asyncio.sleep(0.1)
        await h.settle(within_s=60)
        records = [r for u in range(6) for r in (await h.store.list(f"u{u}", limit=500, include_invalid=True)).data]
        found = [await h.store.keyword_search(f"u{n % 6}", f"item number {n}", 3, kinds=[Kind.TURN]) for n in range(60)]
    texts = sorted(r.text for r in records)
    assert texts == sorted(
        [f"I own item number {n}" for n in range(60)] + [f"Reply {n}" for n in range(60)]
        + [f"The user owns item number {n}" for n in range(60)]
    )  # fmt: skip
    assert all(any(hit.record.text == f"I own item number {n}" for hit in hits) for n, hits in enumerate(found))
    assert len(llm.calls("memory_facts")) <= 30  # windows of 5, cut short by the 1 s wait on a slow machine


async def test_a_remember_request_is_extracted_without_waiting(tmp_path: Path) -> None:
    """ "Remember that ..." closes the window at once: the fact is there without waiting the window's time."""
    settings = {"facts_window_wait_s": 600.0, "facts_window_exchanges": 10}
    async with FakeLLM(window_facts) as llm, running(tmp_path, llm, **settings) as h:
        await h.chat("I have a dog named Rex")
        await h.chat("Remember that my sister lives in Oslo")
        await wait_for(h, Kind.FACT, 2)
        texts = sorted(f.text for f in await h.facts())
    assert "The user has a dog named Rex" in texts
    assert any("Oslo" in text for text in texts)
