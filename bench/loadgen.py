"""One async load generator for every benchmark: closed-loop clients, latency and time to first byte.

Each of ``concurrency`` workers sends requests back to back for ``requests`` in total; a non-stream request's
latency is the time to the full body, a stream's TTFT is the time to the first SSE event.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import statistics
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import orjson

APP_KEY = "sk-bench-app"  # what an app's OpenAI client sends (the SDKs always send a key; the fake upstream wants one)


@dataclasses.dataclass
class Sample:
    """What one run of one target at one concurrency measured."""

    latencies_ms: list[float]
    ttfts_ms: list[float]
    errors: int
    wall_s: float

    @property
    def rps(self) -> float:
        """Completed requests per second."""
        return (len(self.latencies_ms) + len(self.ttfts_ms)) / self.wall_s if self.wall_s else 0.0


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100) by linear interpolation; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def body(user_text: str, *, stream: bool = False, model: str = "fake-echo") -> bytes:
    """A small chat request."""
    payload: dict[str, Any] = {
        "model": model,
        "stream": stream,
        "messages": [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": user_text}],
    }
    return orjson.dumps(payload)


async def _one(
    session: aiohttp.ClientSession, url: str, data: bytes, headers: Mapping[str, str], stream: bool
) -> float:
    started = time.perf_counter()
    async with session.post(url, data=data, headers=headers) as response:
        if stream:
            await response.content.readany()
            ttft = time.perf_counter() - started
            await response.read()
            response.raise_for_status()
            return ttft * 1000
        await response.read()
        response.raise_for_status()
    return (time.perf_counter() - started) * 1000


async def run(
    url: str,
    *,
    concurrency: int,
    requests: int,
    stream: bool = False,
    headers: Mapping[str, str] | None = None,
    texts: list[str] | None = None,
    users: Sequence[str] | None = None,
) -> Sample:
    """Drive ``url`` with ``concurrency`` closed-loop clients until ``requests`` are done; with ``users``, request
    ``i`` is ``users[i % len(users)]``'s (``X-Memory-User``)."""
    hdrs = {"Content-Type": "application/json", "Authorization": f"Bearer {APP_KEY}", **(headers or {})}
    prompts = texts or ["What did I say about my plans for the weekend?"]
    results: list[float] = []
    errors = 0
    counter = iter(range(requests))
    connector = aiohttp.TCPConnector(limit=concurrency * 2)

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal errors
        for index in counter:
            data = body(prompts[index % len(prompts)], stream=stream)
            sent = hdrs if not users else {**hdrs, "X-Memory-User": users[index % len(users)]}
            try:
                results.append(await _one(session, url, data, sent, stream))
            except (aiohttp.ClientError, TimeoutError):
                errors += 1

    async with aiohttp.ClientSession(connector=connector) as session:
        started = time.perf_counter()
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
        wall = time.perf_counter() - started
    if stream:
        return Sample([], results, errors, wall)
    return Sample(results, [], errors, wall)


def _stat(path: Path) -> tuple[str, float]:
    """The name and user + system CPU seconds in a ``/proc`` stat file (of a process or one of its threads)."""
    name, _, rest = path.read_text().partition(" (")[2].rpartition(") ")
    fields = rest.split()
    return name, (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a process (all its threads) has used so far (Linux ``/proc``; 0 once it is gone)."""
    try:
        return _stat(Path(f"/proc/{pid}/stat"))[1]
    except (FileNotFoundError, ProcessLookupError):
        return 0.0


def thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds each kind of thread of a process has used so far, by thread name with its number dropped
    (``lancedb-tokio-w``, ``merge_thread_``, ``python`` for the interpreter and threads that did not name
    themselves...); threads that ended are not counted, so compare a long-lived pool's figures only."""
    out: dict[str, float] = {}
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except (FileNotFoundError, ProcessLookupError):
        return out
    for task in tasks:
        try:
            name, cpu = _stat(task / "stat")
        except (FileNotFoundError, ProcessLookupError):
            continue
        kind = name.rstrip("0123456789-")
        out[kind] = out.get(kind, 0.0) + cpu
    return out


def rss_mb(pid: int) -> float:
    """Resident memory of a process in MiB (Linux ``/proc``; 0 once it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except (FileNotFoundError, ProcessLookupError):
        pass
    return 0.0


def merge(samples: list[Sample]) -> Sample:
    """Several rounds of one cell as one sample."""
    return Sample(
        [v for s in samples for v in s.latencies_ms],
        [v for s in samples for v in s.ttfts_ms],
        sum(s.errors for s in samples),
        sum(s.wall_s for s in samples),
    )


def median(values: list[float]) -> float:
    """The median, NaN for no values."""
    return statistics.median(values) if values else float("nan")
