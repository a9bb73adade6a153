"""The read path's byte-bounded text caches (pure code)."""

from __future__ import annotations

from proxy.memory.read import injection
from proxy.memory.read.byte_cache import ENTRY_OVERHEAD, ByteCache, text_bytes
from proxy.memory.read.retrieval_settings import InjectionSettings


def _counting(max_bytes: int) -> tuple[ByteCache[str], list[str]]:
    calls: list[str] = []

    def upper(text: str) -> str:
        calls.append(text)
        return text.upper()

    return ByteCache(upper, max_bytes, lambda text, value: text_bytes(text, value)), calls


def test_a_hit_is_not_computed_again() -> None:
    cache, calls = _counting(1 << 20)
    assert cache["abc"] == "ABC"
    assert cache["abc"] == "ABC"
    assert calls == ["abc"]


def test_distinct_large_texts_stay_within_the_budget() -> None:
    """1,000 distinct 20 kB texts (~40 MB of keys and values) through a 1 MB cache."""
    cache, calls = _counting(1 << 20)
    for i in range(1_000):
        cache[f"{i:06d}" + "x" * 20_000]
        assert cache.cached_bytes <= 1 << 20
    assert len(calls) == 1_000
    assert 0 < cache.entries < 30


def test_what_the_last_generation_used_survives_the_turnover() -> None:
    """An entry used within the last half budget of work is kept; one left unused for two generations goes."""
    cache, calls = _counting(64 * (ENTRY_OVERHEAD + 200))
    cache["hot"]
    cache["cold"]
    for i in range(200):
        cache[f"filler {i}"]
        cache["hot"]
    calls.clear()
    cache["hot"]
    cache["cold"]
    assert calls == ["cold"]


def test_an_entry_over_half_the_budget_is_computed_every_time() -> None:
    cache, calls = _counting(10_000)
    big = "y" * 6_000
    cache[big]
    cache[big]
    assert calls == [big, big]
    assert cache.entries == 0


def test_cache_clear_empties_it() -> None:
    cache, calls = _counting(1 << 20)
    cache["a"]
    cache.cache_clear()
    assert (cache.entries, cache.cached_bytes) == (0, 0)
    cache["a"]
    assert calls == ["a", "a"]


def test_requests_with_large_distinct_messages_leave_the_injection_caches_bounded() -> None:
    """A RAG-style app: every request carries its own 15 kB context (under the 16,000 characters dedupe reads
    of a message). Before, the normalised-text cache kept up to 16,384 of them (key and value: ~500 MB); now it
    stays within its byte budget."""
    injection.clear_caches()
    item = injection.MemoryItem("m1", injection.Section.ABOUT_USER, "Sam likes green tea", "2024-05-01", 1.0)
    requests = 700
    for i in range(requests):
        context = f"document {i}: " + " ".join(f"w{i}x{j}" for j in range(1_600))
        messages = [{"role": "system", "content": context}, {"role": "user", "content": "what does Sam drink?"}]
        injection.inject(messages, [item], ["sam", "drink"], InjectionSettings())
    assert injection._normalised.cached_bytes <= 16 * 2**20
    assert injection._normalised.entries < requests
