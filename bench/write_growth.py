"""What one store write costs as the table grows, and what keeps it flat (``bench/write_growth.py``).

The write path's commits look like this under a busy chat: many small appends (the turns of a few dozen
exchanges each). Each append makes a LanceDB fragment; until a compaction folds them, LanceDB's id check of a
write (is this id stored, and whose) walks every one of them. Three variants, each on a fresh store (real
LanceDB + Tantivy in a temporary directory, vectors given, 200 users), ``--rows`` rows in appends of
``--per-append`` records:

- ``shipped``: the defaults (a compaction after ``store.optimize_after_commits`` appends; LanceDB is asked only
  about ids the keyword index holds);
- ``lance_id_check``: the same, but every id checked in LanceDB (as a shared table on object storage does);
- ``interval_only``: every id checked in LanceDB and no compaction before ``optimize_interval_s`` (300 s: none
  within the run), the store's behaviour before compaction by count.

Per window of appends: p50 / p99 / max ms of one ``store.add`` (a compaction shows as the max: it holds the
write lock). Then one write of access times (``touch``) of ``--touched`` records on the shipped store.

Writes ``bench/results/write_growth.json``; prints the table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import sys
import tempfile
import time
from itertools import zip_longest
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.store import DIM, progress, records_for, summary, unit_vectors
from proxy.memory.store.memory_store import MemoryStore, StoreSettings
from proxy.memory.store.records import MemoryRecord
from tests.support.embedder import HashingEmbedder

RESULTS = Path(__file__).resolve().parent / "results" / "write_growth.json"
USERS = 200
VARIANTS = ("shipped", "lance_id_check", "interval_only")


def workload(rows: int, seed: int = 0) -> list[MemoryRecord]:
    """``rows`` records of 200 users, interleaved as a chat load writes them."""
    rng = random.Random(seed)
    vectors = unit_vectors(-(-rows // USERS) * USERS, np.random.default_rng(seed))
    per_user = -(-rows // USERS)
    by_user = [records_for(f"user{u}", per_user, rng, vectors[u * per_user :]) for u in range(USERS)]
    return [record for turn in zip_longest(*by_user) for record in turn if record is not None][:rows]


async def run_variant(
    variant: str, records: list[MemoryRecord], per_append: int, window: int, touched: int
) -> dict[str, Any]:
    """Append ``records`` ``per_append`` at a time; the add latency per window of ``window`` appends."""
    overrides = {"optimize_after_commits": 10**9} if variant == "interval_only" else {}
    with tempfile.TemporaryDirectory(prefix="memproxy-write-growth-") as tmp:
        settings = StoreSettings(path=Path(tmp), **overrides)
        async with MemoryStore(settings, HashingEmbedder(dim=DIM, model_id="bench/synthetic")) as store:
            if variant != "shipped":
                store.writes.maybe_stored = lambda ids: ids  # type: ignore[method-assign]
            windows, current = [], []
            for start in range(0, len(records), per_append):
                began = time.perf_counter()
                await store.add(records[start : start + per_append])
                current.append((time.perf_counter() - began) * 1000)
                if len(current) == window:
                    windows.append({"rows": start + per_append, **summary(current), "max_ms": round(max(current), 1)})
                    current = []
            progress(f"{variant}: {len(records)} rows, last window p50 {windows[-1]['p50_ms']} ms")
            touch = await touch_cost(store, records, touched) if variant == "shipped" else None
    return {"windows": windows, "touch": touch}


async def touch_cost(store: MemoryStore, records: list[MemoryRecord], touched: int) -> dict[str, Any]:
    """One write of access times for ``touched`` records (as the touch ticker makes it)."""
    picked = random.Random(1).sample(records, min(touched, len(records)))
    for record in picked:
        await store.touch(record.user_id, [record.id])
    began = time.perf_counter()
    await store.writes.flush_touches()  # what the ticker runs every store.touch_flush_s
    return {"records": len(picked), "seconds": round(time.perf_counter() - began, 3)}


def print_table(result: dict[str, Any]) -> None:
    """Per variant, each window's add p50 / p99 / max."""
    print(f"\nms per store.add of {result['meta']['per_append']} records, by table size")
    for variant, data in result["variants"].items():
        print(f"{variant:15s}", "  ".join(f"{w['rows']:>6}: {w['p50_ms']:6.1f} /{w['p99_ms']:7.1f} /{w['max_ms']:7.1f}"
                                          for w in data["windows"][:: max(1, len(data["windows"]) // 6)]))  # fmt: skip
    touch = result["variants"]["shipped"]["touch"]
    print(f"touch write of {touch['records']} records at {result['meta']['rows']} rows: {touch['seconds']} s")


async def main(args: argparse.Namespace) -> dict[str, Any]:
    records = workload(args.rows)
    variants = {}
    for variant in args.variants:
        variants[variant] = await run_variant(variant, records, args.per_append, args.window, args.touched)
    machine = f"{platform.machine()}, {os.cpu_count()} cpus, load {os.getloadavg()[0]:.1f}"
    meta = {"rows": args.rows, "per_append": args.per_append, "window_appends": args.window, "users": USERS,
            "python": platform.python_version(), "machine": machine}  # fmt: skip
    return {"meta": meta, "variants": variants}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=40_000)
    parser.add_argument("--per-append", type=int, default=32, help="records per store.add (16 exchanges' turns)")
    parser.add_argument("--window", type=int, default=100, help="appends per row of the table")
    parser.add_argument("--touched", type=int, default=10_000, help="records whose access time one touch writes")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--out", type=Path, default=RESULTS)
    return parser.parse_args()


if __name__ == "__main__":
    arguments = parse_args()
    outcome = asyncio.run(main(arguments))
    arguments.out.write_text(json.dumps(outcome, indent=2) + "\n")
    print_table(outcome)
