"""How the read path scales (``make bench-scale``): latency and memory as a user's memories and the users grow.

Builds the real ``MemoryEngine`` like ``bench/readpath.py`` (default settings, local embedder, LanceDB + Tantivy
in a temporary directory, no memory-side model) and grows it in steps, measuring after each:

- ``memories_per_user``: one user grows 1k -> 10k -> 100k memories (``--sizes``). The first 10k are exactly
  ``bench/readpath.py``'s user (LoCoMo's turns inside the 14-day window, its facts, summaries, a few insights,
  older turns); past them come variants of those memories (every kind but insights): the text with a prefix
  (``"(day 17) ..."``), the cached vector plus small seeded Gaussian noise, re-normalised (cosine ~0.98 to the
  original), dated further back each round. So 100k memories need only LoCoMo's ~10k embedded texts.
- ``users``: 1 -> 10 -> 100 users (``--users``) of ``--user-memories`` (1k) memories each, each user a different
  slice of the same sequence; the first user is measured.

Each axis runs in its own process (fresh RSS, fresh query-embedding cache), each step adds only what is missing,
then runs ``store.optimize()`` (compaction, and the HNSW index once the table passes the store's
``ann_index_min_rows``) as the proxy's background loop would, and empties the measured user's read and vector
caches (as after a restart: a user grown by writes stays cached past the size a fresh load accepts). Then
sequential requests through ``MemoryEngine.inject`` (a system prompt and a LoCoMo question never asked before in
that process): the first request alone (it loads the user's vectors), ``--warmup`` more, then ``--requests``
measured: wall p50/p90/p99, CPU p50, arms that degraded (timed out or failed), and the process's RSS. Prints a
table and writes ``bench/results/scale.json`` with the growth factor of p50 and p99 from 10k to 100k memories
(target <= 2x).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.loadgen import rss_mb
from bench.locomo import CACHE, DATA, VectorCache, load_conversations
from bench.readpath import SYSTEM, NoModel, _percentiles, _records, _texts
from proxy.app import engine_settings
from proxy.config import Settings, load_settings
from proxy.engine import MemoryEngine
from proxy.memory.service import ReadRequest
from proxy.memory.store.records import Kind, MemoryRecord, new_id, utcnow
from proxy.memory.store.user_vectors import estimated_bytes

RESULTS = Path(__file__).resolve().parent / "results" / "scale.json"
BASE = 10_000  # memories of readpath.py's user; past them, variants
NOISE = 0.01  # per-component standard deviation of a variant's vector noise (unit vectors of dimension 384)
CHUNK = 2_000  # records per store.add
PREFIXES = ("(day {d}) ", "On day {d}: ", "[note {d}] ", "Earlier (day {d}): ")


class Corpus:
    """An endless, seeded sequence of memories: readpath.py's 10k, then noisy variants of them."""

    def __init__(self, base: Sequence[MemoryRecord], seed: int) -> None:
        self.base = list(base)
        self.source = [r for r in self.base if r.kind != Kind.INSIGHT]
        self.seed = seed

    def records(self, user_id: str, start: int, stop: int) -> list[MemoryRecord]:
        """Memories ``start`` to ``stop`` of the sequence, as ``user_id``'s (fresh ids)."""
        out = [dataclasses.replace(r, user_id=user_id, id=new_id()) for r in self.base[start:stop]]
        first = max(start, len(self.base))
        if stop > first:
            out += self._variants(user_id, first - len(self.base), stop - len(self.base))
        return out

    def _noise(self, start: int, stop: int, dim: int) -> np.ndarray:
        """Variant ``start`` to ``stop``'s noise, seeded per block of 1000: the same however the fill is chunked."""
        blocks = range(start // 1000, (stop - 1) // 1000 + 1)
        noise = np.concatenate(
            [np.random.default_rng((self.seed, b)).standard_normal((1000, dim), np.float32) for b in blocks]
        )
        return noise[start - blocks[0] * 1000 : stop - blocks[0] * 1000] * NOISE

    def _variants(self, user_id: str, start: int, stop: int) -> list[MemoryRecord]:
        originals = [self.source[j % len(self.source)] for j in range(start, stop)]
        vectors = np.stack([np.asarray(r.embedding, dtype=np.float32) for r in originals])
        vectors += self._noise(start, stop, vectors.shape[1])
        vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
        out = []
        for j, record, vector in zip(range(start, stop), originals, vectors, strict=True):
            round_ = j // len(self.source) + 1
            day = 1 + (j * 7919) % 3650
            out.append(
                dataclasses.replace(
                    record,
                    user_id=user_id,
                    id=new_id(),
                    text=PREFIXES[round_ % len(PREFIXES)].format(d=day) + record.text,
                    embedding=vector,
                    created_at=record.created_at - timedelta(days=45 * round_),
                    conversation_id=f"{record.conversation_id}-r{round_}" if record.conversation_id else None,
                )
            )
        return out


def _chunks(start: int, stop: int) -> Iterator[tuple[int, int]]:
    for at in range(start, stop, CHUNK):
        yield at, min(stop, at + CHUNK)


async def _corpus(engine: MemoryEngine, args: argparse.Namespace) -> Corpus:
    """The sequence, from LoCoMo's texts and their cached vectors (embedded now where missing)."""
    conversations = load_conversations(args.data)
    texts = _texts(conversations, json.loads(args.data.read_text()))
    cache = VectorCache(engine.embedder, None if args.no_cache else args.cache)
    every = list(dict.fromkeys(t for group in texts.values() for t, _ in group))
    vectors = dict(zip(every, await cache.embed(every, "embed memories"), strict=True))
    cache.save()
    return Corpus(_records("template", texts, vectors, utcnow(), BASE), args.seed)


async def _add(engine: MemoryEngine, corpus: Corpus, plan: list[tuple[str, int, int]], desc: str) -> float:
    """Add each (user, start, stop) slice of the sequence; returns the seconds it took."""
    started = time.perf_counter()
    with tqdm(total=sum(stop - start for _, start, stop in plan), desc=desc, unit="mem", file=sys.stderr) as bar:
        for user, start, stop in plan:
            for a, b in _chunks(start, stop):
                await engine.store.add(corpus.records(user, a, b))
                bar.update(b - a)
    return time.perf_counter() - started


async def _measure(engine: MemoryEngine, user: str, questions: Sequence[str], warmup: int) -> dict[str, Any]:
    """Sequential ``MemoryEngine.inject`` per question: the first alone, ``warmup`` more, then the measured."""
    wall, cpu, injected, degraded = [], [], 0, Counter[str]()
    first_ms = 0.0
    for i, question in enumerate(tqdm(questions, desc="  engine.inject", file=sys.stderr, leave=False)):
        body = {"messages": [SYSTEM, {"role": "user", "content": question}]}
        started, cpu_started = time.perf_counter(), time.process_time()
        result = await engine.inject(ReadRequest(user, f"scale-{i}", body["messages"]))
        ms = (time.perf_counter() - started) * 1000
        if i == 0:
            first_ms = ms
        if i <= warmup:
            continue
        wall.append(ms)
        cpu.append((time.process_time() - cpu_started) * 1000)
        injected += bool(result.injected_ids)
        degraded.update(f"{arm}:{reason}" for arm, reason in result.degraded.items())
    p, c = _percentiles(wall), _percentiles(cpu)
    return {
        "requests": len(wall),
        "p50_ms": p["p50"],
        "p90_ms": p["p90"],
        "p99_ms": p["p99"],
        "max_ms": p["max"],
        "cpu_p50_ms": c["p50"],
        "first_request_ms": round(first_ms, 1),
        "with_memory_block": injected,
        "degraded_arms": dict(degraded),
    }


class Questions:
    """Distinct LoCoMo questions handed out in order, so that no query embedding is a cache hit."""

    def __init__(self, data: Path) -> None:
        self._all = list(dict.fromkeys(q.text for c in load_conversations(data) for q in c.questions))
        self._next = 0
        self.reused = False

    def take(self, n: int) -> list[str]:
        """The next ``n`` questions (wrapping around, and noting it, when they run out)."""
        out = [self._all[(self._next + i) % len(self._all)] for i in range(n)]
        self._next += n
        self.reused = self.reused or self._next > len(self._all)
        return out


async def _step(
    engine: MemoryEngine, settings: Settings, user: str, rows: int, questions: Questions, args: argparse.Namespace
) -> dict[str, Any]:
    """Optimize, then measure ``user``; the store holds ``rows`` in all."""
    started = time.perf_counter()
    await engine.store.optimize()
    optimize_s = time.perf_counter() - started
    engine.names.invalidate(user)
    engine.store.cache.drop(user)  # as after a restart: grown by writes, a cached user may outgrow the cache's check
    measured = await _measure(engine, user, questions.take(1 + args.warmup + args.requests), args.warmup)
    return {
        "table_rows": rows,
        "optimize_s": round(optimize_s, 2),
        "ann_index": rows >= settings.store.ann_index_min_rows,
        **measured,
        "rss_mb": round(rss_mb(os.getpid()), 1),
    }


async def _memories_axis(
    engine: MemoryEngine, settings: Settings, corpus: Corpus, args: argparse.Namespace
) -> list[dict[str, Any]]:
    rows, have, questions = [], 0, Questions(args.data)
    for size in sorted(args.sizes):
        fill_s = await _add(engine, corpus, [("scale-user", have, size)], f"fill to {size} memories")
        have = size
        fits = estimated_bytes(size, engine.embedder.dim) <= settings.store.vector_cache_bytes
        row = {
            "axis": "memories_per_user",
            "memories_per_user": size,
            "users": 1,
            "fill_s": round(fill_s, 1),
            "vector_cache": "fits" if fits else "too big: LanceDB search",
        }
        rows.append(row | await _step(engine, settings, "scale-user", size, questions, args))
        _progress(rows[-1])
    return rows


async def _users_axis(
    engine: MemoryEngine, settings: Settings, corpus: Corpus, args: argparse.Namespace
) -> list[dict[str, Any]]:
    rows, have, questions, m = [], 0, Questions(args.data), args.user_memories
    for users in sorted(args.users):
        plan = [("scale-user" if u == 0 else f"scale-user-{u}", u * m, (u + 1) * m) for u in range(have, users)]
        fill_s = await _add(engine, corpus, plan, f"fill to {users} users")
        have = users
        row = {"axis": "users", "memories_per_user": m, "users": users, "fill_s": round(fill_s, 1)}
        rows.append(row | await _step(engine, settings, "scale-user", users * m, questions, args))
        _progress(rows[-1])
    return rows


def _progress(row: dict[str, Any]) -> None:
    print(
        f"  {row['axis']}: {row['memories_per_user']} x {row['users']}: fill {row['fill_s']} s, optimize "
        f"{row['optimize_s']} s, p50 {row['p50_ms']} ms, p99 {row['p99_ms']} ms, rss {row['rss_mb']} MB",
        file=sys.stderr,
    )


def _overrides(pairs: Sequence[str]) -> dict[str, str]:
    return dict(pair.split("=", 1) for pair in pairs)


async def _axis(args: argparse.Namespace) -> dict[str, Any]:
    """One axis in this process: its rows and what it ran with."""
    with tempfile.TemporaryDirectory(prefix="scale-") as tmp:
        overrides = {"storage": {"path": tmp}, "retrieval": _overrides(args.retrieval), "store": _overrides(args.store)}
        settings = load_settings(None, environ={}, overrides=overrides)
        async with MemoryEngine(engine_settings(settings), NoModel()) as engine:
            corpus = await _corpus(engine, args)
            run = _memories_axis if args.axis == "memories" else _users_axis
            rows = await run(engine, settings, corpus, args)
    return {
        "rows": rows,
        "settings": {
            "retrieval": settings.retrieval.model_dump(mode="json"),
            "store": settings.store.model_dump(mode="json"),
            "embedder": settings.embedder.model_dump(mode="json"),
        },
    }


def _growth(rows: list[dict[str, Any]], axis: str, key: str, low: int, high: int) -> dict[str, Any] | None:
    """p50 and p99 at ``high`` over those at ``low`` along one axis (None when either was not run)."""
    by = {r[key]: r for r in rows if r["axis"] == axis}
    if low not in by or high not in by:
        return None
    a, b = by[low], by[high]
    return {
        "from": low,
        "to": high,
        "p50": round(b["p50_ms"] / a["p50_ms"], 2),
        "p99": round(b["p99_ms"] / a["p99_ms"], 2),
        "target": "<= 2x" if (axis, low, high) == ("memories_per_user", 10_000, 100_000) else None,
    }


def _run_axes(args: argparse.Namespace, axes: Sequence[str]) -> list[dict[str, Any]]:
    """Each axis in a child process (its own RSS and caches); their documents."""
    documents = []
    with tempfile.TemporaryDirectory(prefix="scale-out-") as tmp:
        for axis in axes:
            out = Path(tmp) / f"{axis}.json"
            command = [sys.executable, __file__, *sys.argv[1:], "--axis", axis, "--out", str(out), "--child"]
            subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
            documents.append(json.loads(out.read_text()))
    return documents


def _document(
    args: argparse.Namespace, documents: list[dict[str, Any]], load_before: float, started: float
) -> dict[str, Any]:
    rows = [row for d in documents for row in d["rows"]]
    low, high = min(args.sizes), max(args.sizes)
    return {
        "rows": rows,
        "growth_10k_to_100k": _growth(rows, "memories_per_user", "memories_per_user", 10_000, 100_000),
        "growth_memories": _growth(rows, "memories_per_user", "memories_per_user", low, high),
        "growth_users": _growth(rows, "users", "users", min(args.users), max(args.users)),
        "meta": {
            "requests": args.requests,
            "warmup": args.warmup,
            "sizes": sorted(args.sizes),
            "users": sorted(args.users),
            "user_memories": args.user_memories,
            "variant_noise": NOISE,
            "seed": args.seed,
            "retrieval_overrides": _overrides(args.retrieval),
            "store_overrides": _overrides(args.store),
            **(documents[0]["settings"] if documents else {}),
            "python": platform.python_version(),
            "machine": f"{platform.machine()}, {os.cpu_count()} cpus",
            "load_before": round(load_before, 2),
            "load_after": round(os.getloadavg()[0], 2),
            "seconds": round(time.perf_counter() - started, 1),
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
        },
    }


def _print(document: dict[str, Any]) -> None:
    print(
        f"{'axis':<18}{'mem/user':>9}{'users':>6}{'rows':>8}{'p50 ms':>9}{'p90 ms':>9}{'p99 ms':>9}{'cpu50':>8}"
        f"{'first':>8}{'RSS MB':>8}{'fill s':>8}{'opt s':>7}  degraded"
    )
    for r in document["rows"]:
        degraded = ",".join(f"{k}:{v}" for k, v in r["degraded_arms"].items()) or "-"
        print(
            f"{r['axis']:<18}{r['memories_per_user']:>9}{r['users']:>6}{r['table_rows']:>8}{r['p50_ms']:>9.2f}"
            f"{r['p90_ms']:>9.2f}{r['p99_ms']:>9.2f}{r['cpu_p50_ms']:>8.2f}{r['first_request_ms']:>8.0f}"
            f"{r['rss_mb']:>8.0f}{r['fill_s']:>8.1f}{r['optimize_s']:>7.1f}  {degraded}"
        )
    for name in ("growth_10k_to_100k", "growth_memories", "growth_users"):
        g = document[name]
        if g:
            print(
                f"{name}: {g['from']} -> {g['to']}: p50 x{g['p50']}, p99 x{g['p99']}"
                + (f" (target {g['target']})" if g["target"] else "")
            )
    meta = document["meta"]
    print(
        f"load average {meta['load_before']} before, {meta['load_after']} after, {meta['machine']}, {meta['seconds']} s"
    )


def main() -> None:
    """Run the benchmark (each axis in a child process), print the table, write the results."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=DATA, help="LoCoMo-layout file the memories come from")
    parser.add_argument(
        "--sizes",
        type=int,
        nargs="+",
        default=[1_000, 10_000, 100_000],
        help="memories of the measured user, one step each",
    )
    parser.add_argument("--users", type=int, nargs="+", default=[1, 10, 100], help="users, one step each")
    parser.add_argument("--user-memories", type=int, default=1_000, help="memories of each user on the users axis")
    parser.add_argument("--axis", choices=["both", "memories", "users"], default="both", help="which axes to run")
    parser.add_argument("--requests", type=int, default=200, help="measured requests per step")
    parser.add_argument("--warmup", type=int, default=20, help="requests before measuring, after the first")
    parser.add_argument("--seed", type=int, default=17, help="seed of the variants' vector noise")
    parser.add_argument("--cache", type=Path, default=CACHE, help="directory of the embedding cache")
    parser.add_argument("--no-cache", action="store_true", help="embed everything afresh, store nothing")
    parser.add_argument(
        "--retrieval",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="override [retrieval] settings, e.g. dense_k=50 (default: the defaults)",
    )
    parser.add_argument(
        "--store",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="override [store] settings, e.g. vector_cache_bytes=536870912 (default: the defaults)",
    )
    parser.add_argument("--out", type=Path, default=RESULTS, help="where to write the results")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        args.out.write_text(json.dumps(asyncio.run(_axis(args))))
        return
    load_before, started = os.getloadavg()[0], time.perf_counter()
    axes = ["memories", "users"] if args.axis == "both" else [args.axis]
    document = _document(args, _run_axes(args, axes), load_before, started)
    _print(document)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(document, indent=2) + "\n")


if __name__ == "__main__":
    main()
