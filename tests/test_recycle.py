"""proxy.recycle: when a quiet process restarts in place, and that the restart keeps the PID, the port and
every memory (what it gives back under load is measured by bench-writes, not here)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import httpx

from proxy.heap import QuietTrimmer
from proxy.recycle import Activity, Recycler
from tests.support.processes import fake_upstream_process, memproxy_process


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0
        self.cpu = 10.0

    def __call__(self) -> float:
        return self.now


def recycler(
    clock: Clock, activity: Activity, rss: list[float], busy: list[bool | None]
) -> tuple[Recycler, QuietTrimmer]:
    """A recycler whose CPU quiet comes from a heap trimmer on the same clock, checked before it (as serve does)."""

    async def jobs() -> bool | None:
        return busy[0]

    trimmer = QuietTrimmer(clock=clock, cpu=lambda: clock.cpu)
    return Recycler(1.3, 64.0, 30.0, activity, jobs, quiet=lambda: trimmer.quiet, rss=lambda: rss[0]), trimmer


async def test_a_quiet_process_grown_past_its_start_up_level_is_due_and_only_then() -> None:
    """Due once RSS is past both bounds over the level after start-up, no request came for the quiet window,
    no job is due or running and the last check used little CPU; not while any of these fails."""
    clock, rss, busy = Clock(), [250.0], [None]
    activity = Activity(clock)
    r, trimmer = recycler(clock, activity, rss, busy)

    async def due_after(seconds: float, cpu: float = 0.0) -> str | None:
        clock.now += seconds
        clock.cpu += cpu
        trimmer.due()
        return await r.due()

    assert await due_after(5) is None
    assert r.baseline_mb is None
    busy[0] = False
    assert await due_after(5) is None
    assert r.baseline_mb == 250.0
    rss[0] = 240.0  # lower: the level after start-up is the lowest seen
    assert await due_after(5) is None
    assert r.baseline_mb == 240.0
    rss[0] = 250.0
    assert await due_after(5) is None
    assert r.baseline_mb == 240.0
    rss[0] = 310.0  # 1.29x: under the growth
    assert await due_after(60) is None
    rss[0] = 400.0
    assert await due_after(5, cpu=1.0) is None  # busy with something (20% of a core)
    busy[0] = True
    assert await due_after(5) is None  # a job is due or running
    busy[0] = False
    activity.in_flight = 1
    assert await due_after(5) is None  # a request in flight
    activity.in_flight, activity.last_end = 0, clock.now - 10
    assert await due_after(0.1) is None  # the last one ended 10 s ago
    reason = await due_after(25)
    assert reason is not None
    assert "400 MB" in reason
    assert "240 MB" in reason


async def test_small_processes_need_the_absolute_growth_too() -> None:
    """A 100 MB process at 140 MB (1.4x) is not due: growth under ``min_growth_mb`` is not worth a restart."""
    clock, rss, busy = Clock(), [100.0], [False]
    r, trimmer = recycler(clock, Activity(clock), rss, busy)
    clock.now += 5
    trimmer.due()
    await r.due()
    rss[0] = 140.0
    clock.now += 60
    trimmer.due()
    assert await r.due() is None
    rss[0] = 170.0
    clock.now += 5
    trimmer.due()
    assert await r.due() is not None


async def test_probes_and_scrapes_are_not_work() -> None:
    """Health checks and metrics scrapes do not keep a process from going quiet; other requests do."""
    clock = Clock()
    activity = Activity(clock)

    async def handler(request: object) -> str:
        clock.now += 1
        return "ok"

    class Request:
        def __init__(self, path: str) -> None:
            self.path = path

    clock.now += 100
    for path in ("/healthz", "/readyz", "/metrics"):
        await activity.middleware(Request(path), handler)  # type: ignore[arg-type]
    assert activity.idle_s() >= 100
    await activity.middleware(Request("/v1/chat/completions"), handler)  # type: ignore[arg-type]
    assert activity.idle_s() == 0.0


def test_a_restart_in_place_keeps_the_pid_the_port_and_every_memory(tmp_path: Path) -> None:
    """With thresholds that any level passes, memproxy restarts itself once quiet: the same process (PID)
    answers on the same port, a request sent while it restarts is answered (it waited in the socket's
    backlog), and what it remembered before is injected after."""
    recycle = {
        "MEMPROXY_SERVER__RECYCLE_RSS_GROWTH": "1.0",
        "MEMPROXY_SERVER__RECYCLE_MIN_GROWTH_MB": "0",
        "MEMPROXY_SERVER__RECYCLE_QUIET_S": "1",
    }
    with fake_upstream_process(0.0) as (_, upstream):
        env = {
            "MEMPROXY_UPSTREAM__BASE_URL": upstream,
            "MEMPROXY_UPSTREAM__API_KEY": "sk-test",
            "MEMPROXY_STORAGE__PATH": str(tmp_path / "data"),
            **recycle,
        }
        with memproxy_process(env) as (proc, base):
            pid = proc.popen.pid
            headers = {"X-Memory-User": "ana", "Authorization": "Bearer sk-test"}

            def chat(text: str) -> httpx.Response:
                body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": text}]}
                return httpx.post(f"{base}/chat/completions", json=body, headers=headers, timeout=60)

            assert chat("I adopted a cat named Miso").status_code == 200
            proc.wait_for(r'"event":\s*"server.recycling"', timeout=90)
            during: list[httpx.Response] = []
            sender = threading.Thread(target=lambda: during.append(chat("Is Miso a good name for a cat?")))
            sender.start()
            proc.wait_for(r'"restarted_in_place":\s*true', timeout=90)
            sender.join(60)
            assert during
            assert during[0].status_code == 200
            assert proc.popen.poll() is None
            assert os.path.exists(f"/proc/{pid}")
            assert int(chat("What is my cat called?").headers["X-Memory-Injected"]) >= 1
