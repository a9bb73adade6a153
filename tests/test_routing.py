"""One routing rule for the chat and the memory-side calls: the longest matching prefix wins."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.memory.write.routing import route_index
from tests.conftest import ProxyFactory
from tests.fake_upstream import FakeUpstream
from tests.test_jobs import eventually


def test_longest_prefix_wins_whatever_the_order() -> None:
    """``team/special-`` beats ``team/`` for its models in either order; other models fall to the short one."""
    for prefixes in (["team/", "team/special-"], ["team/special-", "team/"]):
        assert prefixes[route_index(prefixes, "team/special-echo") or 0] == "team/special-"
        assert prefixes[route_index(prefixes, "team/plain") or 0] == "team/"
        assert route_index(prefixes, "gpt-4o") is None


@given(
    st.lists(st.sampled_from(["a", "ab", "abc", "b", "ba"]), min_size=1, max_size=5),
    st.sampled_from(["a", "abc", "abcd", "bar", "c"]),
)
def test_the_chosen_prefix_is_a_longest_match(prefixes: list[str], model: str) -> None:
    """Any list of prefixes: the chosen one matches, and no matching prefix is longer."""
    index = route_index(prefixes, model)
    matching = [p for p in prefixes if model.startswith(p)]
    if not matching:
        assert index is None
    else:
        assert index is not None
        assert model.startswith(prefixes[index])
        assert len(prefixes[index]) == max(map(len, matching))


@pytest.fixture
async def two_routes() -> AsyncIterator[tuple[FakeUpstream, FakeUpstream]]:
    """Two more fake upstreams: one for the short prefix, one for the long one."""
    async with FakeUpstream() as short, FakeUpstream() as long:
        yield short, long


async def test_chat_and_its_extraction_go_to_the_same_provider(
    make_proxy: ProxyFactory, fake: FakeUpstream, two_routes: tuple[FakeUpstream, FakeUpstream]
) -> None:
    """With overlapping prefixes listed short first, the chat and the facts call about it reach one server."""
    short, long = two_routes
    routes = [
        {"prefix": "team/", "provider": "openai", "base_url": short.base_url},
        {"prefix": "team/special-", "provider": "openai", "base_url": long.base_url},
    ]
    proxy = await make_proxy(routes=routes)
    body = {"model": "team/special-echo", "messages": [{"role": "user", "content": "I live in Lyon."}]}
    response = await proxy.post(
        "/v1/chat/completions", json=body, headers={"X-Memory-User": "ann", "Authorization": "Bearer sk-ann"}
    )
    assert response.status == 200

    async def extraction_sent() -> bool:
        return bool(long.structured_calls)

    await eventually(extraction_sent, within_s=60)
    assert long.requests[0]["json"]["model"] == "team/special-echo"
    assert not short.requests
    assert not fake.requests
