"""What "answered means stored" costs: the durable commit of an exchange, in-process (``python bench/commit_cost.py``).

The chat handler now waits for the exchange's commit to the job queue before the client can have the end of
its answer, so the commit's latency is added to every answer that is stored. Measured here without HTTP, on
the real ``JobQueue`` (SQLite WAL, ``synchronous=FULL`` for the commit) in a temporary directory on the data
disk, with exchange payloads of a typical size:

1. one exchange at a time: wall time per commit (p50/p90/p99) and CPU per commit (``time.process_time``,
   every thread of the process: the event loop and the queue's SQLite thread);
2. N concurrent exchanges (N = 8, 32), rounds of N at once: per-commit wall p50/p99, commits/s, and how many
   durable commits (fsyncs) carried them: the group commit.

The machine may be shared: wall times include waiting for a core; CPU per commit does not. Run it twice and
look at the CPU column when the load is high. Prints a table; ``--json PATH`` also writes the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from proxy.memory.service import Exchange
from proxy.memory.write.job_types import JobQueueSettings
from proxy.memory.write.payloads import exchange_payload
from proxy.memory.write.queue import JobQueue


def exchange(n: int) -> Exchange:
    """An exchange of typical size (~300 characters of user text, ~500 of reply)."""
    return Exchange(
        request_id=f"r{n}",
        user_id=f"u{n % 8}",
        conversation_id="c",
        model="m",
        route="default",
        user_messages=(f"message number {n} " * 18,),
        assistant_text=f"reply number {n} " * 36,
        partial=False,
        finished_at=datetime.now(UTC),
    )


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) of ``values`` (nearest rank)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def sequential(queue: JobQueue, count: int) -> dict[str, float]:
    """``count`` commits one after the other."""
    latencies = []
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for n in range(count):
        started = time.perf_counter()
        await queue.enqueue("exchange", f"u{n % 8}", exchange_payload(exchange(n)))
        latencies.append((time.perf_counter() - started) * 1000)
    cpu_ms = (time.process_time() - cpu0) * 1000 / count
    return {
        "p50_ms": percentile(latencies, 0.5),
        "p90_ms": percentile(latencies, 0.9),
        "p99_ms": percentile(latencies, 0.99),
        "cpu_ms_per_commit": cpu_ms,
        "commits_per_s": count / (time.perf_counter() - wall0),
        "exchanges_per_fsync": 1.0,
    }


async def concurrent(queue: JobQueue, width: int, rounds: int) -> dict[str, float]:
    """``rounds`` rounds of ``width`` commits issued at once."""
    latencies: list[float] = []

    async def one(n: int) -> None:
        started = time.perf_counter()
        await queue.enqueue("exchange", f"u{n % 8}", exchange_payload(exchange(n)))
        latencies.append((time.perf_counter() - started) * 1000)

    batches0, items0 = queue.commit_batches
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for r in range(rounds):
        await asyncio.gather(*(one(r * width + i) for i in range(width)))
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    batches, items = queue.commit_batches
    return {
        "p50_ms": percentile(latencies, 0.5),
        "p99_ms": percentile(latencies, 0.99),
        "commits_per_s": len(latencies) / wall,
        "cpu_ms_per_commit": cpu * 1000 / len(latencies),
        "exchanges_per_fsync": (items - items0) / max(1, batches - batches0),
    }


async def main(args: argparse.Namespace) -> dict[str, Any]:
    """Run every measurement in a fresh queue under ``--dir``."""
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        async with JobQueue(JobQueueSettings(path=Path(tmp) / "queue")) as queue:
            await sequential(queue, 20)  # warm up
            results: dict[str, Any] = {"sequential": await sequential(queue, args.count)}
            for width in (8, 32):
                results[f"concurrent_{width}"] = await concurrent(queue, width, max(2, args.count // width))
    results["meta"] = {"count": args.count, "dir": args.dir, "load_average": os.getloadavg()}
    return results


def _table(results: dict[str, Any]) -> str:
    rows = ["case            p50 ms   p99 ms   cpu ms/commit   commits/s   exchanges/fsync"]
    for name, r in results.items():
        if name == "meta":
            continue
        rows.append(
            f"{name:<15} {r['p50_ms']:>6.2f}   {r['p99_ms']:>6.2f}   {r['cpu_ms_per_commit']:>13.2f}"
            f"   {r['commits_per_s']:>9.0f}   {r['exchanges_per_fsync']:>15.1f}"
        )
    return "\n".join(rows)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=320, help="commits per case")
    parser.add_argument("--dir", default=None, help="directory for the queue (default: the system temp dir)")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    arguments = parser.parse_args()
    figures = asyncio.run(main(arguments))
    print(_table(figures))
    print(f"load average during the run: {figures['meta']['load_average']}")
    if arguments.json is not None:
        arguments.json.write_text(json.dumps(figures, indent=2))
