"""Write-path throughput and freshness (``python bench/writes.py``).

A real store (LanceDB + Tantivy, the shipped MiniLM embedder unless ``--embedder hashing``) in a temporary
directory, the durable job queue and the writer, with a fake memory-side LLM on loopback (one fact per
exchange, reconciliation always ADD). Measures:

1. enqueue: the durable commit an HTTP handler waits for, one exchange at a time (p50/p99);
2. drain: a backlog of exchanges processed to the end (turns, facts extraction and reconciliation), as
   exchanges/s and jobs/s, with the fake LLM answering at once;
3. freshness: from the end of a reply (just before its enqueue) until a keyword search finds the new turn,
   p50/p99, idle and under load (other users' exchanges arriving, a slow LLM keeping fact jobs busy, the
   sampled user's own fact jobs in flight).

Prints a table and writes ``bench/results/writes.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import platform
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import structlog

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench.loadgen import percentile
from proxy.memory.embedders import Embedder, EmbedderSettings, build_embedder
from proxy.memory.extraction import ExtractionSettings, Extractor
from proxy.memory.jobs import JobQueue, JobQueueSettings, JobRunner
from proxy.memory.llm import OpenAICompatibleLLM, OpenAICompatibleSettings
from proxy.memory.records import Kind
from proxy.memory.service import Exchange
from proxy.memory.store import MemoryStore, StoreSettings
from proxy.memory.writer import Writer, WriterSettings
from tests.support.embedder import HashingEmbedder
from tests.support.fake_llm import FakeLLM, decision, fact, facts, user_payload

RESULTS = Path(__file__).resolve().parent / "results" / "writes.json"


def respond(name: str, body: dict[str, Any]) -> Any:
    """Fake LLM: one fact per exchange ("I like topic N" -> "The user likes topic N"), always ADD."""
    if name == "memory_facts":
        message = user_payload(body)["user_messages"][0]
        return facts(fact(message.replace("I like", "The user likes")))
    if name == "memory_summary":
        return {"summary": "The user listed topics they like.", "topics": ["topics"]}
    return decision("ADD")


@dataclass
class Bench:
    """The running write path."""

    store: MemoryStore
    queue: JobQueue
    writer: Writer
    llm: FakeLLM
    sent: int = 0

    async def send(self, user: str, text: str) -> tuple[float, float]:
        """Record an exchange; returns (reply end, enqueue seconds)."""
        self.sent += 1
        end = datetime.now(UTC)
        exchange = Exchange(
            request_id=f"r{self.sent}", user_id=user, conversation_id=f"{user}-c", model="bench-model",
            route="default", user_messages=(text,), assistant_text=f"Here is more about {text}.",
            partial=False, finished_at=end,
        )  # fmt: skip
        started = time.perf_counter()
        await self.writer.record(exchange)
        return end.timestamp(), time.perf_counter() - started

    async def idle(self) -> None:
        """Wait until no job is due or running."""
        while True:
            metrics = await self.queue.metrics()
            if metrics.ready == 0 and metrics.running == 0:
                return
            await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def write_path(data: Path, embedder: Embedder, concurrency: int) -> AsyncIterator[Bench]:
    """Store, queue, fake LLM, client and writer (runner not started)."""
    async with contextlib.AsyncExitStack() as stack:
        llm = await stack.enter_async_context(FakeLLM(respond))
        store = await stack.enter_async_context(MemoryStore(StoreSettings(path=data / "store"), embedder))
        queue = await stack.enter_async_context(
            JobQueue(JobQueueSettings(path=data / "queue", concurrency=concurrency, poll_interval_s=0.05))
        )
        client = await stack.enter_async_context(OpenAICompatibleLLM(OpenAICompatibleSettings(base_url=llm.base_url)))
        settings = WriterSettings(summary_idle_s=3600, insights_debounce_s=3600)
        yield Bench(store, queue, Writer(settings, store, queue, Extractor(ExtractionSettings(), client)), llm)


async def enqueue_and_drain(bench: Bench, exchanges: int, users: int) -> dict[str, float]:
    """Phase 1 and 2: enqueue a backlog (timed), then process it with the runner (timed)."""
    enqueue_s = [(await bench.send(f"user{n % users}", f"I like topic {n}"))[1] for n in range(exchanges)]
    started = time.perf_counter()
    async with JobRunner(bench.queue, bench.writer.handlers()):
        await bench.idle()
        elapsed = time.perf_counter() - started
    metrics = await bench.queue.metrics()
    steps = {name: s.sum_s / s.count * 1000 for name, s in metrics.step_latency.items() if s.count}
    return {
        "enqueue_p50_ms": percentile(enqueue_s, 50) * 1000,
        "enqueue_p99_ms": percentile(enqueue_s, 99) * 1000,
        "drain_s": elapsed,
        "exchanges_per_s": exchanges / elapsed,
        "jobs_per_s": metrics.completed_total / elapsed,
        **{f"step_mean_ms.{name}": value for name, value in sorted(steps.items())},
    }


async def searchable_after(bench: Bench, user: str, token: str, limit_s: float = 30.0) -> float:
    """Seconds from the reply's end until a keyword search for ``token`` finds the new turn (capped)."""
    end, _ = await bench.send(user, f"I like {token}")
    found = False
    while not found and time.time() - end < limit_s:  # polling is the measurement: the next request's search
        await asyncio.sleep(0.002)
        found = bool(await bench.store.keyword_search(user, token, 1, kinds=[Kind.TURN]))
    return time.time() - end


async def background_load(bench: Bench, users: int, rate: float, stop: asyncio.Event) -> None:
    """Other exchanges arriving at ``rate`` per second until ``stop``."""
    n = 0
    while not stop.is_set():
        n += 1
        await bench.send(f"load{n % users}", f"I like background topic {n}")
        await asyncio.sleep(1 / rate)


async def freshness(bench: Bench, samples: int, load_rate: float, llm_delay_s: float) -> list[float]:
    """Phase 3: reply-end to searchable, optionally under load with a slow LLM."""
    bench.llm.delay_s = llm_delay_s
    stop = asyncio.Event()
    latencies = []
    async with JobRunner(bench.queue, bench.writer.handlers()), asyncio.TaskGroup() as group:
        if load_rate > 0:
            group.create_task(background_load(bench, 20, load_rate, stop))
        for i in range(samples):
            user = f"load{i % 20}" if load_rate > 0 else "fresh"
            latencies.append(await searchable_after(bench, user, f"zebra{i}{'loaded' if load_rate > 0 else 'idle'}"))
            await asyncio.sleep(0.02)
        stop.set()
    bench.llm.delay_s = 0.0
    return latencies


def summary(latencies: list[float]) -> dict[str, float]:
    """p50/p99/max in ms."""
    return {
        "p50_ms": percentile(latencies, 50) * 1000,
        "p99_ms": percentile(latencies, 99) * 1000,
        "max_ms": max(latencies) * 1000,
    }


def progress(message: str) -> None:
    """A progress line on stderr."""
    print(f"[writes] {message}", file=sys.stderr, flush=True)


async def main(args: argparse.Namespace) -> dict[str, Any]:
    """Run the three phases and collect the figures."""
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    if args.embedder == "hashing":
        embedder: Any = HashingEmbedder(dim=384)
    else:
        embedder = build_embedder(EmbedderSettings())
        await embedder.start()
    with tempfile.TemporaryDirectory(prefix="memproxy-bench-writes-") as tmp:
        async with write_path(Path(tmp), embedder, args.concurrency) as bench:
            progress("enqueue and drain")
            drain = await enqueue_and_drain(bench, args.exchanges, args.users)
            progress("freshness, idle")
            idle = await freshness(bench, args.samples, 0.0, 0.0)
            rate = args.load_rate or round(drain["exchanges_per_s"] / 2, 1)
            progress(f"freshness, under load ({rate} exchanges/s)")
            loaded = await freshness(bench, args.samples, rate, args.load_llm_delay_ms / 1000)
    return {
        "settings": vars(args) | {"machine": platform.machine(), "cpus": os.cpu_count(), "load_rate": rate},
        **drain,
        "searchable_idle": summary(idle),
        "searchable_under_load": summary(loaded),
        "searchable_p50_ms": summary(idle)["p50_ms"],
        "searchable_p99_ms": summary(idle)["p99_ms"],
    }


def print_table(result: dict[str, Any]) -> None:
    """The figures as a plain table."""
    rows = [(k, v) for k, v in result.items() if isinstance(v, float)]
    rows += [
        (f"{k}.{kk}", vv) for k, v in result.items() if isinstance(v, dict) and k != "settings" for kk, vv in v.items()
    ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value:10.2f}")


def parse_args() -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--exchanges", type=int, default=200)
    parser.add_argument("--users", type=int, default=30)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--samples", type=int, default=60)
    parser.add_argument("--load-rate", type=float, default=0.0, help="background exchanges/s (0: half the drain rate)")
    parser.add_argument("--load-llm-delay-ms", type=float, default=500.0)
    parser.add_argument("--embedder", choices=["local", "hashing"], default="local")
    parser.add_argument("--no-write", action="store_true", help="do not write bench/results/writes.json")
    return parser.parse_args()


if __name__ == "__main__":
    arguments = parse_args()
    figures = asyncio.run(main(arguments))
    print_table(figures)
    if not arguments.no_write:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(json.dumps(figures, indent=2) + "\n")
