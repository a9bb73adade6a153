"""End to end with memory on: the real CLI process, the real openai SDK, the embedded model on disk."""

from __future__ import annotations

import signal
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.support.processes import fake_upstream_process, memproxy_process

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def upstream() -> Iterator[str]:
    """The fake upstream for the module."""
    with fake_upstream_process() as (_, url):
        yield url


def _env(upstream: str, data: Path) -> dict[str, str]:
    return {
        "MEMPROXY_UPSTREAM__BASE_URL": upstream,
        "MEMPROXY_STORAGE__PATH": str(data),
        "MEMPROXY_UPSTREAM__API_KEY": "sk-upstream-e2e",
        # behaviour, not speed, is under test here (the machine is shared; benchmarks measure speed)
        "MEMPROXY_MEMORY__RETRIEVAL_TIMEOUT_MS": "20000",
        "MEMPROXY_RETRIEVAL__ARM_TIMEOUT_MS": "20000",
        "MEMPROXY_MEMORY__READ_QUEUE_MS": "20000",
    }


def _ask(client: openai.OpenAI, text: str, user: str, conversation: str) -> openai.types.chat.ChatCompletion:
    return client.chat.completions.with_raw_response.create(  # type: ignore[return-value]
        model="fake-echo",
        messages=[{"role": "user", "content": text}],
        extra_headers={"X-Memory-User": user, "X-Memory-Conversation": conversation},
    )


def test_memory_survives_restart_and_stays_per_user(upstream: str, tmp_path: Path) -> None:
    """Ready after start; a fact told before a restart is injected after it, for that user only."""
    with memproxy_process(_env(upstream, tmp_path)) as (proc, url):
        with urllib.request.urlopen(url.removesuffix("/v1") + "/readyz", timeout=5) as ready:  # noqa: S310
            assert ready.status == 200
        client = openai.OpenAI(base_url=url, api_key="sk-client", max_retries=0)
        raw = _ask(client, "Remember that my favourite tea is genmaicha.", "ann", "first")
        assert raw.headers["X-Memory-Mode"] == "full"  # type: ignore[attr-defined]
        time.sleep(1.5)  # the write path runs after the reply; it is searchable within ~1 s
        assert proc.stop() == 0
    with memproxy_process(_env(upstream, tmp_path)) as (_, url):
        client = openai.OpenAI(base_url=url, api_key="sk-client", max_retries=0)
        raw = _ask(client, "Which tea do I like best?", "ann", "second")
        assert int(raw.headers["X-Memory-Injected"]) >= 1  # type: ignore[attr-defined]
        raw = _ask(client, "Which tea do I like best?", "ben", "third")
        assert raw.headers["X-Memory-Injected"] == "0"  # type: ignore[attr-defined]


def test_sigterm_lets_a_stream_finish(upstream: str, tmp_path: Path) -> None:
    """On SIGTERM, an in-flight stream runs to its end and the process exits cleanly."""
    with memproxy_process(_env(upstream, tmp_path)) as (proc, url):
        client = openai.OpenAI(base_url=url, api_key="sk-client", max_retries=0)
        stream = client.chat.completions.create(
            model="fake-drip", stream=True, messages=[{"role": "user", "content": "go"}]
        )
        chunks = 0
        killer = threading.Timer(0.5, proc.popen.send_signal, args=(signal.SIGTERM,))
        killer.start()
        for chunk in stream:
            chunks += 1 if chunk.choices and chunk.choices[0].delta.content else 0
        killer.join()
        assert chunks >= 200
        assert proc.stop() == 0
        assert "server.stopped" in proc.output
