"""Replicas over object storage, measured (``make bench-cluster``): writes ``bench/results/cluster.json``.

The S3 stand-in is moto's server on 127.0.0.1 (requests serialised, tests/support/moto_serial.py): it answers
in about a millisecond where S3 takes 10-50 ms, so object-store latency here is a floor, and the request
counts are what carries over to a real bucket.

1. **Read path, object storage vs local, same run.** Two ``MemoryEngine``s (default settings, shipped
   model), one on a local directory and one on ``s3://``, filled with the same records (one user with
   ``--memories`` memories, ``--cold-users`` users with ``--cold-memories`` each). Warm: sequential
   ``inject`` for fresh questions of the warm user, p50/p99. Cold: each cold user's first ``inject`` (the
   vector cache and the read cache load that user from the table). Object-store requests per ``inject``
   (counted at the server).
2. **Throughput with 1, 2 and 3 replicas.** ``memproxy serve`` replicas on the same bucket behind nginx
   (deploy/nginx/memproxy.conf), the fake upstream, closed-loop clients (``--concurrency``) spread over the
   users by ``X-Memory-User``, ``X-Memory-Mode: read``; req/s, p50/p99, requests served without memory, and
   object-store requests per chat request. All replicas share this machine's 2 cores: throughput is
   CPU-bound and cannot grow with replicas here; the figure shows the cost of coordination, not scale.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import sys
import tempfile
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.loadgen import body, cpu_seconds, percentile
from proxy.app import engine_settings
from proxy.config import load_settings
from proxy.engine import MemoryEngine
from proxy.memory.service import ReadRequest
from proxy.memory.store.records import Kind, MemoryRecord
from proxy.memory.write.llm import LLMUnavailable
from tests.support.processes import MEMPROXY, Process, child_env, fake_upstream_process
from tests.support.router import NGINX, free_port, nginx
from tests.support.s3 import CREDENTIALS, bucket_uri, moto_server_process

RESULTS = Path(__file__).resolve().parent / "results" / "cluster.json"
SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
_REQUEST = re.compile(rb'"(GET|PUT|POST|DELETE|HEAD) ')
TOPICS = ["cooking", "hiking", "music", "travel", "work", "family", "books", "health", "garden", "finance"]


class NoModel:
    """The memory-side model, unreachable: the read path never calls it."""

    async def complete_json(
        self, model: str, messages: list[dict[str, Any]], schema: dict[str, Any], schema_name: str
    ) -> dict[str, Any]:
        raise LLMUnavailable("no model in the cluster benchmark")


def _texts(n: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    return [
        f"Note {i} about {TOPICS[int(rng.integers(len(TOPICS)))]}: item {int(rng.integers(10_000))} "
        f"matters on day {int(rng.integers(365))}"
        for i in range(n)
    ]


def _questions(n: int) -> list[str]:
    return [f"What did I say about {TOPICS[i % len(TOPICS)]} and item {i * 37 % 10_000}?" for i in range(n)]


def _ms(values: Sequence[float]) -> dict[str, float]:
    return {
        "p50": round(percentile(list(values), 50), 2),
        "p99": round(percentile(list(values), 99), 2),
        "max": round(max(values), 2),
        "n": len(values),
    }


class RequestCounter:
    """Object-store requests, counted from the S3 server's request log."""

    def __init__(self, proc: Process) -> None:
        self._path = Path(proc.log_path)
        self._offset = 0
        self._count = 0

    def total(self) -> int:
        """Requests logged so far (complete lines only; read from where the last call stopped)."""
        with self._path.open("rb") as handle:
            handle.seek(self._offset)
            data = handle.read()
        end = data.rfind(b"\n") + 1
        self._count += len(_REQUEST.findall(data[:end]))
        self._offset += end
        return self._count


async def _records(engine: MemoryEngine, users: dict[str, int]) -> list[MemoryRecord]:
    out = []
    for k, (user, n) in enumerate(users.items()):
        texts = _texts(n, k)
        vectors = await engine.embedder.embed_documents(texts)
        out += [
            MemoryRecord(
                user_id=user,
                kind=Kind.TURN if i % 3 else Kind.FACT,
                text=t,
                embedding=v,
                model_id=engine.embedder.model_id,
                conversation_id=f"c{i % 20}",
                role="user",
            )
            for i, (t, v) in enumerate(zip(texts, vectors, strict=True))
        ]
    return out


async def _read_path(
    label: str,
    tree: dict[str, Any],
    records: list[MemoryRecord],
    cold_users: list[str],
    questions: list[str],
    counter: RequestCounter | None,
) -> dict[str, Any]:
    es = engine_settings(load_settings(None, environ={}, overrides=tree))  # AWS_* from this process's environment
    async with MemoryEngine(es, NoModel()) as engine:
        for start in range(0, len(records), 2000):
            await engine.store.add(records[start : start + 2000])
        await engine.store.optimize()
    async with MemoryEngine(es, NoModel()) as engine:  # a fresh process: empty caches
        cold, cold_requests = [], []
        for user in cold_users:
            before = counter.total() if counter else 0
            started = time.perf_counter()
            await engine.inject(ReadRequest(user, "bench", [SYSTEM, {"role": "user", "content": questions[0]}]))
            cold.append((time.perf_counter() - started) * 1000)
            cold_requests.append((counter.total() if counter else 0) - before)
        warm, requests = [], 0
        for i, question in enumerate(questions):
            before = counter.total() if counter else 0
            started = time.perf_counter()
            await engine.inject(
                ReadRequest("bench-user", f"bench-{i}", [SYSTEM, {"role": "user", "content": question}])
            )
            if i >= 20:  # the first ones warm the caches
                warm.append((time.perf_counter() - started) * 1000)
                requests += (counter.total() if counter else 0) - before
    print(f"{label}: warm p50 {percentile(warm, 50):.1f} ms, cold p50 {percentile(cold, 50):.1f} ms", file=sys.stderr)
    return {
        "warm_ms": _ms(warm),
        "cold_first_read_ms": _ms(cold),
        "object_store_requests_per_warm_read": round(requests / len(warm), 2) if counter else 0.0,
        "object_store_requests_per_cold_read": round(float(np.mean(cold_requests)), 2) if counter else 0.0,
    }


async def _load(url: str, users: list[str], concurrency: int, seconds: float) -> dict[str, Any]:
    latencies: list[float] = []
    errors = without_memory = 0
    deadline = time.perf_counter() + seconds
    questions = _questions(64)

    async def worker(session: aiohttp.ClientSession, w: int) -> None:
        nonlocal errors, without_memory
        n = w
        while time.perf_counter() < deadline:
            n += concurrency
            headers = {
                "Content-Type": "application/json",
                "X-Memory-User": users[n % len(users)],
                "X-Memory-Mode": "read",
            }
            started = time.perf_counter()
            try:
                async with session.post(url, data=body(questions[n % len(questions)]), headers=headers) as response:
                    await response.read()
                    if response.status != 200:
                        errors += 1
                        continue
                    without_memory += "degraded=memory" in response.headers.get("X-Memory-Arms", "")
            except (aiohttp.ClientError, TimeoutError):
                errors += 1
                continue
            latencies.append((time.perf_counter() - started) * 1000)

    started = time.perf_counter()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        await asyncio.gather(*(worker(session, w) for w in range(concurrency)))
    wall = time.perf_counter() - started
    return {
        "rps": round(len(latencies) / wall, 2),
        "p50_ms": round(percentile(latencies, 50), 1),
        "p99_ms": round(percentile(latencies, 99), 1),
        "requests": len(latencies),
        "errors": errors,
        "served_without_memory": without_memory,
    }


def _start_replicas(n: int, env: dict[str, str]) -> list[tuple[Process, int]]:
    out = []
    for _ in range(n):
        port = free_port()
        data = tempfile.mkdtemp(prefix="bench-cluster-replica-")
        proc = Process([str(MEMPROXY), "serve", "--port", str(port)], child_env(**env, MEMPROXY_STORAGE__PATH=data))
        out.append((proc, port))
    try:
        for proc, _ in out:
            proc.wait_for(r'"event":\s*"server.started"', timeout=300)
    except BaseException:
        for proc, _ in out:
            proc.stop()
            proc.cleanup()
        raise
    return out


async def _throughput(
    args: argparse.Namespace, endpoint: str, uri: str, users: list[str], counter: RequestCounter
) -> list[dict[str, Any]]:
    rows = []
    with fake_upstream_process(latency_ms=5) as (_, upstream):
        env = {
            **CREDENTIALS,
            "AWS_ENDPOINT_URL": endpoint,
            "MEMPROXY_STORAGE__URI": uri,
            "MEMPROXY_UPSTREAM__BASE_URL": upstream,
            "MEMPROXY_UPSTREAM__API_KEY": "sk-bench",
        }
        replicas = _start_replicas(3, env)
        try:
            for n in (1, 2, 3):
                with (
                    tempfile.TemporaryDirectory(prefix="bench-nginx-") as tmp,
                    nginx(Path(tmp), [f"127.0.0.1:{port}" for _, port in replicas[:n]]) as router,
                ):
                    url = f"{router}/v1/chat/completions"
                    await _load(url, users, args.concurrency, 3.0)  # warm every replica's caches
                    cpu_before = sum(cpu_seconds(p.popen.pid) for p, _ in replicas)
                    requests_before = counter.total()
                    row = await _load(url, users, args.concurrency, args.seconds)
                    row["replicas"] = n
                    row["object_store_requests_per_chat"] = round(
                        (counter.total() - requests_before) / max(1, row["requests"]), 2
                    )
                    row["cpu_ms_per_request"] = round(
                        (sum(cpu_seconds(p.popen.pid) for p, _ in replicas) - cpu_before)
                        * 1000
                        / max(1, row["requests"]),
                        1,
                    )
                    rows.append(row)
                    print(f"{n} replica(s): {row}", file=sys.stderr)
        finally:
            for proc, _ in replicas:
                proc.stop()
                proc.cleanup()
    return rows


async def _main(args: argparse.Namespace) -> dict[str, Any]:
    load_before = os.getloadavg()[0]
    cold_users = [f"cold-{i}" for i in range(args.cold_users)]
    users = {"bench-user": args.memories, **dict.fromkeys(cold_users, args.cold_memories)}
    questions = _questions(args.requests + 20)
    with moto_server_process() as (moto, endpoint), tempfile.TemporaryDirectory(prefix="bench-cluster-") as tmp:
        counter = RequestCounter(moto)
        uri = bucket_uri("bench")
        async with MemoryEngine(
            engine_settings(load_settings(None, environ={}, overrides={"storage": {"path": f"{tmp}/embed"}})), NoModel()
        ) as embedding:
            records = await _records(embedding, users)
        local = await _read_path("local", {"storage": {"path": f"{tmp}/local"}}, records, cold_users, questions, None)
        os.environ.update({**CREDENTIALS, "AWS_ENDPOINT_URL": endpoint})
        s3 = await _read_path(
            "s3", {"storage": {"path": f"{tmp}/s3", "uri": uri}}, records, cold_users, questions, counter
        )
        throughput = await _throughput(args, endpoint, uri, ["bench-user", *cold_users], counter) if NGINX else []
    return {
        "read_path": {"local": local, "object_storage": s3},
        "throughput": throughput,
        "meta": {
            "memories_warm_user": args.memories,
            "cold_users": args.cold_users,
            "memories_per_cold_user": args.cold_memories,
            "concurrency": args.concurrency,
            "seconds_per_row": args.seconds,
            "s3": "moto 5.2.5 server on 127.0.0.1 (requests serialised)",
            "note": "all replicas share 2 cores: throughput is CPU-bound and does not scale here",
            "python": platform.python_version(),
            "machine": f"{platform.machine()}, {os.cpu_count()} cpus",
            "load_before": round(load_before, 2),
            "load_after": round(os.getloadavg()[0], 2),
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
        },
    }


def _print(document: dict[str, Any]) -> None:
    print("| backend | warm p50 ms | warm p99 ms | cold first read p50 ms | cold max ms | S3 req/warm read |")
    print("|---|---|---|---|---|---|")
    for name, row in document["read_path"].items():
        print(
            f"| {name} | {row['warm_ms']['p50']} | {row['warm_ms']['p99']} | {row['cold_first_read_ms']['p50']} "
            f"| {row['cold_first_read_ms']['max']} | {row['object_store_requests_per_warm_read']} |"
        )
    print("\n| replicas | req/s | p50 ms | p99 ms | without memory | errors | S3 req/chat | CPU ms/req |")
    print("|---|---|---|---|---|---|---|---|")
    for row in document["throughput"]:
        print(
            f"| {row['replicas']} | {row['rps']} | {row['p50_ms']} | {row['p99_ms']} | "
            f"{row['served_without_memory']}/{row['requests']} | {row['errors']} | "
            f"{row['object_store_requests_per_chat']} | {row['cpu_ms_per_request']} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--memories", type=int, default=2000)
    parser.add_argument("--cold-users", type=int, default=8)
    parser.add_argument("--cold-memories", type=int, default=300)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    document = asyncio.run(_main(args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(document, indent=2) + "\n")
    _print(document)


if __name__ == "__main__":
    main()
