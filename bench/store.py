"""Memory store benchmark (``make bench-store``): ingest, search latency, cache, forget, RSS.

Phases, each on real LanceDB + Tantivy in a temporary directory:

1. Ingest with embedding (the shipped local model when present): turns/s for batched adds (callers adding
   64 turns at once) and for chat-shaped adds (many callers adding the 2 turns of one exchange each).
2. Ingest without embedding (vectors given): turns/s through the same batch writer.
3. A corpus of one user with 1k, one with 10k and one with 100k memories among background users
   (realistic-ish random sentences; synthetic unit vectors, since embedding is excluded from search
   timings). Per size: vector search (cache hit, cache miss, LanceDB path), keyword search, and both arms
   together (``asyncio.gather`` of the two, as the read path runs them), p50/p99.
4. Forget a 10k-memory user: in a store of 10k + background, and in the full corpus.
5. The retention sweep on what is left of the corpus (the 100k user and the background users): with nothing
   due, and the first sweep of a 30-day turn retention 60 days after the corpus starts.

Prints a table and writes ``bench/results/store.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from proxy.memory.embedders.protocol import Embedder
from proxy.memory.events import NoEvents
from proxy.memory.retention import RetentionSweeper
from proxy.memory.store.memory_store import MemoryStore, StoreSettings
from proxy.memory.store.records import Kind, MemoryRecord
from tests.support.embedder import HashingEmbedder

RESULTS = Path(__file__).resolve().parent / "results" / "store.json"
DIM = 384
T0 = datetime(2025, 1, 1, tzinfo=UTC)

SUBJECTS = ["I", "My sister", "My boss", "We", "Our team", "My doctor", "The landlord", "My partner", "Grandma"]
VERBS = [
    "booked",
    "cancelled",
    "recommended",
    "bought",
    "returned",
    "visited",
    "cooked",
    "fixed",
    "planned",
    "forgot",
    "painted",
    "ordered",
    "rescheduled",
    "tried",
    "loved",
    "hated",
    "borrowed",
    "sold",
]
OBJECTS = [
    "a table for four",
    "the dentist appointment",
    "a new laptop",
    "tickets to the opera",
    "the garden shed",
    "a vegan lasagna",
    "the flight to Lisbon",
    "a yoga class",
    "the quarterly report",
    "a used bicycle",
    "the birthday cake",
    "a hiking trip",
    "the kitchen sink",
    "a violin lesson",
    "the car insurance",
    "a pottery workshop",
    "the wedding playlist",
    "a sourdough starter",
    "the tax return",
    "a puppy",
]
PLACES = [
    "in Berlin",
    "near the station",
    "at the office",
    "downtown",
    "at home",
    "in Seoul",
    "by the lake",
    "at the farmers market",
    "in Kyoto",
    "on the island",
    "at the clinic",
    "in the suburbs",
]
TIMES = [
    "yesterday",
    "last weekend",
    "on Monday",
    "this morning",
    "in March",
    "after work",
    "before the holidays",
    "next Friday",
    "two weeks ago",
    "during the storm",
    "on my birthday",
    "at midnight",
]
EXTRAS = [
    "because it was cheaper",
    "and it went well",
    "but it rained",
    "with Tom",
    "for the first time",
    "again",
    "to save money",
    "as a surprise",
    "after a long debate",
    "without telling anyone",
]


def sentence(rng: random.Random) -> str:
    """A plausible first-person memory."""
    parts = [rng.choice(SUBJECTS), rng.choice(VERBS), rng.choice(OBJECTS), rng.choice(PLACES), rng.choice(TIMES)]
    if rng.random() < 0.6:
        parts.append(rng.choice(EXTRAS))
    return " ".join(parts) + f" (note {rng.randrange(10**6)})"


def unit_vectors(n: int, rng: np.random.Generator) -> np.ndarray:
    """Clustered unit vectors (200 topics plus noise), closer to real embeddings than pure noise."""
    centres = rng.standard_normal((200, DIM)).astype(np.float32)
    rows = centres[rng.integers(0, 200, n)] + 0.8 * rng.standard_normal((n, DIM)).astype(np.float32)
    return rows / np.linalg.norm(rows, axis=1, keepdims=True)


def records_for(user: str, n: int, rng: random.Random, vectors: np.ndarray | None) -> list[MemoryRecord]:
    """``n`` memories of ``user`` (turns and facts), with vectors when given."""
    out = []
    for i in range(n):
        kind = Kind.TURN if i % 3 else Kind.FACT
        out.append(
            MemoryRecord(
                user_id=user,
                kind=kind,
                text=sentence(rng),
                created_at=T0 + timedelta(minutes=i),
                embedding=vectors[i] if vectors is not None else None,
            )
        )
    return out


_STARTED = time.perf_counter()


def progress(message: str) -> None:
    """A progress line on stderr (the table goes to stdout at the end)."""
    print(f"[{time.perf_counter() - _STARTED:7.1f}s] {message}", file=sys.stderr, flush=True)


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (nearest rank)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))]


def summary(values_ms: list[float]) -> dict[str, float]:
    """p50/p99/mean in milliseconds."""
    return {
        "p50_ms": round(percentile(values_ms, 50), 3),
        "p99_ms": round(percentile(values_ms, 99), 3),
        "mean_ms": round(statistics.fmean(values_ms), 3),
        "n": len(values_ms),
    }


async def timed(fn: Callable[[], Awaitable[Any]]) -> float:
    """Milliseconds one call takes."""
    start = time.perf_counter()
    await fn()
    return (time.perf_counter() - start) * 1000


def rss_mb() -> dict[str, float]:
    """Current and peak resident memory of this process."""
    status = Path("/proc/self/status").read_text().splitlines()
    fields = {line.split(":")[0]: line.split()[1] for line in status if line.startswith(("VmRSS", "VmHWM"))}
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"rss_mb": round(int(fields.get("VmRSS", 0)) / 1024, 1), "peak_rss_mb": round(peak, 1)}


def local_embedder() -> Embedder | None:
    """The shipped local model, if its files are present."""
    try:
        from proxy.memory.embedders.factory import build_embedder
        from proxy.memory.embedders.settings import EmbedderSettings

        return build_embedder(EmbedderSettings())
    except Exception as exc:  # no model files: report ingest without real embedding only
        print(f"local embedder unavailable ({exc}); skipping embedding-included ingest")
        return None


class FixedDimEmbedder(HashingEmbedder):
    """For the corpus stores: every record arrives with its vector, queries are given as vectors."""

    def __init__(self) -> None:
        super().__init__(dim=DIM, model_id="bench/synthetic-384")


# --- phases --------------------------------------------------------------------------------------------


async def ingest_with_embedding(root: Path, embedder: Embedder, turns: int) -> dict[str, Any]:
    """Turns/s with the real embedder, batched and chat-shaped, and the model's per-query latency."""
    rng = random.Random(1)
    if hasattr(embedder, "start"):
        await embedder.start()
    query_ms = [await timed(lambda: embedder.embed_query(sentence(rng))) for _ in range(100)]
    out: dict[str, Any] = {"model_id": embedder.model_id, "embed_query": summary(query_ms)}
    async with MemoryStore(StoreSettings(path=root / "embed"), embedder) as store:
        batched = records_for("ingest-a", turns, rng, None)
        out["batched"] = await _ingest(store, batched, per_call=64, callers=4)
        chat = records_for("ingest-b", turns // 2, rng, None)
        out["chat_shaped"] = await _ingest(store, chat, per_call=2, callers=64)
    return out


async def _ingest(store: MemoryStore, records: list[MemoryRecord], per_call: int, callers: int) -> dict[str, Any]:
    calls = [records[i : i + per_call] for i in range(0, len(records), per_call)]
    queue: asyncio.Queue[list[MemoryRecord]] = asyncio.Queue()
    for call in calls:
        queue.put_nowait(call)

    async def caller() -> None:
        while not queue.empty():
            await store.add(queue.get_nowait())

    start = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(callers)))
    seconds = time.perf_counter() - start
    return {
        "turns": len(records),
        "per_call": per_call,
        "callers": callers,
        "seconds": round(seconds, 2),
        "turns_per_s": round(len(records) / seconds, 1),
    }


async def build_corpus(
    path: Path, sizes: list[int], background_users: int, background_size: int, timed_rows: int, ann_min_rows: int
) -> dict[str, Any]:
    """Load the search corpus; the first ``timed_rows`` through the default writer settings, timed.

    ``store.optimize()`` compacts, adds the scalar indexes and, past ``ann_min_rows``, builds HNSW-SQ.
    """
    rng, nrng = random.Random(2), np.random.default_rng(2)
    users = [(f"user-{size}", size) for size in sizes]
    users += [(f"background-{i}", background_size) for i in range(background_users)]
    everything: list[MemoryRecord] = []
    for user, size in users:
        everything.extend(records_for(user, size, rng, unit_vectors(size, nrng)))
    random.Random(3).shuffle(everything)
    timed_part, bulk = everything[:timed_rows], everything[timed_rows:]
    progress(f"  {len(everything)} records generated")
    async with MemoryStore(StoreSettings(path=path), FixedDimEmbedder()) as store:
        no_embed = await _ingest(store, timed_part, per_call=64, callers=4)
    progress(f"  {no_embed}")
    settings = StoreSettings(path=path, flush_max_rows=8192, ann_index_min_rows=ann_min_rows)
    async with MemoryStore(settings, FixedDimEmbedder()) as store:
        start = time.perf_counter()
        for i in range(0, len(bulk), 8192):
            await store.add(bulk[i : i + 8192])
        bulk_s = time.perf_counter() - start
        progress(f"  bulk load {bulk_s:.1f}s")
        start = time.perf_counter()
        await store.optimize()
        optimize_s = time.perf_counter() - start
        progress(f"  optimize {optimize_s:.1f}s")
        total = await store.count()
    return {
        "users": dict(users),
        "total_rows": total,
        "ingest_no_embedding": no_embed,
        "bulk_load_rows_per_s": round(len(bulk) / max(bulk_s, 1e-9), 1),
        "optimize_s": round(optimize_s, 2),
    }


async def search_latencies(path: Path, sizes: list[int], queries: int, cache_bytes: int) -> dict[str, Any]:
    """Per user size: cache miss, cache hit, keyword and both-arms latencies."""
    out: dict[str, Any] = {}
    settings = StoreSettings(path=path, ann_index_min_rows=10**12, vector_cache_bytes=cache_bytes)
    async with MemoryStore(settings, FixedDimEmbedder()) as store:
        for size in sizes:
            out[str(size)] = await _search_one(store, f"user-{size}", queries)
            progress(f"  {size}: {out[str(size)]['both_arms']}")
        out["cache"] = {"hits": store.cache.hits, "misses": store.cache.misses, "bytes": store.cache.nbytes}
    return out


async def _queries(store: MemoryStore, user: str, n: int) -> list[tuple[np.ndarray, str]]:
    page = await store.list(user, limit=n)
    nrng, rng = np.random.default_rng(4), random.Random(4)
    pairs = []
    for record in page.data:
        vector = np.asarray(record.embedding, dtype=np.float32) + 0.3 * nrng.standard_normal(DIM).astype(np.float32)
        words = record.text.split()
        text = " ".join([*rng.sample(words, min(4, len(words))), rng.choice(VERBS)])
        pairs.append((vector / np.linalg.norm(vector), text))
    return pairs


async def _search_one(store: MemoryStore, user: str, queries: int) -> dict[str, Any]:
    """Vector, keyword and both-arms latencies, interleaved query by query so load drift hits all alike."""
    pairs = await _queries(store, user, queries)
    miss_ms = await timed(lambda: store.vector_search(user, pairs[0][0], 10))
    vector: list[float] = []
    keyword: list[float] = []
    both: list[float] = []
    for v, t in pairs:
        vector.append(await timed(lambda v=v: store.vector_search(user, v, 10)))
        keyword.append(await timed(lambda t=t: store.keyword_search(user, t, 10)))
        both.append(
            await timed(
                lambda v=v, t=t: asyncio.gather(store.vector_search(user, v, 10), store.keyword_search(user, t, 10))
            )
        )
    return {
        "cache_miss_first_search_ms": round(miss_ms, 2),
        "vector_cached": summary(vector),
        "keyword": summary(keyword),
        "both_arms": summary(both),
    }


async def lancedb_path_latencies(path: Path, sizes: list[int], queries: int) -> dict[str, Any]:
    """Vector search without the cache (LanceDB, filtered by user, prefilter; HNSW-SQ if built)."""
    out: dict[str, Any] = {}
    settings = StoreSettings(path=path, vector_cache_bytes=0, ann_index_min_rows=10**12)
    async with MemoryStore(settings, FixedDimEmbedder()) as store:
        for size in sizes:
            pairs = await _queries(store, f"user-{size}", queries)
            await store.vector_search(f"user-{size}", pairs[0][0], 10)
            runs = [await timed(lambda v=v, s=size: store.vector_search(f"user-{s}", v, 10)) for v, _ in pairs]
            out[str(size)] = summary(runs)
    return out


async def forget_latency(root: Path, background_users: int, background_size: int) -> dict[str, Any]:
    """Forget a 10k-memory user in a store of that user plus background users."""
    path = root / "forget"
    rng, nrng = random.Random(5), np.random.default_rng(5)
    everything = records_for("forget-me", 10_000, rng, unit_vectors(10_000, nrng))
    for i in range(background_users):
        everything += records_for(f"other-{i}", background_size, rng, unit_vectors(background_size, nrng))
    random.Random(6).shuffle(everything)
    async with MemoryStore(StoreSettings(path=path, flush_max_rows=8192), FixedDimEmbedder()) as store:
        for i in range(0, len(everything), 8192):
            await store.add(everything[i : i + 8192])
        await store.optimize()
        await store.vector_search("forget-me", np.asarray(everything[0].embedding), 5)
        total = await store.count()
        start = time.perf_counter()
        counts = await store.forget_user("forget-me")
        seconds = time.perf_counter() - start
    return {"forgotten": sum(counts.values()), "table_rows_before": total, "seconds": round(seconds, 3)}


async def forget_deferred(path: Path, size: int) -> dict[str, Any]:
    """Forget the ``size`` user of the corpus without purging, then time the purge on its own."""
    async with MemoryStore(StoreSettings(path=path, ann_index_min_rows=10**12), FixedDimEmbedder()) as store:
        total = await store.count()
        start = time.perf_counter()
        counts = await store.forget_user(f"user-{size}", purge=False)
        seconds = time.perf_counter() - start
        start = time.perf_counter()
        await store.optimize()
        purge_s = time.perf_counter() - start
    return {
        "forgotten": sum(counts.values()),
        "table_rows_before": total,
        "seconds": round(seconds, 3),
        "purge_at_next_optimize_s": round(purge_s, 3),
    }


async def forget_in_corpus(path: Path, size: int) -> dict[str, Any]:
    """Forget the ``size`` user of the full corpus (the purge rewrites what shares its data files)."""
    async with MemoryStore(StoreSettings(path=path, ann_index_min_rows=10**12), FixedDimEmbedder()) as store:
        total = await store.count()
        start = time.perf_counter()
        counts = await store.forget_user(f"user-{size}")
        seconds = time.perf_counter() - start
    return {"forgotten": sum(counts.values()), "table_rows_before": total, "seconds": round(seconds, 3)}


async def retention_sweep(path: Path) -> dict[str, Any]:
    """The retention sweep on the corpus: once with nothing due (its periodic cost), then with a 30-day turn
    retention at a clock 60 days after the corpus starts (the first sweep of a store that turned it on)."""
    settings = StoreSettings(path=path, ann_index_min_rows=10**12)
    async with MemoryStore(settings, FixedDimEmbedder()) as store:
        total = await store.count()
        idle = RetentionSweeper(store, NoEvents(), 0, clock=lambda: T0 + timedelta(days=60))
        start = time.perf_counter()
        await idle.sweep()
        idle_s = time.perf_counter() - start
        due = RetentionSweeper(store, NoEvents(), 30, clock=lambda: T0 + timedelta(days=60))
        start = time.perf_counter()
        counts = await due.sweep()
        seconds = time.perf_counter() - start
    return {"table_rows_before": total, "idle_s": round(idle_s, 3), "deleted": counts, "seconds": round(seconds, 3)}


# --- report --------------------------------------------------------------------------------------------


def print_table(result: dict[str, Any]) -> None:
    """The human-readable summary."""
    print("\nmemory store bench", result["machine"])
    ing = result["detail"]["ingest"]
    if "with_embedding" in ing:
        emb = ing["with_embedding"]
        print(
            f"  embed_query ({emb['model_id']}): p50 {emb['embed_query']['p50_ms']} ms, "
            f"p99 {emb['embed_query']['p99_ms']} ms"
        )
        print(
            f"  ingest with embedding: batched {emb['batched']['turns_per_s']} turns/s, "
            f"chat-shaped {emb['chat_shaped']['turns_per_s']} turns/s"
        )
    print(
        f"  ingest without embedding: {ing['no_embedding']['turns_per_s']} turns/s "
        f"(bulk {result['detail']['corpus']['bulk_load_rows_per_s']} rows/s)"
    )
    print(
        f"\n  {'memories/user':>14}{'vec miss':>10}{'vec p50':>9}{'vec p99':>9}{'lance p50':>11}{'lance p99':>11}"
        f"{'kw p50':>8}{'kw p99':>8}{'both p50':>10}{'both p99':>10}"
    )
    for size, row in result["detail"]["search"].items():
        if size in ("cache", "cache_budget_mb"):
            continue
        lance = result["detail"]["lancedb_path"][size]
        print(
            f"  {size:>14}{row['cache_miss_first_search_ms']:>10}{row['vector_cached']['p50_ms']:>9}"
            f"{row['vector_cached']['p99_ms']:>9}{lance['p50_ms']:>11}{lance['p99_ms']:>11}"
            f"{row['keyword']['p50_ms']:>8}{row['keyword']['p99_ms']:>8}{row['both_arms']['p50_ms']:>10}"
            f"{row['both_arms']['p99_ms']:>10}"
        )
    forget = result["detail"]["forget"]
    small, corpus = forget["small_store"], forget["corpus"]
    print(
        f"\n  forget a 10k-memory user (purge included): {small['seconds']} s in a {small['table_rows_before']}-row"
        f" store; a {corpus['forgotten']}-memory user: {corpus['seconds']} s in a"
        f" {corpus['table_rows_before']}-row corpus"
    )
    deferred = forget["corpus_deferred_purge"]
    print(
        f"  forget {deferred['forgotten']}-memory user without purge: {deferred['seconds']} s; "
        f"purge at the next optimize {deferred['purge_at_next_optimize_s']} s"
    )
    print(f"  rss: {result['detail']['rss']}")
    print(f"  total bench time: {result['detail']['bench_seconds']} s")


async def main(args: argparse.Namespace) -> dict[str, Any]:
    """Run every phase and assemble the results."""
    started = time.perf_counter()
    sizes = [int(s) for s in args.sizes.split(",")]
    detail: dict[str, Any] = {"sizes": sizes, "ingest": {}}
    with tempfile.TemporaryDirectory(prefix="memproxy-bench-store-") as tmp:
        root = Path(tmp)
        embedder = None if args.no_embedding else local_embedder()
        if embedder is not None:
            progress("ingest with embedding")
            detail["ingest"]["with_embedding"] = await ingest_with_embedding(root, embedder, args.embed_turns)
            if hasattr(embedder, "aclose"):
                await embedder.aclose()
        corpus = root / "corpus"
        progress("corpus")
        ann_min_rows = 50_000 if args.ann else 10**12
        detail["corpus"] = await build_corpus(
            corpus, sizes, args.background_users, args.background_size, args.ingest_turns, ann_min_rows
        )
        detail["ingest"]["no_embedding"] = detail["corpus"]["ingest_no_embedding"]
        progress("search (cache)")
        detail["search"] = await search_latencies(corpus, sizes, args.queries, args.cache_mb * 2**20)
        detail["search"]["cache_budget_mb"] = args.cache_mb
        progress("search (LanceDB path)")
        detail["lancedb_path"] = await lancedb_path_latencies(corpus, sizes, max(50, args.queries // 3))
        detail["rss"] = rss_mb()
        progress("forget")
        detail["forget"] = {
            "small_store": await forget_latency(root, 4, 2_500),
            "corpus_deferred_purge": await forget_deferred(corpus, min(sizes, key=lambda size: abs(size - 10_000))),
            "corpus": await forget_in_corpus(corpus, min(sizes)),
        }
        progress("retention sweep")
        detail["retention"] = await retention_sweep(corpus)
    detail["bench_seconds"] = round(time.perf_counter() - started, 1)
    progress("done")
    ten_k = detail["search"].get("10000", {}).get("both_arms", {})
    ingest = detail["ingest"].get("with_embedding", {}).get("batched", detail["ingest"]["no_embedding"])
    return {
        "both_arms_p50_ms_10k": ten_k.get("p50_ms"),
        "both_arms_p99_ms_10k": ten_k.get("p99_ms"),
        "ingest_turns_per_s": ingest["turns_per_s"],
        "ingest_turns_per_s_no_embedding": detail["ingest"]["no_embedding"]["turns_per_s"],
        "forget_user_10k_s": detail["forget"]["small_store"]["seconds"],
        "retention_sweep_100k_s": detail.get("retention", {}).get("seconds"),
        "retention_sweep_idle_100k_s": detail.get("retention", {}).get("idle_s"),
        "targets": {"both_arms_p50_ms_10k": 3.0, "ingest_turns_per_s": 300, "forget_user_10k_s": 1.0},
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "load_avg_at_end": [round(x, 2) for x in os.getloadavg()],
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
        },
        "detail": detail,
    }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1000,10000,100000", help="memories per measured user")
    parser.add_argument("--background-users", type=int, default=8)
    parser.add_argument("--background-size", type=int, default=2_000)
    parser.add_argument("--queries", type=int, default=200, help="queries per measured user")
    parser.add_argument("--ingest-turns", type=int, default=5_000, help="turns ingested (no embedding), timed")
    parser.add_argument("--embed-turns", type=int, default=512, help="turns ingested with real embedding")
    parser.add_argument("--no-embedding", action="store_true", help="skip the real-embedding ingest")
    parser.add_argument("--ann", action="store_true", help="build the HNSW-SQ index on the corpus (minutes on 2 cores)")
    parser.add_argument(
        "--cache-mb", type=int, default=1024, help="vector cache budget for the search phase (default 256 fits ~85k)"
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    return parser.parse_args()


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    arguments = parse_args()
    load_before = [round(x, 2) for x in os.getloadavg()]
    result = asyncio.run(main(arguments))
    result["machine"]["load_avg_at_start"] = load_before
    arguments.out.parent.mkdir(parents=True, exist_ok=True)
    arguments.out.write_text(json.dumps(result, indent=2) + "\n")
    print_table(result)
    print(f"\nwrote {arguments.out}")
