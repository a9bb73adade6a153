"""The vector cache's spill: users evicted from RAM written to local files and read back exactly as they were,
kept exact under writes, bounded in bytes, and gone when dropped, forgotten or closed."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from unittest.mock import patch

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.memory.store import vector_cache, vector_spill
from proxy.memory.store.records import Kind, MemoryRecord, Pool, arrow_rows
from proxy.memory.store.user_vectors import UserVectors
from proxy.memory.store.vector_cache import VectorCache
from proxy.memory.store.vector_spill import (
    MAX_PATCHES,
    REWRITE_AFTER,
    VectorSpill,
    read_parts,
    upsert_bytes,
    write_parts,
)

DIM = 16
T0 = datetime(2025, 1, 1, tzinfo=UTC)
_KINDS = [Kind.FACT, Kind.TURN, Kind.SUMMARY, Kind.SUBJECT]


@pytest.fixture(autouse=True, params=["mapped", "read"])
def file_access(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test twice: files mapped (as a user of more than ~120 memories is) and read into memory (smaller)."""
    monkeypatch.setattr(vector_spill, "MAP_MIN_BYTES", 0 if request.param == "mapped" else 2**40)
    return str(request.param)


def unit_rows(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    rows = rng.standard_normal((n, DIM)).astype(np.float32)
    return rows / np.linalg.norm(rows, axis=1, keepdims=True)


def records(user: str, n: int, start: int = 0) -> list[MemoryRecord]:
    return [
        MemoryRecord(
            user_id=user,
            kind=_KINDS[i % len(_KINDS)],
            text=f"memory {i}",
            id=f"{user}-{i}",
            created_at=T0 + timedelta(hours=i, microseconds=i),
            entities=(f"e{i}",),
        )
        for i in range(start, start + n)
    ]


def loaded(user: str, n: int, seed: int = 0) -> UserVectors:
    """An entry as a load from LanceDB makes it (rows with their word pieces)."""
    recs = records(user, n)
    pieces = [np.arange(i % 5, dtype=np.int64) if i % 3 else None for i in range(n)]
    return UserVectors(user, DIM, arrow_rows(recs, unit_rows(n, seed), pieces) if n else None)


def _pieces(entry: UserVectors, ids: list[str]) -> list[list[int] | None]:
    return [None if p is None else p.tolist() for p in entry.pieces_of(ids)]


def assert_same(got: UserVectors, expected: UserVectors, ids: list[str], seed: int) -> None:
    """Both entries answer every read alike: searches, records, word pieces, listings."""
    query = unit_rows(1, seed + 7)[0]
    pools = [
        Pool(50),
        Pool(5, (Kind.FACT,)),
        Pool(8, (Kind.TURN, Kind.SUMMARY), since=T0 + timedelta(hours=3)),
        Pool(50, include_invalid=True),
    ]
    for mine, theirs in zip(got.search_pools(query, pools), expected.search_pools(query, pools), strict=True):
        assert [i for i, _ in mine] == [i for i, _ in theirs]
        assert np.allclose([s for _, s in mine], [s for _, s in theirs], atol=1e-6)  # the matrix's width differs
    assert got.records(ids) == expected.records(ids)
    assert _pieces(got, ids) == _pieces(expected, ids)
    assert got.ordered_ids(None, include_invalid=True) == expected.ordered_ids(None, include_invalid=True)
    assert got.keys(None, include_invalid=False).equals(expected.keys(None, include_invalid=False))
    assert got.live == expected.live


@dataclass
class Spilling:
    """A vector cache with room for about one user of ``rows`` memories, its spill, and its loads from "LanceDB"
    (``load``: the users loaded, in order)."""

    spill: VectorSpill
    cache: VectorCache
    rows: int
    loads: list[str] = field(default_factory=list)

    async def load(self, user: str) -> UserVectors:
        self.loads.append(user)
        return loaded(user, self.rows, seed=len(user))

    async def read(self, user: str) -> UserVectors:
        entry = await self.cache.get_or_load(user, lambda: self.load(user))
        assert entry is not None
        return entry


def spilling(root: Path, rows: int, room: float = 1.5, clock: Callable[[], float] = time.monotonic) -> Spilling:
    spill = VectorSpill(root, 2**30)
    cache = VectorCache(max_bytes=int(loaded("x", rows).nbytes * room), clock=clock, spill=spill)
    return Spilling(spill, cache, rows)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    n=st.integers(0, 60),
    edits=st.lists(st.tuples(st.integers(0, 80), st.booleans(), st.booleans()), max_size=30),
    removed=st.lists(st.integers(0, 80), max_size=40),
    touched=st.lists(st.integers(0, 80), max_size=20),
    read=st.lists(st.integers(0, 80), max_size=20),
    seed=st.integers(0, 2**16),
)
def test_a_spilled_entry_reads_back_as_it_was(
    tmp_path: Path,
    n: int,
    edits: list[tuple[int, bool, bool]],
    removed: list[int],
    touched: list[int],
    read: list[int],
    seed: int,
) -> None:
    """An entry loaded, then written to (records replaced or added, with or without word pieces, some made
    invalid), pruned, touched and read (records made from the loaded columns), written to a file and read back
    answers every read the same, and takes further writes the same."""
    entry = loaded("u", n, seed)
    for j, (i, invalid, with_pieces) in enumerate(edits):
        record = MemoryRecord(
            user_id="u", kind=_KINDS[j % 4], text=f"edit {j}", id=f"u-{i}", created_at=T0 + timedelta(minutes=j)
        )
        entry.upsert(
            record.replace(valid=not invalid), unit_rows(1, seed + j)[0], np.array([j]) if with_pieces else None
        )
    entry.remove([f"u-{i}" for i in removed])
    for i in touched:
        entry.touch(f"u-{i}", T0 + timedelta(days=3, microseconds=i))
    entry.patch([f"u-{i}" for i in touched[:3]], last_accessed_at=T0 + timedelta(days=9))
    # a patch of the access time with another field (a changed record), then an access time alone on some
    entry.patch([f"u-{i}" for i in touched[2:5]], last_accessed_at=T0 + timedelta(days=10), importance=9)
    entry.patch([f"u-{i}" for i in touched[4:6]], last_accessed_at=T0 + timedelta(days=11))
    entry.patch([f"u-{i}" for i in touched[:1]], last_accessed_at=T0 + timedelta(days=9), importance=5)  # no change
    entry.records([f"u-{i}" for i in read])
    ids = [f"u-{i}" for i in range(81)]

    path = tmp_path / f"{seed}.spill"
    write_parts(path, entry.spill_parts())
    back = UserVectors.from_spill("u", read_parts(path))
    assert_same(back, entry, ids, seed)
    more = records("u", 3, start=200)
    for target in (back, entry):
        for k, record in enumerate(more):
            target.upsert(record, unit_rows(1, seed + 100 + k)[0], np.array([k, k]))
        target.remove(ids[:5])
    assert_same(back, entry, ids + [r.id for r in more], seed)
    for target in (back, entry):  # the file's entry changed and written again reads back the same too
        target.patch(ids[5:9], last_accessed_at=T0 + timedelta(days=12))
    write_parts(path, back.spill_parts())
    again = UserVectors.from_spill("u", read_parts(path))
    assert_same(again, entry, ids + [r.id for r in more], seed)


def test_a_file_written_again_and_again_holds_only_its_live_rows(tmp_path: Path) -> None:
    """A user read back, touched and evicted again many times: each write keeps one row of columns a live
    record (the rows changed records replaced are dropped), in one chunk, and the entry's size stays put."""
    entry = loaded("u", 60)
    entry.remove(["u-0", "u-1"])
    path = tmp_path / "u.spill"
    sizes = []
    for cycle in range(6):
        ids = [f"u-{i}" for i in range(2 + cycle * 7, 12 + cycle * 7)]
        entry.records(ids[:4])  # some made, some not: both kinds of changed record
        entry.patch(ids, last_accessed_at=T0 + timedelta(days=cycle + 1))
        write_parts(path, entry.spill_parts())
        parts = read_parts(path)
        assert parts.columns is not None
        assert parts.columns.num_rows == entry.live == 58
        assert parts.columns.column(0).num_chunks == 1
        back = UserVectors.from_spill("u", parts)
        assert_same(back, entry, [f"u-{i}" for i in range(60)], cycle)
        entry = back
        sizes.append(entry.nbytes)
    assert max(sizes) == min(sizes)


@pytest.mark.parametrize("inline", [True, False], ids=["on-the-loop", "in-a-thread"])
async def test_an_evicted_user_is_read_back_from_the_spill_not_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, inline: bool
) -> None:
    """Past the RAM budget the least recently used user goes to the spill; their next read takes it from
    there (``spilled``), not from ``load``, and they hold what they held; the file stays theirs, and evicting
    them again writes nothing. A small file is read on the event loop, a large one in a thread."""
    threads: list[object] = []
    to_thread = vector_cache.asyncio.to_thread

    async def counted(func: Callable[..., object], *args: object) -> object:
        threads.append(func)
        return await to_thread(func, *args)

    monkeypatch.setattr(vector_cache.asyncio, "to_thread", counted)
    if not inline:
        monkeypatch.setattr(vector_cache, "INLINE_READ_BYTES", 0)
    setup = spilling(tmp_path / "spill", 100)
    spill, cache = setup.spill, setup.cache
    seen: list[str] = []
    cache.observe = seen.append
    await setup.read("a")
    await setup.read("b")  # a goes to the spill
    assert "a" not in cache
    assert "a" in spill
    assert len(list(spill.directory.iterdir())) == 1
    entry = await setup.read("a")
    assert setup.loads == ["a", "b"]
    assert seen == ["miss", "miss", "spilled"]
    assert_same(entry, loaded("a", 100, seed=1), [f"a-{i}" for i in range(100)], 0)
    assert "a" in spill  # still a's: only patches would change a while cached
    assert sorted(p.name for p in spill.directory.iterdir()) == ["1.spill", "2.spill"]  # b's written as a came back
    await setup.read("b")  # a evicted again: its file kept as it was
    assert sorted(p.name for p in spill.directory.iterdir()) == ["1.spill", "2.spill"]
    assert setup.loads == ["a", "b"]
    assert seen[-1] == "spilled"
    assert len(threads) == (0 if inline else 2)
    await cache.aclose()
    assert not spill.directory.exists()


async def test_writes_reach_spilled_users(tmp_path: Path) -> None:
    """A write to a spilled user (access times, a record written) is replayed when they are read back; a
    record deleted drops their file (their next read loads them from LanceDB); dropping or clearing deletes
    files."""
    setup = spilling(tmp_path / "spill", 50, room=1.6)
    spill, cache, loads, read = setup.spill, setup.cache, setup.loads, setup.read
    for user in ("a", "b", "c", "d"):
        await read(user)  # each evicts the one before to the spill
    assert {"a", "b", "c"} <= {u for u in ("a", "b", "c", "d") if u in spill}
    at = T0 + timedelta(days=30)
    cache.patch("a", ["a-1", "a-2"], last_accessed_at=at)
    (turn,) = records("b", 1, start=70)
    cache.upsert([turn], unit_rows(1, seed=7), [np.array([4, 5])])
    cache.remove("c", ["c-3"])
    assert "a" in spill
    assert "b" in spill
    assert "c" not in spill
    loads.clear()
    entry = await read("a")
    assert loads == []
    assert [r.last_accessed_at for r in entry.records(["a-1", "a-2", "a-3"])] == [at, at, None]
    cache.patch("a", ["a-4"], last_accessed_at=at)  # a patch of a cached user with a file: the file's too
    entry = await read("b")  # from its file, the new turn replayed
    assert loads == []
    assert entry.live == 51
    assert entry.records([turn.id]) == [turn]
    assert np.array_equal(entry.vector(turn.id), unit_rows(1, seed=7)[0])
    assert [list(p) if p is not None else None for p in entry.pieces_of([turn.id])] == [[4, 5]]
    (second,) = records("b", 1, start=71)
    cache.upsert([second], unit_rows(1, seed=8))  # b in RAM with a file: the file gets it too
    await read("c")
    assert loads == ["c"]
    loads.clear()
    entry = await read("b")  # b evicted again without a write, read back with both turns
    assert loads == []
    assert [r.id for r in entry.records([turn.id, second.id]) if r is not None] == [turn.id, second.id]
    loads.clear()
    entry = await read("a")  # from its file again, both patches replayed
    assert loads == []
    assert [r.last_accessed_at for r in entry.records(["a-1", "a-4", "a-5"])] == [at, at, None]
    files = len(list(spill.directory.iterdir()))
    assert files == len(spill) >= 2
    assert "d" in spill
    cache.drop("d")
    assert "d" not in spill
    assert len(list(spill.directory.iterdir())) == files - 1
    cache.clear()
    assert len(spill) == 0
    assert list(spill.directory.iterdir()) == []


async def test_a_file_that_cannot_be_read_falls_back_to_loading(tmp_path: Path) -> None:
    setup = spilling(tmp_path / "spill", 30)
    await setup.read("a")
    await setup.read("b")
    [path] = setup.spill.directory.iterdir()
    path.write_bytes(path.read_bytes()[:100])
    entry = await setup.read("a")
    assert entry.live == 30
    assert setup.loads == ["a", "b", "a"]
    assert not path.exists()


def test_the_spill_keeps_to_its_budget_dropping_the_oldest(tmp_path: Path) -> None:
    entries = {user: loaded(user, 40) for user in "abcde"}
    one = VectorSpill(tmp_path / "probe", 2**30)
    one.put("a", entries["a"])
    size = one.nbytes
    one.close()
    spill = VectorSpill(tmp_path / "spill", int(size * 3.5))
    for user, entry in entries.items():
        assert spill.put(user, entry)
    assert [u for u in "abcde" if u in spill] == ["c", "d", "e"]
    assert spill.nbytes <= spill.max_bytes
    assert len(list(spill.directory.iterdir())) == 3
    small = VectorSpill(tmp_path / "small", size // 2)
    assert not small.put("a", entries["a"])  # bigger than the whole budget: not written
    assert len(small) == 0


def test_directories_of_processes_gone_are_removed(tmp_path: Path) -> None:
    root = tmp_path / "spill"
    dead = root / "999999999"
    dead.mkdir(parents=True)
    (dead / "1.spill").write_bytes(b"x")
    alive = root / str(os.getppid())
    alive.mkdir()
    spill = VectorSpill(root, 2**30)
    spill.put("a", loaded("a", 5))
    assert not dead.exists()
    assert alive.exists()
    assert spill.directory.stat().st_mode & 0o777 == 0o700
    spill.close()
    assert not spill.directory.exists()


@pytest.mark.parametrize("n", [0, 1, 300])
def test_entries_of_any_size_round_trip(tmp_path: Path, n: int) -> None:
    entry = loaded("u", n)
    write_parts(tmp_path / "f", entry.spill_parts())
    back = UserVectors.from_spill("u", read_parts(tmp_path / "f"))
    assert_same(back, entry, [f"u-{i}" for i in range(n + 2)], n)


async def test_a_file_with_many_patches_is_written_again_and_one_with_too_many_dropped(tmp_path: Path) -> None:
    setup = spilling(tmp_path / "spill", 20)
    spill, cache = setup.spill, setup.cache
    for user in ("a", "b", "a"):
        await setup.read(user)
    first = spill.get("a")
    assert first is not None
    for i in range(REWRITE_AFTER + 1):
        cache.patch("a", ["a-1"], last_accessed_at=T0 + timedelta(days=i))
    await setup.read("b")  # a evicted with many patches: written again, none left
    again = spill.get("a")
    assert again is not None
    assert again.path != first.path
    assert not first.path.exists()
    assert again.patches == []
    for i in range(MAX_PATCHES + 1):
        cache.patch("a", ["a-2"], last_accessed_at=T0 + timedelta(days=i))
    assert "a" not in spill
    assert not again.path.exists()
    assert spill.patch_bytes == 0


async def test_the_patches_held_in_ram_stay_within_their_bound(tmp_path: Path) -> None:
    """Records written to spilled users are held in RAM until their file is read or written again: past
    ``MAX_PATCH_BYTES`` in all, the user written to loses their file (read from LanceDB next time)."""
    setup = spilling(tmp_path / "spill", 20)
    spill, cache = setup.spill, setup.cache
    for user in ("a", "b", "c"):
        await setup.read(user)
    assert {"a", "b"} <= set(u for u in ("a", "b") if u in spill)
    one = upsert_bytes(records("a", 1, start=30)[0], unit_rows(1)[0], None)  # "memory 3x": the same length
    with patch.object(vector_spill, "MAX_PATCH_BYTES", int(one * 2.5)):
        cache.upsert(records("a", 1, start=30), unit_rows(1))
        cache.upsert(records("b", 1, start=30), unit_rows(1))
        assert spill.patch_bytes == 2 * one
        cache.upsert(records("b", 1, start=31), unit_rows(1))  # past the bound: b's file goes with its patches
    assert "a" in spill
    assert "b" not in spill
    assert spill.patch_bytes == one
    await setup.read("a")
    await setup.read("b")
    assert setup.loads == ["a", "b", "c", "b"]


async def test_a_spill_that_cannot_write_leaves_reads_to_lancedb(tmp_path: Path) -> None:
    """A data directory the spill cannot write to (here its parent is a file) costs LanceDB loads, not reads."""
    blocker = tmp_path / "not-a-directory"
    blocker.write_bytes(b"")
    setup = spilling(blocker / "spill", 20)
    for user in ("a", "b", "a"):
        assert (await setup.read(user)).live == 20
    assert setup.loads == ["a", "b", "a"]
    assert len(setup.spill) == 0


async def test_users_released_idle_are_written_the_most_recent_first_up_to_a_bound(tmp_path: Path) -> None:
    """Releasing idle users writes files for the most recently read of them, up to ``RELEASE_WRITE_BYTES`` (the
    event loop is quiet, but hundreds of users at once would hold it up); the others keep a file that still
    holds them, or go without; an entry over ``MAX_WRITE_BYTES`` is never written."""
    clock = [100.0]
    setup = spilling(tmp_path / "spill", 20, room=4.5, clock=lambda: clock[0])
    spill, cache = setup.spill, setup.cache
    for user in ("a", "b", "c", "d"):  # all cached, none with a file
        await setup.read(user)
        clock[0] += 1
    assert len(spill) == 0
    clock[0] += 60
    size = cache.peek("d").nbytes  # type: ignore[union-attr]
    with patch.object(vector_cache, "RELEASE_WRITE_BYTES", int(size * 2.5)):
        assert cache.release_idle(20.0) == ["a", "b", "c", "d"]
    assert [u for u in "abcd" if u in spill] == ["c", "d"]
    assert len(cache) == 0
    with patch.object(vector_spill, "MAX_WRITE_BYTES", 1):
        assert not spill.put("e", loaded("e", 5))
    assert "e" not in spill


@pytest.mark.parametrize("keep", [0.0, 0.001, 0.5, 0.999])
def test_a_file_cut_short_anywhere_is_refused_not_mapped_past_its_end(tmp_path: Path, keep: float) -> None:
    path = tmp_path / "u.spill"
    write_parts(path, loaded("u", 40).spill_parts())
    whole = path.read_bytes()
    path.write_bytes(whole[: int(len(whole) * keep)])
    with pytest.raises(ValueError, match=r"cut short|not a vector spill file"):
        read_parts(path)


def test_a_file_written_over_leaves_the_entries_read_from_it_whole(tmp_path: Path) -> None:
    """An entry read back maps its file: writing that path again (renamed over it) leaves the mapping whole, and
    writes to the entry change its pages, not the file (... which reads back as written)."""
    path = tmp_path / "u.spill"
    entry = loaded("u", 40)
    write_parts(path, entry.spill_parts())
    back = UserVectors.from_spill("u", read_parts(path))
    write_parts(path, loaded("u", 3, seed=9).spill_parts())
    assert_same(back, entry, [f"u-{i}" for i in range(40)], 0)
    assert UserVectors.from_spill("u", read_parts(path)).live == 3
    write_parts(path, entry.spill_parts())
    again = UserVectors.from_spill("u", read_parts(path))
    for target in (again, entry):  # writes in place into the mapped arrays (private pages) ...
        target.upsert(records("u", 1, start=5)[0].replace(text="changed"), unit_rows(1, 3)[0])
        target.remove(["u-6"])
    assert_same(again, entry, [f"u-{i}" for i in range(40)], 1)
    assert_same(UserVectors.from_spill("u", read_parts(path)), loaded("u", 40), [f"u-{i}" for i in range(40)], 2)
