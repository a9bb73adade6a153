"""Where the proxy's CPU goes under load (``make bench-profile``): py-spy on a running memproxy.

Starts the fake upstream (loopback, 5 ms) and ``memproxy serve`` over a copy of the load bench's seeded store
(10k memories of one user), drives it with the load generator at ``--concurrency`` in ``--mode off`` (the
proxy alone) or ``--mode read`` (the whole read path; every read given 5 s so none is cut short), and records
its processes (the supervisor, the chat processes, the memory writer) with py-spy for ``--seconds`` at 200 Hz
(all threads, active samples only). With ``--users N`` the store holds N users of ``--memories`` each and request i
is user i's in ``bench/load.py``'s order (``user_sequence``); ``--vector-cache-mb`` sets each chat process's
``store.vector_cache_bytes``, so the read path of users not cached (``memproxy-on-small-cache``) can be profiled.
Prints the share of samples and the CPU per request of each process, per
thread, per kind of code (the proxy's own, aiohttp, the event loop, onnxruntime, Tantivy, ...)
and the hottest leaf frames, and the CPU per request. The raw py-spy file goes to ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.load import OFF, ON, queries, seeded_store, user_sequence
from bench.loadgen import run
from tests.support.processes import fake_upstream_process, memproxy_process, process_tree

PY_SPY = Path(sys.executable).parent / "py-spy"
RATE_HZ = 200


def summary(raw: list[str], seconds: float, requests: int, roles: dict[int, str] | None = None) -> str:
    """The tables for py-spy's raw (collapsed stack) output (``roles``: each recorded process's role)."""
    total = 0
    processes: collections.Counter[str] = collections.Counter()
    threads: collections.Counter[str] = collections.Counter()
    kinds: collections.Counter[str] = collections.Counter()
    leaves: collections.Counter[str] = collections.Counter()
    for line in raw:
        stack, _, count = line.rpartition(" ")
        frames, n = stack.split(";"), int(count)
        nested = 0
        while nested < len(frames) and frames[nested].startswith("process "):  # --subprocesses: "process
            nested += 1  # PID:\"command line\"", one a level (the supervisor's, then its child's)
        if nested:
            pid = int(frames[nested - 1].split()[1].split(":")[0])
            processes[(roles or {}).get(pid, f"pid {pid}")] += n
            frames = frames[nested:]
        total += n
        threads[frames[0].split(" (")[0] + " " + frames[0].rsplit(": ", 1)[-1][:30]] += n
        leaves[frames[-1][:110]] += n
        kinds[_kind(frames)] += n
    if not total:
        return "no samples"
    cpu_s = total / RATE_HZ
    lines = [
        f"{total} samples = {cpu_s:.1f} CPU s in {seconds:.0f} s ({cpu_s / seconds:.2f} cores busy), "
        f"~{requests} requests: {1000 * cpu_s / max(1, requests):.1f} ms CPU per request",
    ]
    if processes:
        lines += ["", "processes (ms of CPU per request):"]
        lines += [f"  {n / total:6.1%}  {1000 * n / RATE_HZ / max(1, requests):6.2f}  {name}"
                  for name, n in processes.most_common()]  # fmt: skip
    lines += ["", "threads:"]
    lines += [f"  {n / total:6.1%}  {name}" for name, n in threads.most_common(8)]
    lines += ["", "kind of code (leaf frame):"]
    lines += [f"  {n / total:6.1%}  {name}" for name, n in kinds.most_common(10)]
    lines += ["", "hottest leaf frames:"]
    lines += [f"  {n / total:6.1%}  {name}" for name, n in leaves.most_common(20)]
    return "\n".join(lines)


def _kind(frames: list[str]) -> str:
    leaf = frames[-1]
    for needle, name in (
        ("onnxruntime", "onnxruntime (embedding)"),
        ("keyword.py", "Tantivy (keyword arm)"),
        ("aiohttp", "aiohttp"),
        ("structlog", "structlog"),
        ("prometheus", "prometheus"),
        ("numpy", "numpy"),
        ("(proxy/", "proxy's own code"),
        ("(insights/", "proxy's own code"),
    ):
        if needle in leaf:
            return name
    return "event loop / other" if "asyncio" in leaf or "runners.py" in leaf else "other"


async def _drive(
    url: str,
    headers: dict[str, str],
    concurrency: int,
    requests: int,
    texts: list[str],
    stream: bool = False,
    users: list[str] | None = None,
) -> None:
    await run(url, concurrency=concurrency, requests=requests, stream=stream, headers=headers, texts=texts, users=users)


def main() -> None:
    """Profile one load cell and print where the time goes."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=("off", "read"), default="read")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--stream", action="store_true", help="streamed requests (the load bench's other half)")
    parser.add_argument("--seconds", type=int, default=20, help="how long py-spy records")
    parser.add_argument("--memories", type=int, default=10_000, help="memories of the read-mode user (of each user)")
    parser.add_argument("--users", type=int, default=1, help="users in the store, requests spread over them")
    parser.add_argument("--vector-cache-mb", type=int, help="store.vector_cache_bytes (MiB) of a chat process")
    parser.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "memproxy-profile.txt")
    args = parser.parse_args()
    if not PY_SPY.exists():
        sys.exit(f"{PY_SPY} missing: pip install -e '.[bench]' (make bench-profile does)")
    seeded = seeded_store(args.memories, args.users)
    users = user_sequence(args.users, 4096) if args.users > 1 else None
    headers = ON if args.mode == "read" else OFF
    texts = queries(random.Random(1), 6000)
    with tempfile.TemporaryDirectory() as tmp, fake_upstream_process(5.0) as (_, upstream):
        data = Path(tmp) / "data"
        shutil.copytree(seeded, data)
        env = {
            "MEMPROXY_UPSTREAM__BASE_URL": upstream,
            "MEMPROXY_STORAGE__PATH": str(data),
            "MEMPROXY_MEMORY__RETRIEVAL_TIMEOUT_MS": "5000",
            "MEMPROXY_RETRIEVAL__ARM_TIMEOUT_MS": "5000",
            "MEMPROXY_MEMORY__READ_QUEUE_MS": "5000",
            "MEMPROXY_SERVER__WORKERS": "0",  # the product's default (the tests' helper starts one chat process)
        }
        if args.vector_cache_mb is not None:
            env["MEMPROXY_STORE__VECTOR_CACHE_BYTES"] = str(args.vector_cache_mb * 2**20)
        with memproxy_process(env, timeout=180.0) as (proc, proxy):
            url = f"{proxy}/chat/completions"
            # warm: the users' caches load
            warm = max(100, 2 * args.users)
            asyncio.run(_drive(url, headers, args.concurrency, warm, texts[:warm], args.stream, users))
            spy = subprocess.Popen(
                [
                    str(PY_SPY),
                    "record",
                    "-p",
                    str(proc.popen.pid),
                    "-d",
                    str(args.seconds),
                    "-r",
                    str(RATE_HZ),
                    "-f",
                    "raw",
                    "-o",
                    str(args.out),
                    "--threads",
                    "--subprocesses",  # memproxy serve's chat processes and memory writer
                    "--nonblocking",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            roles = process_tree(proc.popen.pid)
            size, requests, started = 10 * args.concurrency, 0, time.perf_counter()
            while spy.poll() is None:  # keep the load on for as long as py-spy records
                batch = [texts[(warm + requests + i) % len(texts)] for i in range(size)]
                who = [users[(warm + requests + i) % len(users)] for i in range(size)] if users else None
                asyncio.run(_drive(url, headers, args.concurrency, size, batch, args.stream, who))
                requests += size
            rate = requests / (time.perf_counter() - started)
    if spy.returncode != 0 or not args.out.exists():
        sys.exit(f"py-spy failed (exit {spy.returncode}); it needs ptrace rights over the memproxy process")
    print(
        f"mode {args.mode}, concurrency {args.concurrency}, stream {args.stream}, users {args.users}, "
        f"vector cache {args.vector_cache_mb or 'default'} MiB: {rate:.1f} req/s"
    )
    print(summary(args.out.read_text().splitlines(), args.seconds, round(rate * args.seconds), roles))
    print(f"raw py-spy output: {args.out}")


if __name__ == "__main__":
    main()
