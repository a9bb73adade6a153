"""Insight regeneration benchmark: one user with 5,000 messages, LLM calls excluded (target <= 2 s).

A real store (LanceDB + Tantivy in a temporary directory) holds the user's 5,000 messages and as many
assistant replies, spread over the 8-week window, with their vectors. ``regenerate`` then runs end to end
against an in-process model that answers at once, so the time is everything but the model: reading the
turns and vectors, clustering (off the event loop), building the records, adding the new set and retiring
the old one. Each phase is also timed alone. Wall and CPU seconds are reported: this machine is shared, and
CPU time is what the run itself costs.

Corpora:

- ``synthetic`` (default): unit vectors from a mixture of 8 topics (mean cosine to the topic centre about
  0.6, as all-MiniLM-L6-v2 gives for one topic's chat messages) plus 3 % unrelated points.
- ``locomo``: the first 5,000 turns of LoCoMo (``/work/shared/data/locomo``), embedded with the shipped
  local model (slow the first time; the vectors are cached in the system temp dir).

``--hdbscan`` also times HDBSCAN(``algorithm="brute"``) on the same vectors, the alternative measured.
Prints a table and writes ``bench/results/insights.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
from threadpoolctl import threadpool_limits

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from insights.clustering import cluster_messages
from insights.service import (
    InsightSettings,
    cluster_user_messages,
    load_user_messages,
    message_vectors,
    regenerate,
    replace_insights,
)
from proxy.memory.store.memory_store import MemoryStore, StoreSettings
from proxy.memory.store.records import Kind, MemoryRecord, new_id
from tests.support.embedder import HashingEmbedder

RESULTS = Path(__file__).resolve().parent / "results" / "insights.json"
LOCOMO = Path("/work/shared/data/locomo/locomo10.json")
DIM = 384
NOW = datetime(2026, 3, 31, tzinfo=UTC)
USER = "bench-user"
TARGET_S = 2.0


class InstantLLM:
    """An ``LLMClient`` that answers every insight call at once (so LLM time is excluded)."""

    def __init__(self) -> None:
        self.calls = 0

    async def complete_json(
        self, model: str, messages: list[dict[str, Any]], schema: dict[str, Any], schema_name: str
    ) -> dict[str, Any]:
        """A distinct, harmless insight."""
        self.calls += 1
        return {"insight": f"The user keeps returning to theme number {self.calls}."}


def synthetic_vectors(n: int, seed: int = 0) -> tuple[list[str], np.ndarray]:
    """Texts and unit vectors of ``n`` messages on 8 topics of uneven size, 3 % of them unrelated."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(8, DIM))
    centres /= np.linalg.norm(centres, axis=1, keepdims=True)
    topic = rng.choice(8, size=n, p=rng.dirichlet(np.full(8, 3.0)))
    vectors = centres[topic] + rng.normal(size=(n, DIM)) * (1.3 / np.sqrt(DIM))
    unrelated = rng.random(n) < 0.03
    vectors[unrelated] = rng.normal(size=(int(unrelated.sum()), DIM))
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    texts = [f"message {i} about topic {t} with a few more words" for i, t in enumerate(topic)]
    return texts, vectors.astype(np.float32)


async def locomo_vectors(n: int) -> tuple[list[str], np.ndarray]:
    """The first ``n`` LoCoMo turns and their local-model vectors (cached)."""
    from proxy.memory.embedders.factory import build_embedder
    from proxy.memory.embedders.settings import EmbedderSettings

    data = json.loads(await asyncio.to_thread(LOCOMO.read_text))
    texts = [
        turn["text"]
        for sample in data
        for key, session in sample["conversation"].items()
        if key.startswith("session") and isinstance(session, list)
        for turn in session
    ][:n]
    async with build_embedder(EmbedderSettings()) as embedder:
        weights = getattr(embedder, "weights_id", embedder.model_id).replace("/", "_")
        cache = Path(tempfile.gettempdir()) / f"memproxy-bench-locomo-{len(texts)}-{weights}.npy"
        if cache.exists():
            return texts, np.load(cache)
        vectors = await embedder.embed_documents(texts)
    np.save(cache, vectors)
    return texts, vectors


def turns(texts: list[str], vectors: np.ndarray) -> list[MemoryRecord]:
    """The user's messages evenly over the 8 weeks before ``NOW``, each followed by an assistant reply."""
    step = timedelta(weeks=8) / (len(texts) + 1)
    records = []
    for i, (text, vector) in enumerate(zip(texts, vectors, strict=True)):
        at = NOW - timedelta(weeks=8) + (i + 1) * step
        records.append(MemoryRecord(USER, Kind.TURN, text, created_at=at, role="user", embedding=vector.tolist()))
        reply = MemoryRecord(USER, Kind.TURN, f"Reply {i}.", created_at=at, role="assistant", embedding=vector.tolist())
        records.append(reply)
    return records


async def timed(step: Callable[[], Awaitable[Any]], repeat: int) -> tuple[list[float], list[float], Any]:
    """Wall and process-CPU seconds of ``repeat`` runs of ``step``, and its last result."""
    walls, cpus, result = [], [], None
    for _ in range(repeat):
        wall, cpu = time.perf_counter(), time.process_time()
        result = await step()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return walls, cpus, result


def summary(walls: list[float], cpus: list[float]) -> dict[str, float]:
    """Median and max wall seconds, median CPU seconds."""
    return {
        "wall_p50_s": round(statistics.median(walls), 3),
        "wall_max_s": round(max(walls), 3),
        "cpu_p50_s": round(statistics.median(cpus), 3),
    }


async def phases(store: MemoryStore, settings: InsightSettings, repeat: int) -> dict[str, dict[str, float]]:
    """Each step of a regeneration timed alone."""
    since = NOW - timedelta(weeks=settings.window_weeks)
    w, c, records = await timed(lambda: load_user_messages(store, USER, since, NOW, settings), repeat)
    out = {"load_messages": summary(w, c)}
    w, c, _ = await timed(lambda: message_vectors(store, records), repeat)
    out["vectors"] = summary(w, c)
    w, c, clusters = await timed(lambda: cluster_user_messages(store, records, settings), repeat)
    out["cluster"] = summary(w, c)
    w, c, _ = await timed(lambda: replace_insights(store, USER, fresh_set(len(clusters))), repeat)
    out["replace_set"] = summary(w, c)
    out["messages_clustered"] = {"count": len(records)}
    return out


def fresh_set(count: int) -> list[MemoryRecord]:
    """A new generation of ``count`` insight records."""
    generation = new_id()
    return [
        MemoryRecord(USER, Kind.INSIGHT, f"Insight {i}.", generation_id=generation, confidence=0.5)
        for i in range(count)
    ]


def hdbscan_seconds(vectors: np.ndarray) -> dict[str, Any]:
    """HDBSCAN (brute, cosine) on the same vectors: time, clusters, noise."""
    from sklearn.cluster import HDBSCAN

    with threadpool_limits(limits=1):
        wall, cpu = time.perf_counter(), time.process_time()
        labels = HDBSCAN(
            min_cluster_size=max(5, len(vectors) // 100), algorithm="brute", metric="cosine", copy=True
        ).fit_predict(vectors)
        elapsed, used = time.perf_counter() - wall, time.process_time() - cpu
    return {
        "wall_s": round(elapsed, 3),
        "cpu_s": round(used, 3),
        "clusters": int(labels.max() + 1),
        "noise": int((labels < 0).sum()),
    }


async def main(args: argparse.Namespace) -> dict[str, Any]:
    """Build the user, time ``regenerate`` and its phases."""
    texts, vectors = await (
        locomo_vectors(args.messages)
        if args.corpus == "locomo"
        else asyncio.to_thread(synthetic_vectors, args.messages)
    )
    settings = InsightSettings(model="bench", max_messages=max(args.messages, 2))
    llm = InstantLLM()
    with tempfile.TemporaryDirectory(prefix="memproxy-bench-insights-") as tmp:
        async with MemoryStore(
            StoreSettings(path=Path(tmp)), HashingEmbedder(dim=DIM, model_id="bench/hashing-384")
        ) as store:
            records = turns(texts, vectors)
            for start in range(0, len(records), 1000):
                await store.add(records[start : start + 1000])
            await regenerate(store, llm, USER, settings, NOW)  # warm-up: imports, caches
            walls, cpus, current = await timed(lambda: regenerate(store, llm, USER, settings, NOW), args.repeat)
            steps = await phases(store, settings, args.repeat)
    clusters = cluster_messages(vectors, max_clusters=settings.max_clusters)
    result: dict[str, Any] = {
        "corpus": args.corpus,
        "messages": len(texts),
        "stored_turns": 2 * len(texts),
        "regenerate": summary(walls, cpus),
        "target_s": TARGET_S,
        "meets_target": statistics.median(walls) <= TARGET_S,
        "phases": steps,
        "clusters": len(current),
        "cluster_sizes": [c.size for c in clusters],
        "cluster_cohesion": [round(c.cohesion, 3) for c in clusters],
        "excluded_as_outliers": len(texts) - sum(c.size for c in clusters),
        "machine": {
            "cpus": os.cpu_count(),
            "load_avg_1m": round(os.getloadavg()[0], 2),
            "python": platform.python_version(),
        },
        "note": "LLM calls excluded (an in-process model answers at once); insight texts embedded by a hashing "
        "embedder; wall times depend on the machine's load (load_avg_1m), CPU times much less.",
    }
    if args.hdbscan:
        result["hdbscan_brute"] = hdbscan_seconds(vectors)
    return result


def print_table(result: dict[str, Any]) -> None:
    """The figures as a table on stdout."""
    print(f"insight regeneration, {result['messages']} messages ({result['corpus']}), LLM excluded")
    print(f"{'step':<16}{'wall p50 s':>12}{'wall max s':>12}{'cpu p50 s':>12}")
    rows = {"regenerate": result["regenerate"], **result["phases"]}
    clustered = rows.pop("messages_clustered")["count"]
    for name, row in rows.items():
        print(f"{name:<16}{row['wall_p50_s']:>12.3f}{row['wall_max_s']:>12.3f}{row['cpu_p50_s']:>12.3f}")
    print(f"messages clustered: {clustered}")
    print(f"clusters: {result['clusters']} sizes {result['cluster_sizes']}, outliers {result['excluded_as_outliers']}")
    verdict = "met" if result["meets_target"] else "NOT met"
    print(f"target <= {result['target_s']} s: {verdict} (load avg {result['machine']['load_avg_1m']})")
    if "hdbscan_brute" in result:
        print(f"hdbscan brute: {result['hdbscan_brute']}")


def parse_args() -> argparse.Namespace:
    """Command line options."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=5000)
    parser.add_argument("--corpus", choices=["synthetic", "locomo"], default="synthetic")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--hdbscan", action="store_true", help="also time HDBSCAN(algorithm='brute')")
    parser.add_argument("--out", type=Path, default=RESULTS)
    return parser.parse_args()


if __name__ == "__main__":
    arguments = parse_args()
    outcome = asyncio.run(main(arguments))
    print_table(outcome)
    arguments.out.parent.mkdir(parents=True, exist_ok=True)
    arguments.out.write_text(json.dumps(outcome, indent=2) + "\n")
