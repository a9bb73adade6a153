"""Added latency of memproxy over a direct call, memory off (``make bench-overhead``).

Starts the fake upstream (loopback, fixed latency) and ``memproxy serve`` as subprocesses, then measures,
interleaved round by round, direct calls and calls through memproxy with ``X-Memory-Mode: off``, at
concurrency 1 and 32, non-stream latency and stream time to first byte. Added latency is the difference of
the percentiles at the same concurrency. Prints a table, writes ``bench/results/overhead.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.loadgen import Sample, cpu_seconds, merge, percentile, run
from tests.support.processes import fake_upstream_process, memproxy_process

RESULTS = Path(__file__).resolve().parent / "results" / "overhead.json"
OFF = {"X-Memory-User": "bench-user", "X-Memory-Mode": "off"}


async def _cell(direct: str, proxied: str, pid: int, concurrency: int, requests: int, rounds: int,
                stream: bool) -> tuple[Sample, Sample, float]:
    direct_runs, proxy_runs = [], []
    cpu = 0.0
    await run(direct, concurrency=concurrency, requests=50, stream=stream)  # warm both paths
    await run(proxied, concurrency=concurrency, requests=50, stream=stream, headers=OFF)
    for _ in range(rounds):
        direct_runs.append(await run(direct, concurrency=concurrency, requests=requests, stream=stream))
        before = cpu_seconds(pid)
        proxy_runs.append(await run(proxied, concurrency=concurrency, requests=requests, stream=stream,
                                    headers=OFF))
        cpu += cpu_seconds(pid) - before
    return merge(direct_runs), merge(proxy_runs), cpu * 1000 / (requests * rounds)


def _row(concurrency: int, stream: bool, direct: Sample, proxy: Sample, cpu_ms: float) -> dict[str, Any]:
    d = direct.ttfts_ms if stream else direct.latencies_ms
    p = proxy.ttfts_ms if stream else proxy.latencies_ms
    row: dict[str, Any] = {"concurrency": concurrency, "kind": "stream_ttft" if stream else "non_stream"}
    for q in (50, 95, 99):
        row[f"direct_p{q}_ms"] = round(percentile(d, q), 3)
        row[f"proxy_p{q}_ms"] = round(percentile(p, q), 3)
        row[f"added_p{q}_ms"] = round(percentile(p, q) - percentile(d, q), 3)
    row.update(direct_rps=round(direct.rps, 1), proxy_rps=round(proxy.rps, 1),
               errors=direct.errors + proxy.errors, samples=len(p), proxy_cpu_ms_per_request=round(cpu_ms, 3))
    return row


def _print(rows: list[dict[str, Any]]) -> None:
    head = f"{'kind':<12}{'conc':>5}{'direct p50':>12}{'proxy p50':>11}{'added p50':>11}{'added p95':>11}" \
           f"{'added p99':>11}{'direct rps':>12}{'proxy rps':>11}{'cpu ms/req':>11}{'errors':>8}"
    print(head)
    for r in rows:
        print(f"{r['kind']:<12}{r['concurrency']:>5}{r['direct_p50_ms']:>12.3f}{r['proxy_p50_ms']:>11.3f}"
              f"{r['added_p50_ms']:>11.3f}{r['added_p95_ms']:>11.3f}{r['added_p99_ms']:>11.3f}"
              f"{r['direct_rps']:>12.1f}{r['proxy_rps']:>11.1f}{r['proxy_cpu_ms_per_request']:>11.3f}{r['errors']:>8}")


async def _measure(direct: str, proxied: str, pid: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for concurrency in args.concurrency:
        for stream in (False, True):
            d, p, cpu = await _cell(direct, proxied, pid, concurrency, args.requests, args.rounds, stream)
            rows.append(_row(concurrency, stream, d, p, cpu))
    return rows


def main() -> None:
    """Run the benchmark."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--latency-ms", type=float, default=5.0, help="fake upstream latency")
    parser.add_argument("--requests", type=int, default=400, help="requests per round per cell")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds per cell")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as data, fake_upstream_process(args.latency_ms) as (_, upstream):
        env = {"MEMPROXY_UPSTREAM__BASE_URL": upstream, "MEMPROXY_STORAGE__PATH": data}
        with memproxy_process(env) as (proc, proxy):
            rows = asyncio.run(_measure(f"{upstream}/chat/completions", f"{proxy}/chat/completions",
                                        proc.popen.pid, args))
    _print(rows)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    meta = {"machine": f"{platform.machine()} {os.cpu_count()} cores, Python {platform.python_version()}",
            "upstream_latency_ms": args.latency_ms, "requests_per_round": args.requests, "rounds": args.rounds}
    RESULTS.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
