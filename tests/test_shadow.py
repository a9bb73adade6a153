"""Shadow evaluation: the agreement measures, the [shadow] section, and shadow runs under load that inject nothing."""

from __future__ import annotations

import asyncio
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import given
from hypothesis import strategies as st

from proxy.app import build_app
from proxy.config import ConfigError, load_settings
from proxy.shadow import agreement
from tests.fake_upstream import FakeUpstream

KEY = "adm-shadow-3e1f"
FACTS = [
    "Sam keeps two rabbits called Pip and Moss",
    "Sam works night shifts at a bakery",
    "Sam is training for the Berlin marathon",
    "Sam is allergic to peanuts",
    "Sam's sister lives in Lima",
    "Sam plays bass in a jazz trio",
    "Sam drives an old blue Volvo",
    "Sam is learning Portuguese",
    "Sam prefers green tea to coffee",
    "Sam grew up near the sea in Cornwall",
    "Sam's favourite film is Spirited Away",
    "Sam volunteers at the animal shelter on Sundays",
]
QUESTIONS = [
    "What pets do I have?",
    "Where does my sister live?",
    "What should I eat before the race?",
    "Recommend a film for tonight",
    "What instrument do I play?",
    "Which language am I learning?",
    "What car do I drive?",
    "Where did I grow up?",
]
ids = st.lists(st.sampled_from([f"m{i}" for i in range(30)]), max_size=20, unique=True)


def test_identical_rankings_agree_fully() -> None:
    """The same ranking twice has overlap 1, correlation 1 and nothing found by one side only."""
    result = agreement(["a", "b", "c"], ["a", "b", "c"], 3)
    assert (result.overlap, result.rank_correlation, result.only_live, result.only_shadow) == (1.0, 1.0, 0, 0)


def test_disjoint_and_reversed_rankings() -> None:
    """Disjoint top-k share nothing; the same items in reverse order correlate negatively."""
    disjoint = agreement(["a", "b"], ["c", "d"], 2)
    assert (disjoint.overlap, disjoint.only_live, disjoint.only_shadow) == (0.0, 2, 2)
    reversed_ = agreement(["a", "b", "c", "d"], ["d", "c", "b", "a"], 4)
    assert reversed_.overlap == 1.0
    assert reversed_.rank_correlation == pytest.approx(-1.0)


@given(ids, ids, st.integers(1, 15))
def test_agreement_is_bounded_and_symmetric(live: list[str], shadow: list[str], k: int) -> None:
    """Overlap lies in [0, 1], correlation in [-1, 1], and swapping the sides swaps only-found counts."""
    forward, backward = agreement(live, shadow, k), agreement(shadow, live, k)
    assert 0.0 <= forward.overlap <= 1.0
    assert -1.0 - 1e-9 <= forward.rank_correlation <= 1.0 + 1e-9
    assert (forward.only_live, forward.only_shadow) == (backward.only_shadow, backward.only_live)
    assert forward.overlap == backward.overlap


def test_unknown_alternative_key_is_named() -> None:
    """A [shadow] retrieval key that [retrieval] does not have is a config error naming it."""
    with pytest.raises(ConfigError, match=r"shadow\.retrieval.*dense_wieght"):
        load_settings(None, environ={}, overrides={"shadow": {"retrieval": {"dense_wieght": 0.5}}})


def _settings(upstream: str, path: Path, **shadow: Any) -> Any:
    return load_settings(
        None,
        environ={},
        overrides={
            "upstream": {"base_url": upstream},
            "storage": {"path": str(path)},
            "admin": {"api_key": KEY},
            "memory": {"retrieval_timeout_ms": 20_000, "read_queue_ms": 20_000, "max_concurrent_reads": 16},
            # recency off: access times move with every read, and two proxies must rank alike to be compared
            "retrieval": {"arm_timeout_ms": 20_000, "recency_weight": 0.0},
            "shadow": shadow,
        },
    )


async def _proxy(settings: Any) -> TestClient[Any, Any]:
    client = TestClient(TestServer(build_app(settings), host="127.0.0.1"))
    await client.start_server()
    return client


async def _ask(proxy: TestClient[Any, Any], question: str) -> str:
    response = await proxy.post(
        "/v1/chat/completions",
        json={"model": "fake-echo", "messages": [{"role": "user", "content": question}]},
        headers={"X-Memory-User": "sam", "X-Memory-Mode": "read", "Authorization": "Bearer sk-app"},
    )
    assert response.status == 200
    return response.headers["X-Memory-Ids"]


async def test_shadow_under_load_reports_agreement_and_injects_the_same(tmp_path: Path) -> None:
    """With shadow on for every request, concurrent chats get the very memories a shadow-off proxy injects,
    and every request's comparison reaches /metrics."""
    async with FakeUpstream() as fake:
        seed = await _proxy(_settings(fake.base_url, tmp_path / "live"))
        batch = {"memories": [{"text": text} for text in FACTS]}
        added = await seed.post(
            "/v1/memory/users/sam/memories:batch", json=batch, headers={"Authorization": f"Bearer {KEY}"}
        )
        assert (await added.json())["added"] == len(FACTS)
        await seed.close()
        shutil.copytree(tmp_path / "live", tmp_path / "shadowed")
        plain = await _proxy(_settings(fake.base_url, tmp_path / "live"))
        shadowed = await _proxy(
            _settings(
                fake.base_url,
                tmp_path / "shadowed",
                enabled=True,
                sample_rate=1.0,
                settle_s=0.05,
                retrieval={"dense_weight": 0.9, "bm25_weight": 0.1},
            )
        )
        try:
            expected = [await _ask(plain, q) for q in QUESTIONS]
            assert any(expected)
            assert [await _ask(shadowed, q) for q in QUESTIONS] == expected  # same requests, same injections
            loaded = await asyncio.gather(*(_ask(shadowed, q) for q in QUESTIONS * 3))  # then under load
            assert all(loaded)
            runs = float(len(QUESTIONS) * 4)
            text = ""
            for _ in range(300):
                text = await (await shadowed.get("/metrics")).text()
                if f'memproxy_shadow_runs_total{{outcome="compared"}} {runs}' in text:
                    break
                await asyncio.sleep(0.1)
            assert f'memproxy_shadow_runs_total{{outcome="compared"}} {runs}' in text, text
            assert re.search(rf"memproxy_shadow_overlap_count {runs}", text)
            assert "memproxy_shadow_rank_correlation_bucket" in text
            assert "memproxy_shadow" not in await (await plain.get("/metrics")).text()
        finally:
            await plain.close()
            await shadowed.close()


async def test_management_api_works_through_the_shadow_wrapper(tmp_path: Path) -> None:
    """With shadow on, the management API adds, lists and searches the user's memories as without it."""
    auth = {"Authorization": f"Bearer {KEY}"}
    async with FakeUpstream() as fake:
        shadowed = await _proxy(_settings(fake.base_url, tmp_path, enabled=True, sample_rate=1.0))
        try:
            added = await shadowed.post("/v1/memory/users/sam/memories", json={"text": FACTS[0]}, headers=auth)
            assert added.status == 201, await added.text()
            listed = await (await shadowed.get("/v1/memory/users/sam/memories", headers=auth)).json()
            assert [item["text"] for item in listed["data"]] == [FACTS[0]]
            found = await shadowed.post("/v1/memory/users/sam/search", json={"query": "rabbits"}, headers=auth)
            assert [item["text"] for item in (await found.json())["results"]] == [FACTS[0]]
        finally:
            await shadowed.close()
