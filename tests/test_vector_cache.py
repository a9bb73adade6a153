"""The per-user vector cache: exact search, filters, coherence with writes, SIEVE eviction by bytes."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from unittest.mock import patch

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.memory.store import exact_search, user_vectors
from proxy.memory.store.records import Kind, MemoryRecord, Pool, arrow_rows
from proxy.memory.store.user_vectors import UserVectors, estimated_bytes
from proxy.memory.store.vector_cache import READS_IDLE_S, VectorCache, _Sieve, holding

DIM = 16
T0 = datetime(2025, 1, 1, tzinfo=UTC)


def unit_rows(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    rows = rng.standard_normal((n, DIM)).astype(np.float32)
    return rows / np.linalg.norm(rows, axis=1, keepdims=True)


def records(user: str, n: int, kind: Kind = Kind.FACT, start: int = 0) -> list[MemoryRecord]:
    return [
        MemoryRecord(user_id=user, kind=kind, text=f"memory {i}", id=f"{user}-{i}", created_at=T0 + timedelta(hours=i))
        for i in range(start, start + n)
    ]


def entry_with(user: str, recs: list[MemoryRecord], vectors: np.ndarray) -> UserVectors:
    entry = UserVectors(user, DIM)
    for record, vector in zip(recs, vectors, strict=True):
        entry.upsert(record, vector)
    return entry


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 300), k=st.integers(1, 20), seed=st.integers(0, 2**16))
def test_search_returns_the_exact_top_k(n: int, k: int, seed: int) -> None:
    """Cached search ranks exactly like a brute-force cosine over the user's vectors."""
    vectors = unit_rows(n, seed)
    entry = entry_with("u", records("u", n), vectors)
    query = unit_rows(1, seed + 1)[0]
    got = entry.search(query, k, None, None, None, include_invalid=False)
    expected = np.sort(vectors @ query)[::-1][: min(k, n)]
    assert np.allclose([score for _, score in got], expected, atol=1e-5)


def _brute_force(
    recs: dict[str, tuple[MemoryRecord, np.ndarray]], query: np.ndarray, pool: Pool
) -> list[tuple[str, float]]:
    found = [
        (rid, float(vector @ query))
        for rid, (record, vector) in recs.items()
        if (pool.include_invalid or record.valid)
        and (not pool.kinds or record.kind in pool.kinds)
        and (pool.since is None or record.created_at >= pool.since)
        and (pool.until is None or record.created_at <= pool.until)
    ]
    return sorted(found, key=lambda p: -p[1])[: pool.k]


_KINDS = [Kind.FACT, Kind.TURN, Kind.SUMMARY, Kind.SUBJECT]
_hours = st.integers(0, 200)
_pool = st.builds(
    lambda k, kinds, since, until, invalid: Pool(
        k,
        tuple(kinds),
        None if since is None else T0 + timedelta(hours=since),
        None if until is None else T0 + timedelta(hours=until),
        invalid,
    ),
    st.integers(1, 30),
    st.lists(st.sampled_from(_KINDS), max_size=2, unique=True),
    st.none() | _hours,
    st.none() | _hours,
    st.booleans(),
)


@settings(max_examples=60, deadline=None)
@given(
    loaded=st.lists(st.tuples(st.sampled_from(_KINDS), _hours, st.booleans()), max_size=120),
    edits=st.lists(st.tuples(st.integers(0, 140), st.sampled_from(_KINDS), _hours), max_size=40),
    removed=st.lists(st.integers(0, 140), max_size=100),
    pools=st.lists(_pool, min_size=1, max_size=3),
    seed=st.integers(0, 2**16),
)
def test_a_loaded_entry_scans_only_its_pools_rows_and_still_finds_the_exact_top_k(
    loaded: list[tuple[Kind, int, bool]],
    edits: list[tuple[int, Kind, int]],
    removed: list[int],
    pools: list[Pool],
    seed: int,
) -> None:
    """An entry loaded from LanceDB rows in any order (kept by kind and time, so that a search scans only the
    rows its pools can return), then edited (kinds and times changed, records added) and pruned (compaction
    included), ranks every pool exactly like a brute-force cosine over the user's current records."""
    vectors = unit_rows(len(loaded) + len(edits) + 1, seed)
    recs = [
        MemoryRecord(
            user_id="u", kind=kind, text=f"m{i}", id=f"u-{i}", created_at=T0 + timedelta(hours=hour), valid=valid
        )
        for i, (kind, hour, valid) in enumerate(loaded)
    ]
    entry = UserVectors("u", DIM, arrow_rows(recs, vectors[: len(recs)]) if recs else None)
    current = {r.id: (r, vectors[i]) for i, r in enumerate(recs)}
    for j, (i, kind, hour) in enumerate(edits):  # an edit of a loaded record, or a new one past them
        record = MemoryRecord(user_id="u", kind=kind, text=f"e{j}", id=f"u-{i}", created_at=T0 + timedelta(hours=hour))
        vector = vectors[len(loaded) + j]
        entry.upsert(record, vector)
        current[record.id] = (record, vector)
    gone = [f"u-{i}" for i in removed]
    entry.remove(gone)
    for rid in gone:
        current.pop(rid, None)
    query = unit_rows(1, seed + 1)[0]
    with patch.object(user_vectors, "_RUN_GAP", 0), patch.object(user_vectors, "_FULL_SCAN_SHARE", 2.0):
        found = entry.search_pools(query, pools)  # runs scanned one by one, however small
    for pool, got in zip(pools, found, strict=True):
        expected = _brute_force(current, query, pool)
        assert np.allclose([score for _, score in got], [score for _, score in expected], atol=1e-5)
        assert {rid for rid, _ in got} <= set(current)


def test_an_edit_that_moves_a_loaded_record_out_of_its_place_is_still_found() -> None:
    """A loaded fact edited into a turn of a later time leaves the facts' run for the rows scanned always."""
    recs = [
        MemoryRecord(user_id="u", kind=Kind.FACT if i < 50 else Kind.TURN, text="m", id=f"u-{i}", created_at=T0)
        for i in range(100)
    ]
    vectors = unit_rows(101)
    entry = UserVectors("u", DIM, arrow_rows(recs, vectors[:100]))
    entry.upsert(recs[3].replace(kind=Kind.TURN, created_at=T0 + timedelta(hours=150)), vectors[100])
    late_turns = Pool(5, (Kind.TURN,), T0 + timedelta(hours=120))
    assert entry.search_pools(vectors[100], [late_turns]) == [[("u-3", pytest.approx(1.0))]]


def test_filters_by_kind_time_and_validity() -> None:
    """Kinds, the time window (inclusive) and invalid history are all honoured."""
    recs = records("u", 10) + records("u", 5, Kind.TURN, start=10)
    recs[3] = recs[3].replace(valid=False)
    entry = entry_with("u", recs, unit_rows(15))
    query = unit_rows(1, 9)[0]
    facts = {i for i, _ in entry.search(query, 50, [Kind.FACT], None, None, False)}
    assert facts == {f"u-{i}" for i in range(10)} - {"u-3"}
    window = {i for i, _ in entry.search(query, 50, None, T0 + timedelta(hours=2), T0 + timedelta(hours=4), True)}
    assert window == {"u-2", "u-3", "u-4"}


def test_ids_found_elsewhere_keep_only_live_rows_in_the_pool() -> None:
    """``rows_in_pool`` (the keyword arm's hits checked against the cache): unknown, deleted and invalid ids,
    other kinds and times outside the window are left out; the others come back with their place in the ids."""
    recs = records("u", 10) + records("u", 5, Kind.TURN, start=10)
    recs[3] = recs[3].replace(valid=False)
    entry = entry_with("u", recs, unit_rows(15))
    entry.remove(["u-4"])
    asked = ["u-1", "nobody", "u-3", "u-4", "u-12", "u-2", "u-14", "u-11"]
    rows, kept = entry.rows_in_pool(asked, Pool(10, (Kind.FACT,)))
    assert [asked[i] for i in kept] == ["u-1", "u-2"]
    assert [entry.ids[row] for row in rows] == ["u-1", "u-2"]
    window = Pool(10, (Kind.TURN,), since=T0 + timedelta(hours=11), until=T0 + timedelta(hours=12))
    rows, kept = entry.rows_in_pool(asked, window)
    assert [asked[i] for i in kept] == ["u-12", "u-11"]
    rows, kept = entry.rows_in_pool(asked, Pool(10, include_invalid=True))
    assert [asked[i] for i in kept] == ["u-1", "u-3", "u-12", "u-2", "u-14", "u-11"]
    assert entry.rows_in_pool([], Pool(10)) == ([], [])


def test_edits_and_deletes_are_seen_by_the_next_search() -> None:
    """An edited vector ranks by its new value and a deleted record never comes back."""
    vectors = unit_rows(50)
    recs = records("u", 50)
    entry = entry_with("u", recs, vectors)
    target = unit_rows(1, 77)[0]
    entry.upsert(recs[7].replace(text="edited"), target)
    top = entry.search(target, 1, None, None, None, False)
    assert top[0][0] == "u-7"
    assert entry.records(["u-7"])[0].text == "edited"
    entry.remove(["u-7"])
    assert "u-7" not in {i for i, _ in entry.search(target, 50, None, None, None, True)}
    assert entry.records(["u-7"]) == [None]


def test_compaction_after_many_deletes_keeps_results_right() -> None:
    """Deleting most records compacts the arrays without changing what search returns."""
    vectors = unit_rows(400)
    entry = entry_with("u", records("u", 400), vectors)
    entry.remove([f"u-{i}" for i in range(300)])
    assert entry.generation == 1
    query = unit_rows(1, 5)[0]
    got = entry.search(query, 5, None, None, None, False)
    expected = sorted(((f"u-{i}", float(vectors[i] @ query)) for i in range(300, 400)), key=lambda p: -p[1])[:5]
    assert [i for i, _ in got] == [i for i, _ in expected]


async def test_eviction_by_bytes() -> None:
    """Past the byte budget a user not read since they came is evicted, the one read again kept; each lookup is
    told to ``observe`` (a hit, or a miss that loaded the user)."""
    one = UserVectors("a", DIM)
    for record, vector in zip(records("a", 100), unit_rows(100), strict=True):
        one.upsert(record, vector)
    cache = VectorCache(max_bytes=int(one.nbytes * 2.5))
    seen: list[str] = []
    cache.observe = seen.append

    async def load(user: str) -> UserVectors:
        return entry_with(user, records(user, 100), unit_rows(100))

    for user in ("a", "b"):
        await cache.get_or_load(user, lambda user=user: load(user))
    await cache.get_or_load("a", lambda: load("a"))  # a is now the most recent
    await cache.get_or_load("c", lambda: load("c"))
    assert "a" in cache
    assert "c" in cache
    assert "b" not in cache
    assert cache.nbytes <= cache.max_bytes
    await cache.get_or_load("b", lambda: load("b"))  # evicted: loaded again
    assert seen == ["miss", "miss", "hit", "miss", "miss"]


def _cache_of(users: int) -> VectorCache:
    """A cache with room for ``users`` users of 100 memories (and not one more)."""
    one = entry_with("a", records("a", 100), unit_rows(100))
    return VectorCache(max_bytes=int(one.nbytes * (users + 0.5)))


async def _load(user: str) -> UserVectors:
    return entry_with(user, records(user, 100), unit_rows(100))


async def test_a_user_read_again_outlasts_users_seen_once() -> None:
    """SIEVE: a user read again since they came stays while users read once pass through (LRU would evict them
    at the third newcomer)."""
    cache = _cache_of(3)
    for user in ("a", "b", "c"):
        await cache.get_or_load(user, lambda user=user: _load(user))
    await cache.get_or_load("a", lambda: _load("a"))
    for user in ("d", "e", "f"):
        await cache.get_or_load(user, lambda user=user: _load(user))
        assert "a" in cache
    assert [user for user in "abcdef" if user in cache] == ["a", "e", "f"]
    assert cache.nbytes <= cache.max_bytes


async def test_users_who_need_more_than_the_budget_still_find_some_cached() -> None:
    """Users read in turn, twice as many as fit, in a new random order each round: LRU would find none cached (each
    comes back after more others than fit); SIEVE keeps a steady part of them, near the share that fits."""
    cache = _cache_of(4)
    seen: list[str] = []
    cache.observe = seen.append
    users = [f"u{i}" for i in range(8)]
    rng = np.random.default_rng(3)
    for _ in range(60):
        for user in rng.permutation(users):
            await cache.get_or_load(str(user), lambda user=str(user): _load(user))
    hits = seen.count("hit") / len(seen)
    assert 0.25 <= hits <= 0.5, hits


async def test_one_read_looks_its_user_up_once() -> None:
    """Within ``holding`` (one read of the chat path), a user's later lookups return what the first one got, even
    an entry the cache did not keep, with no load, no use marked and no lookup counted; arms that look up at once
    wait for the first lookup rather than load again; a delete since makes a held entry the cache does not hold
    look up again; outside it, each lookup goes to the cache."""
    cache = _cache_of(1)
    loads: list[str] = []
    seen: list[str] = []
    cache.observe = seen.append
    release = asyncio.Event()

    async def load(user: str) -> UserVectors:
        loads.append(user)
        await release.wait()
        return await _load(user)

    release.set()
    await cache.get_or_load("a", lambda: load("a"))
    with holding():
        first = await cache.get_or_load("b", lambda: load("b"))  # evicts a
        assert await cache.get_or_load("a", lambda: load("a")) is not None  # evicts b
        assert "b" not in cache
        assert await cache.get_or_load("b", lambda: load("b")) is first  # not loaded again
        assert await cache.get_or_load("a", lambda: load("a")) is cache.peek("a")
        cache.remove("b", ["b-0"])  # deleted since: the held entry of b, not cached, is stale
        assert await cache.get_or_load("b", lambda: load("b")) is not first
    assert loads == ["a", "b", "a", "b"]
    assert seen == ["miss", "miss", "miss", "miss"]
    await cache.get_or_load("b", lambda: load("b"))
    assert seen[-1] == "hit"

    release.clear()
    with holding():  # three arms at once, a user not cached: one load, one entry, one lookup counted
        arms = [asyncio.create_task(cache.get_or_load("c", lambda: load("c"))) for _ in range(3)]
        await asyncio.sleep(0)
        release.set()
        got = await asyncio.gather(*arms)
    assert loads[-1] == "c"
    assert loads.count("c") == 1
    assert got[0] is got[1] is got[2]
    assert seen[-1] == "miss"
    assert seen.count("hit") == 1


async def test_what_a_read_does_after_its_arms_sees_the_entry_they_searched() -> None:
    """``current``: within ``holding``, the entry the read's first lookup got, even once another read's miss has
    evicted it (term matching's stored word pieces, the access times the read notes), unless a delete came since;
    else what the cache holds, without marking it used. A ``holding`` within another is the outer one's."""
    cache = _cache_of(1)
    with holding():
        first = await cache.get_or_load("a", lambda: _load("a"))
        with holding():  # (the read's own retrieval inside ``inject``'s scope)
            assert await cache.get_or_load("b", lambda: _load("b")) is not None  # evicts a
        assert "a" not in cache
        assert cache.current("a") is first
        assert cache.current("b") is cache.peek("b")
        cache.remove("a", ["a-0"])  # deleted since: what the read held is no longer current
        assert cache.current("a") is None
    assert cache.current("b") is cache.peek("b")
    assert cache.current("a") is None
    with holding():
        assert cache.current("b") is cache.peek("b")  # not looked up in this read: the cache's


async def test_users_no_read_used_lately_are_released_and_reload_on_their_next_read() -> None:
    """``release_idle`` drops the users last read ``idle_s`` ago or more (a write does not count as a read),
    keeps the others, and gives their bytes back; a released user's next read loads them again."""
    clock = [100.0]
    cache = VectorCache(max_bytes=2**22, clock=lambda: clock[0])
    loads: list[str] = []

    async def load(user: str) -> UserVectors:
        loads.append(user)
        return entry_with(user, records(user, 20), unit_rows(20))

    for user in ("old", "recent"):
        await cache.get_or_load(user, lambda user=user: load(user))
    clock[0] += 30
    await cache.get_or_load("recent", lambda: load("recent"))
    cache.upsert(records("old", 1, start=50), unit_rows(1))  # a write keeps the entry current, not in use
    clock[0] += READS_IDLE_S / 2
    assert cache.release_idle(20.0) == []  # a read came too recently: nothing goes while reads come
    clock[0] += 15
    assert cache.release_idle(20.0) == ["old"]
    assert "old" not in cache
    assert "recent" in cache
    assert cache.nbytes == cache.get("recent").nbytes  # type: ignore[union-attr]
    assert cache.release_idle(20.0) == []
    await cache.get_or_load("old", lambda: load("old"))
    assert loads == ["old", "recent", "old"]
    clock[0] += 60
    assert sorted(cache.release_idle(20.0)) == ["old", "recent"]
    assert len(cache) == 0
    assert cache.nbytes == 0


async def test_user_too_big_for_the_budget_is_not_cached() -> None:
    """A user whose vectors exceed the budget is searched elsewhere (the loader says None)."""
    cache = VectorCache(max_bytes=estimated_bytes(10, DIM))
    seen: list[str] = []
    cache.observe = seen.append
    calls = 0

    async def load() -> None:
        nonlocal calls
        calls += 1

    assert await cache.get_or_load("big", load) is None
    assert await cache.get_or_load("big", load) is None
    assert calls == 1
    assert "big" not in cache
    assert seen == ["miss", "too_big"]


async def test_writes_during_a_load_are_replayed_onto_it() -> None:
    """Writes that land while a user loads reach the kept entry: a record the load missed is added, one it
    already held is replaced by the same, a deleted one is gone, a touch shows (no stale state, no reload)."""
    cache = VectorCache(max_bytes=2**20)
    release = asyncio.Event()
    loaded = records("u", 3)
    calls = 0

    async def slow_load() -> UserVectors:
        nonlocal calls
        calls += 1
        await release.wait()
        return entry_with("u", loaded, unit_rows(3))  # its snapshot holds record 0-2, taken before the writes

    loading = asyncio.create_task(cache.get_or_load("u", slow_load))
    await asyncio.sleep(0)
    late = records("u", 1, start=99)
    cache.upsert(late, unit_rows(1, seed=5))  # committed after the snapshot
    cache.upsert(loaded[:1], unit_rows(1))  # one the snapshot already has (the same record again)
    cache.remove("u", [loaded[1].id])
    when = datetime(2026, 3, 1, tzinfo=UTC)
    cache.patch("u", [loaded[2].id], last_accessed_at=when)
    release.set()
    entry = await loading
    assert entry is not None
    assert "u" in cache
    assert await cache.get_or_load("u", slow_load) is entry
    assert calls == 1
    assert sorted(entry.index) == sorted([loaded[0].id, loaded[2].id, late[0].id])
    [touched] = entry.records([loaded[2].id])
    assert touched is not None
    assert touched.last_accessed_at == when
    [(best, score)] = entry.search(unit_rows(1, seed=5)[0], 1, None, None, None, True)
    assert best == late[0].id
    assert score > 0.999


async def test_a_load_overlapping_a_drop_is_not_kept() -> None:
    """A user dropped while loading (forgotten, reindexed) is not cached from that load."""
    cache = VectorCache(max_bytes=2**20)
    release = asyncio.Event()

    async def slow_load() -> UserVectors:
        await release.wait()
        return entry_with("u", records("u", 3), unit_rows(3))

    loading = asyncio.create_task(cache.get_or_load("u", slow_load))
    await asyncio.sleep(0)
    cache.drop("u")
    release.set()
    assert await loading is not None
    assert "u" not in cache


async def test_concurrent_misses_load_once() -> None:
    """Ten searches missing at once cause a single load."""
    cache = VectorCache(max_bytes=2**20)
    calls = 0

    async def load() -> UserVectors:
        nonlocal calls
        calls += 1
        await asyncio.sleep(0.01)
        return entry_with("u", records("u", 3), unit_rows(3))

    results = await asyncio.gather(*(cache.get_or_load("u", load) for _ in range(10)))
    assert calls == 1
    assert all(result is results[0] for result in results)


def test_writes_apply_only_to_cached_users() -> None:
    """Upserts for users not in the cache do not create partial entries."""
    cache = VectorCache(max_bytes=2**20)
    cache.upsert(records("ghost", 2), unit_rows(2))
    cache.remove("ghost", ["ghost-0"])
    assert "ghost" not in cache
    assert cache.nbytes == 0


async def test_closing_stops_a_load_whose_caller_gave_up() -> None:
    """A load keeps running when its caller's deadline passes (so it gets cached), and closing stops it."""
    cache = VectorCache(max_bytes=10**9)
    started, stopped = asyncio.Event(), asyncio.Event()

    async def slow_load() -> None:
        started.set()
        try:
            await asyncio.sleep(60)
        finally:
            stopped.set()

    caller = asyncio.create_task(cache.get_or_load("u1", slow_load))
    await started.wait()
    caller.cancel()
    await asyncio.gather(caller, return_exceptions=True)
    assert not stopped.is_set()  # the caller gave up; the load did not
    await asyncio.wait_for(cache.aclose(), 5)
    assert stopped.is_set()


@pytest.mark.parametrize("n", [1, 5, 9, 100, 1_000])
def test_an_entry_holds_little_more_room_than_its_records(n: int) -> None:
    entry = entry_with("u", records("u", n), unit_rows(n))
    capacity = entry.vectors.shape[1]
    assert n <= capacity <= max(8, 1.5 * n + 1)  # a one-memory user no longer pins 64 rows of vectors
    assert entry.search(unit_rows(1, seed=9)[0], n, None, None, None, False)[0][0] in entry.index


def test_word_pieces_load_with_the_rows_and_follow_writes_and_compaction() -> None:
    """Loaded rows' pieces come from the ``pieces`` column (a null row has none); a rewrite replaces them, a
    record written after the load brings its own, a delete drops them, a compaction keeps the others'."""
    recs = records("u", 4)
    kept = [np.array([1, 2]), None, np.array([7]), np.array([], dtype=np.int64)]
    entry = UserVectors("u", DIM, arrow_rows(recs, unit_rows(4), kept))
    got = entry.pieces_of([r.id for r in recs] + ["u-unknown"])
    assert [None if p is None else p.tolist() for p in got] == [[1, 2], None, [7], [], None]
    entry.upsert(recs[0].replace(text="new"), unit_rows(1)[0], np.array([9]))
    entry.upsert(recs[2].replace(text="edited without pieces"), unit_rows(1)[0])
    [late] = records("u", 1, start=10)
    entry.upsert(late, unit_rows(1)[0], np.array([5, 6]))
    assert [None if p is None else p.tolist() for p in entry.pieces_of([recs[0].id, recs[2].id, late.id])] == [
        [9],
        None,
        [5, 6],
    ]
    bytes_before = entry.nbytes
    entry.remove([late.id])
    assert entry.pieces_of([late.id]) == [None]
    assert entry.nbytes < bytes_before
    entry._compact()
    assert [None if p is None else p.tolist() for p in entry.pieces_of([r.id for r in recs])] == [[9], None, None, []]
    assert UserVectors("u", DIM, arrow_rows(recs, unit_rows(4))).pieces_of([recs[0].id]) == [None]  # none written


def test_loaded_list_columns_are_tuples_the_collector_can_drop() -> None:
    """A loaded row's entities come back as the record's tuple, which the cyclic collector stops walking after
    one pass (lists it walks at every full collection); rows no read returned stay in Arrow, not Python."""
    import gc

    recs = [r.replace(entities=("Ana", "Lisbon"), source_ids=()) for r in records("u", 3)]
    entry = UserVectors("u", DIM, arrow_rows(recs, unit_rows(3)))
    assert entry._materialised == 0
    made = [r for r in entry.records([r.id for r in recs]) if r is not None]
    assert [r.entities for r in made] == [("Ana", "Lisbon")] * 3
    assert entry._materialised == 3
    gc.collect()
    assert not any(gc.is_tracked(r.entities) for r in made)


def test_top_k_takes_equal_scores_in_row_order() -> None:
    """Among equal scores at the cut, the earlier rows come in, and the best come first."""
    scores = np.array([0.5, 0.9, 0.5, 0.1, 0.5, 0.9], dtype=np.float32)
    rows = np.array([10, 11, 12, 13, 14, 15])
    assert exact_search.top_k(scores, rows, 3) == ([11, 15, 10], pytest.approx([0.9, 0.9, 0.5]))
    assert exact_search.top_k(scores, rows, 4) == ([11, 15, 10, 12], pytest.approx([0.9, 0.9, 0.5, 0.5]))
    assert exact_search.top_k(scores, rows, 9)[0] == [11, 15, 10, 12, 14, 13]
    assert exact_search.top_k(scores[:0], rows[:0], 3) == ([], [])


def test_top_k_ranks_nan_scores_last() -> None:
    """A NaN score (a stored vector of NaNs) takes no place from a number, and fills in only after them."""
    scores = np.array([0.5, np.nan, 0.3, np.nan], dtype=np.float32)
    rows = np.array([10, 11, 12, 13])
    assert exact_search.top_k(scores, rows, 2) == ([10, 12], pytest.approx([0.5, 0.3]))
    found, values = exact_search.top_k(scores, rows, 3)
    assert found == [10, 12, 11]
    assert np.isnan(values[2])


def test_a_patch_of_a_record_not_made_yet_shows_when_it_is() -> None:
    """Patching loaded rows makes no records; the patched fields show on each record when a read makes it, and
    a later write of the record or its delete drops them."""
    recs = records("u", 6)
    entry = UserVectors("u", DIM, arrow_rows(recs, unit_rows(6)))
    at = T0 + timedelta(days=2)
    entry.patch(["u-0", "u-1", "u-2", "u-404"], last_accessed_at=at)
    assert entry._materialised == 0
    entry.upsert(recs[1].replace(text="rewritten"), unit_rows(1)[0])
    entry.remove(["u-2"])
    got = entry.records(["u-0", "u-1", "u-2", "u-3"])
    assert [None if r is None else r.last_accessed_at for r in got] == [at, None, None, None]
    assert got[0] == recs[0].replace(last_accessed_at=at)
    assert got[1] is not None
    assert got[1].text == "rewritten"


def test_records_by_pool_gives_each_pools_records_in_order() -> None:
    recs = records("u", 8)
    entry = UserVectors("u", DIM, arrow_rows(recs, unit_rows(8)))
    pools = [[3, 1], [], [1, 5, 0]]
    assert [[r.id for r in got] for got in entry.records_by_pool(pools)] == [
        ["u-3", "u-1"],
        [],
        ["u-1", "u-5", "u-0"],
    ]
    assert entry._materialised == 4  # u-1 made once


class _ListSieve:
    """SIEVE as the paper states it, over a list (oldest first): the model ``vector_cache._Sieve`` must follow."""

    def __init__(self) -> None:
        self.keys: list[str] = []
        self.marked: dict[str, bool] = {}
        self.hand: int | None = None

    def add(self, key: str) -> None:
        if key not in self.marked:
            self.keys.append(key)
            self.marked[key] = False

    def mark(self, key: str) -> None:
        if key in self.marked:
            self.marked[key] = True

    def victim(self) -> str:
        i = 0 if self.hand is None else self.hand
        while self.marked[self.keys[i]]:
            self.marked[self.keys[i]] = False
            i = (i + 1) % len(self.keys)
        self.hand = i
        return self.keys[i]

    def remove(self, key: str) -> None:
        if key not in self.marked:
            return
        j = self.keys.index(key)
        if self.hand is not None and j < self.hand:
            self.hand -= 1
        elif self.hand == j and j == len(self.keys) - 1:
            self.hand = None  # the hand was on the newest: it starts from the oldest again
        del self.keys[j]
        del self.marked[key]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["add", "mark", "evict", "remove"]), st.integers(0, 7)), max_size=80))
def test_sieve_queue_follows_the_list_model(steps: list[tuple[str, int]]) -> None:
    """``_Sieve`` (a linked queue) picks the victims a plain list implementation of SIEVE picks."""
    queue, model = _Sieve(), _ListSieve()
    for action, n in steps:
        key = f"k{n}"
        if action == "add":
            queue.add(key)
            model.add(key)
        elif action == "mark":
            queue.mark(key)
            model.mark(key)
        elif action == "remove":
            queue.remove(key)
            model.remove(key)
        elif model.keys:
            victim = queue.victim()
            assert victim == model.victim()
            queue.remove(victim)
            model.remove(victim)
        assert len(queue) == len(model.keys)
