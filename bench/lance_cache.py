"""LanceDB's own caches under a busy write side (``bench/lance_cache.py``).

The write path commits many small appends (a few dozen turns each, 200 users) and compacts after
``store.optimize_after_commits`` of them; every commit is a LanceDB version. This runs that pattern through the
real store (LanceDB + Tantivy in a temporary directory, the shipped static embedder, a search every 50 commits)
twice on fresh stores: with ``store.lance_cache_bytes`` (the default, 64 MiB) and with a session of LanceDB's
own default sizes (6 GB of indexes, 1 GB of metadata; ``Session.default()``), each in a process of its own.
Every ``--every`` commits it prints the session's size (LanceDB's own accounting) and the process RSS
(anonymous and file-backed).

Writes ``bench/results/lance_cache.json``; prints the table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lancedb

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.store import sentence
from proxy.memory.embedders.factory import build_embedder
from proxy.memory.embedders.settings import EmbedderSettings
from proxy.memory.store.memory_store import MemoryStore, StoreSettings
from proxy.memory.store.records import Kind, MemoryRecord

RESULTS = Path(__file__).resolve().parent / "results" / "lance_cache.json"
VARIANTS = ("lance_cache_bytes_64MiB", "lancedb_default_session")


def rss() -> dict[str, int]:
    """This process's resident memory in MB: total, anonymous, file-backed."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return {key: int(fields[name].split()[0]) // 1024 for key, name in (("rss", "VmRSS"), ("anon", "RssAnon"),
                                                                         ("file", "RssFile"))}  # fmt: skip


async def run(commits: int, every: int, per_commit: int, variant: str) -> list[dict[str, Any]]:
    """Commit ``commits`` appends of ``per_commit`` turns; a row every ``every`` commits."""
    rng = random.Random(1)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="lance-cache-") as tmp:
        embedder = build_embedder(EmbedderSettings())
        async with embedder:
            store = MemoryStore(StoreSettings(path=Path(tmp)), embedder)
            if variant == "lancedb_default_session":  # LanceDB's Session.default() sizes, measurable
                store._lance.session = lancedb.Session(
                    index_cache_size_bytes=6 * 2**30, metadata_cache_size_bytes=2**30
                )
            session = store._lance.session
            async with store:
                started = time.perf_counter()
                for commit in range(commits):
                    user = f"user{commit % 200}"
                    await store.add([
                        MemoryRecord(user_id=user, kind=Kind.TURN, text=f"{sentence(rng)} {commit} {i}",
                                     conversation_id=f"c{commit}", role="user" if i % 2 == 0 else "assistant")
                        for i in range(per_commit)
                    ])  # fmt: skip
                    if commit % 50 == 0:
                        await store.vector_search(user, await embedder.embed_query("a walk in the park"), 5)
                        await store.keyword_search(user, "park", 5)
                    if (commit + 1) % every == 0:
                        rows.append({
                            "commits": commit + 1, "rows": (commit + 1) * per_commit,
                            "session_mb": round(session.size_bytes / 2**20, 1),
                            **{f"{key}_mb": value for key, value in rss().items()},
                            "seconds": round(time.perf_counter() - started, 1),
                        })  # fmt: skip
    return rows


def main() -> None:
    """Run both variants (each in a child process, so that RSS is its own), print the table, write the results."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--commits", type=int, default=3000)
    parser.add_argument("--every", type=int, default=300)
    parser.add_argument("--per-commit", type=int, default=20)
    parser.add_argument("--variant", choices=VARIANTS, help="run only this one and write its rows to --out")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.variant:  # the store logs on stdout: the rows go to a file
        args.out.write_text(json.dumps(asyncio.run(run(args.commits, args.every, args.per_commit, args.variant))))
        return
    sizes = ["--commits", str(args.commits), "--every", str(args.every), "--per-commit", str(args.per_commit)]
    document: dict[str, Any] = {"meta": {"python": platform.python_version(), "commits": args.commits}}
    for name in VARIANTS:
        print(f"[lance_cache] {name}", file=sys.stderr, flush=True)
        with tempfile.NamedTemporaryFile(suffix=".json") as rows:
            child = [sys.executable, __file__, *sizes, "--variant", name, "--out", rows.name]
            subprocess.run(child, stdout=subprocess.DEVNULL, check=True)
            document[name] = json.loads(Path(rows.name).read_text())
    print(f"{'variant':26} {'commits':>8} {'session MB':>11} {'RSS MB':>7} {'anon':>6} {'file':>6} {'s':>6}")
    for name in VARIANTS:
        for row in document[name]:
            print(f"{name:26} {row['commits']:8} {row['session_mb']:11.1f} {row['rss_mb']:7} {row['anon_mb']:6} "
                  f"{row['file_mb']:6} {row['seconds']:6.0f}")  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(document, indent=2) + "\n")


if __name__ == "__main__":
    main()
