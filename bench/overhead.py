"""Added latency of memproxy over a direct call, memory off and with the read path (``make bench-overhead``).

Starts the fake upstream (loopback, fixed latency) and ``memproxy serve`` as subprocesses, then measures,
interleaved round by round, direct calls, calls through memproxy with ``X-Memory-Mode: off`` (the proxy
alone) and with ``X-Memory-Mode: read`` for a user with ``--memories`` memories (the proxy plus the whole
read path: query embedding, the arms, fusion, injection; nothing written), at concurrency 1 and 32,
non-stream latency and stream time to first byte. Each read-mode request asks a question never asked
before, so the query embedding is never a cache hit. Added latency is the difference of the percentiles at
the same concurrency. Prints a table, writes ``bench/results/overhead.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.load import OFF, ON, degraded_reads, queries, seeded_store
from bench.loadgen import Sample, cpu_seconds, merge, percentile, run
from tests.support.processes import fake_upstream_process, memproxy_process

RESULTS = Path(__file__).resolve().parent / "results" / "overhead.json"
MODES = {"off": OFF, "read": ON}


async def _cell(
    direct: str, proxied: str, pid: int, concurrency: int, args: argparse.Namespace, stream: bool, texts: Iterator[str]
) -> tuple[Sample, dict[str, Sample], dict[str, float], float]:
    """Direct and proxied runs of one cell, interleaved by round; the proxy's CPU ms per request by mode, and
    how many read-mode requests were served without memory (the read path missed its deadline)."""
    requests, rounds = args.requests, args.rounds
    direct_runs: list[Sample] = []
    proxy_runs: dict[str, list[Sample]] = {mode: [] for mode in MODES}
    cpu = dict.fromkeys(MODES, 0.0)
    degraded, base = 0.0, proxied.removesuffix("/chat/completions")
    await run(direct, concurrency=concurrency, requests=50, stream=stream)  # warm every path
    for headers in MODES.values():
        await run(
            proxied,
            concurrency=concurrency,
            requests=50,
            stream=stream,
            headers=headers,
            texts=[next(texts) for _ in range(50)],
        )
    for _ in range(rounds):
        direct_runs.append(await run(direct, concurrency=concurrency, requests=requests, stream=stream))
        for mode, headers in MODES.items():
            before, degraded_before = cpu_seconds(pid), degraded_reads(base)
            proxy_runs[mode].append(
                await run(
                    proxied,
                    concurrency=concurrency,
                    requests=requests,
                    stream=stream,
                    headers=headers,
                    texts=[next(texts) for _ in range(requests)],
                )
            )
            cpu[mode] += cpu_seconds(pid) - before
            degraded += degraded_reads(base) - degraded_before
    per_request = {mode: total * 1000 / (requests * rounds) for mode, total in cpu.items()}
    return merge(direct_runs), {mode: merge(runs) for mode, runs in proxy_runs.items()}, per_request, degraded


def _row(concurrency: int, stream: bool, mode: str, direct: Sample, proxy: Sample, cpu_ms: float) -> dict[str, Any]:
    d = direct.ttfts_ms if stream else direct.latencies_ms
    p = proxy.ttfts_ms if stream else proxy.latencies_ms
    row: dict[str, Any] = {"concurrency": concurrency, "kind": "stream_ttft" if stream else "non_stream", "mode": mode}
    for q in (50, 95, 99):
        row[f"direct_p{q}_ms"] = round(percentile(d, q), 3)
        row[f"proxy_p{q}_ms"] = round(percentile(p, q), 3)
        row[f"added_p{q}_ms"] = round(percentile(p, q) - percentile(d, q), 3)
    row.update(
        direct_rps=round(direct.rps, 1),
        proxy_rps=round(proxy.rps, 1),
        errors=direct.errors + proxy.errors,
        samples=len(p),
        proxy_cpu_ms_per_request=round(cpu_ms, 3),
    )
    return row


def _print(rows: list[dict[str, Any]]) -> None:
    head = (
        f"{'kind':<12}{'mode':>5}{'conc':>5}{'direct p50':>12}{'proxy p50':>11}{'added p50':>11}{'added p95':>11}"
        f"{'added p99':>11}{'direct rps':>12}{'proxy rps':>11}{'cpu ms/req':>11}{'errors':>8}{'no memory':>11}"
    )
    print(head)
    for r in rows:
        print(
            f"{r['kind']:<12}{r['mode']:>5}{r['concurrency']:>5}{r['direct_p50_ms']:>12.3f}{r['proxy_p50_ms']:>11.3f}"
            f"{r['added_p50_ms']:>11.3f}{r['added_p95_ms']:>11.3f}{r['added_p99_ms']:>11.3f}"
            f"{r['direct_rps']:>12.1f}{r['proxy_rps']:>11.1f}{r['proxy_cpu_ms_per_request']:>11.3f}{r['errors']:>8}"
            f"{'-' if r['served_without_memory'] is None else r['served_without_memory']:>11}"
        )


async def _measure(direct: str, proxied: str, pid: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    cells = 2 * len(args.concurrency)
    texts = iter(queries(random.Random(4), cells * len(MODES) * (50 + args.rounds * args.requests)))
    for concurrency in args.concurrency:
        for stream in (False, True):
            d, proxied_samples, cpu, degraded = await _cell(direct, proxied, pid, concurrency, args, stream, texts)
            for mode, p in proxied_samples.items():
                rows.append(_row(concurrency, stream, mode, d, p, cpu[mode]))
                rows[-1]["served_without_memory"] = int(degraded) if mode == "read" else None
    return rows


def main() -> None:
    """Run the benchmark."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--latency-ms", type=float, default=5.0, help="fake upstream latency")
    parser.add_argument("--requests", type=int, default=400, help="requests per round per cell")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds per cell")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--memories", type=int, default=10_000, help="memories of the read-mode user")
    args = parser.parse_args()
    seeded = seeded_store(args.memories)
    with tempfile.TemporaryDirectory() as tmp, fake_upstream_process(args.latency_ms) as (_, upstream):
        data = Path(tmp) / "data"
        shutil.copytree(seeded, data)  # the proxy may compact or touch; the seeded copy stays pristine
        env = {"MEMPROXY_UPSTREAM__BASE_URL": upstream, "MEMPROXY_STORAGE__PATH": str(data)}
        with memproxy_process(env) as (proc, proxy):
            rows = asyncio.run(
                _measure(f"{upstream}/chat/completions", f"{proxy}/chat/completions", proc.popen.pid, args)
            )
    _print(rows)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "machine": f"{platform.machine()} {os.cpu_count()} cores, Python {platform.python_version()}",
        "upstream_latency_ms": args.latency_ms,
        "requests_per_round": args.requests,
        "rounds": args.rounds,
        "read_mode_user_memories": args.memories,
        "load_avg_at_end": [round(x, 2) for x in os.getloadavg()],
    }
    RESULTS.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
