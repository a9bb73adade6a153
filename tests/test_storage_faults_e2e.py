"""The real ``memproxy serve`` on a data directory made read-only: while running, and from the start."""

from __future__ import annotations

import asyncio
import re
import signal
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from tests.support.processes import fake_upstream_process, memproxy_process
from tests.support.readonly import read_only
from tests.test_answered_stored import stored_turn_tokens, wait_for_drain


async def _chat(session: aiohttp.ClientSession, url: str, token: str, *, stream: bool) -> dict[str, str]:
    """One exchange carrying ``token``; returns the response headers once the answer is complete."""
    body = {
        "model": "fake-echo",
        "stream": stream,
        "messages": [{"role": "user", "content": f"please note item <{token}> now"}],
    }
    headers = {"X-Memory-User": "crash-ann", "X-Memory-Conversation": "conv-ro"}
    async with session.post(f"{url}/chat/completions", json=body, headers=headers) as response:
        assert response.status == 200
        raw = await response.read()
        if not stream:
            assert f"<{token}>" in orjson.loads(raw)["choices"][0]["message"]["content"]
        else:
            assert b'"finish_reason":"stop"' in raw
        return dict(response.headers)


async def _json(session: aiohttp.ClientSession, url: str) -> tuple[int, Any]:
    async with session.get(url) as response:
        return response.status, await response.json()


async def _spool_empty(session: aiohttp.ClientSession, base: str, within_s: float = 60.0) -> None:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        async with session.get(f"{base}/metrics") as response:
            text = await response.text()
        if re.search(r"^memproxy_write_spool_exchanges 0\.0$", text, re.MULTILINE):
            return
        await asyncio.sleep(0.3)
    raise AssertionError("the spool was not drained")


def _env(upstream: str, data: Path) -> dict[str, str]:
    return {
        "MEMPROXY_UPSTREAM__BASE_URL": upstream,
        "MEMPROXY_UPSTREAM__API_KEY": "sk-upstream",  # the test's clients send none
        "MEMPROXY_STORAGE__PATH": str(data),
        "MEMPROXY_JOBS__POLL_INTERVAL_S": "0.1",
        "MEMPROXY_JOBS__BACKOFF_BASE_S": "0.1",
        "MEMPROXY_JOBS__BACKOFF_MAX_S": "1",
        "MEMPROXY_MEMORY__RETRIEVAL_TIMEOUT_MS": "5000",
    }


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_data_dir_read_only_while_running_loses_no_answered_exchange(tmp_path: Path) -> None:
    """Read-only mid-run: chat goes on and says so; writable again: every answered exchange is stored once."""
    data = tmp_path / "data"
    tokens = []
    with fake_upstream_process() as (_, upstream), memproxy_process(_env(upstream, data)) as (proc, url):
        base = url.removesuffix("/v1")
        async with aiohttp.ClientSession() as session:
            for i in range(3):
                tokens.append(f"k0x{i}")
                await _chat(session, url, tokens[-1], stream=bool(i % 2))
            await wait_for_drain(url)
            with read_only(data):
                during = []
                for i in range(6):
                    tokens.append(f"k1x{i}")
                    during.append(await _chat(session, url, tokens[-1], stream=bool(i % 2)))
                status, ready = await _json(session, f"{base}/readyz")
                await asyncio.sleep(3)  # retries run meanwhile: they must not flood the log
                async with session.get(f"{base}/metrics") as response:
                    metrics_text = await response.text()
                lines_during = len(proc.lines)
            assert all("degraded=write:" in h["X-Memory-Arms"] for h in during[1:])
            assert status == 200
            assert "storage" in ready
            assert "memproxy_jobs_storage_failing 1.0" in metrics_text
            assert re.search(r"^memproxy_write_spool_exchanges [1-9]", metrics_text, re.MULTILINE)
            await _spool_empty(session, base)
            assert await wait_for_drain(url) == 0
        proc.stop(signal.SIGTERM)
        output = proc.output
    counts = await stored_turn_tokens(data)
    for token in tokens:
        assert (counts[(token, "user")], counts[(token, "assistant")]) == (1, 1), token
    faults = [line for line in output.splitlines() if '"storage.fault"' in line or '"memory.spooling"' in line]
    print("\n".join(faults))  # shown with -s: which components failed, and why
    assert faults, "the read-only directory was never noticed"
    assert len(faults) <= 5, "one line per component and fault, not one per attempt"
    assert '"storage.recovered"' in output or '"memory.spool_drained"' in output
    assert lines_during < 120, "the fault flooded the log"
    assert '"job.dead"' not in output


@pytest.mark.e2e
@pytest.mark.slow
async def test_data_dir_read_only_at_start_serves_chat_without_memory(tmp_path: Path) -> None:
    """Started on a read-only data directory, memproxy serves chat without memory and says why everywhere."""
    data = tmp_path / "data"
    data.mkdir()
    with (
        fake_upstream_process() as (_, upstream),
        read_only(data),
        memproxy_process(_env(upstream, data)) as (proc, url),
    ):
        base = url.removesuffix("/v1")
        async with aiohttp.ClientSession() as session:
            headers = await _chat(session, url, "k9x0", stream=False)
            await _chat(session, url, "k9x1", stream=True)
            status, ready = await _json(session, f"{base}/readyz")
        proc.wait_for('"memory.unavailable"')
    assert "degraded=memory:storage:" in headers["X-Memory-Arms"]
    assert "degraded=write:unavailable:" in headers["X-Memory-Arms"]
    assert status == 200
    assert ready["memory"] is False
    assert ready["storage"].startswith("unavailable:")
