"""The write side under a busy app and what it costs to learn (``make bench-writes``).

Runs ``memproxy serve`` (the CLI, a fresh data directory, product defaults unless told otherwise) against a
fake upstream in this process that answers at once: the chat itself and the memory-side calls (extraction,
reconciliation, summaries, insights), which it counts with their prompt tokens (tiktoken ``cl100k_base``,
messages plus the response schema).

- **sustained** (``--minutes``, 10 for the bar): a closed loop of ``--concurrency`` clients in full mode, 200
  users, one message each, no conversation header, so the proxy serves at the read path's capacity; the
  chat's answers are unique and ~400 characters long (``chat_reply``: a constant answer would be embedded
  once and then served from memproxy's vector cache, leaving the write side nothing to embed). Each
  second one probe exchange carries a unique word; the probe polls the management API until that turn is
  listed (reply -> searchable). A row per minute: arrivals (chat requests that became exchanges), drained
  (exchange jobs finished), ready_at_end (jobs due and waiting at the minute's end), reply -> searchable p50 /
  p99 and the slowest probe (``slowest_probe``: when it started, UTC, to line it up with memproxy's log),
  memproxy's RSS. Before the load, 20 warm-up exchanges and all their jobs (fact windows included), then
  5 s of quiet: RSS (``rss_before_mb``). After the load: wait until no job but insights is due or running
  (``wait_drained``), RSS 5 s later
  (``rss_at_drain_mb``), again 10 s later once it answers /readyz (``rss_after_drain_mb``), and a minute later
  (``rss_a_minute_later_mb``: what a minute of quiet hands back; ``same_processes_after_drain``: no memproxy
  process was replaced meanwhile); the texts embedded per exchange over the run (``texts_embedded_per_exchange``:
  the answering chat process's queries and the writer's documents, from /metrics), and each minute the writer's
  texts per arrival by its document model and by the static side instead (``writer_texts_per_arrival``: the
  model's share of the write side). Once memproxy has stopped: the memory
  table on disk as it left it and after a compaction that keeps no old version, against its live data (the
  current version's data files), and the whole data directory (``disk``).
- **replay**: LoCoMo's conversations (``/work/shared/data/locomo``) through the proxy in write mode, each turn
  one exchange from its speaker (the other speaker's next turn is the assistant's reply, a session is a
  conversation). The fake memory-side model stands in for a perfect extractor: it answers an extraction call
  with the dataset's observations cited on the turns it was shown. Reports memory-side calls and prompt
  tokens per exchange, facts kept vs the dataset's observations, and the share of the observations' turns
  that reached extraction (the pre-filter's recall, end to end). Summaries run 2 s after a conversation's last
  turn (LoCoMo's sessions are days apart; the default waits 30 min). Insights (15 min after a user's last
  activity, one call per cluster, owned by the insights module) do not run within the replay and are not counted.

Writes ``bench/results/writes.json``; prints both tables.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import os
import platform
import random
import re
import sqlite3
import sys
import tempfile
import time
import warnings
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.loadgen import cpu_seconds, percentile, rss_mb, thread_cpu_s
from bench.locomo import DATA, Conversation, load_conversations
from tests.fake_upstream import minimal_instance
from tests.support.processes import DEPLOYED_ALLOCATOR, memproxy_process, process_tree

RESULTS = Path(__file__).resolve().parent / "results" / "writes.json"
ADMIN_KEY = "bench-writes-admin-key"
PROBE_INTERVAL_S = 1.0
WARM_SETTLE_S = 25.0  # the warm-up's fact windows fire after 20 s ([writer] facts_window_wait_s)
TRIM_WAIT_S = 65.0  # RSS is read again this long after the drain: a minute of memproxy idle
QUERY_VECTOR_BYTES = 1_600  # a cached query vector with its key (embedders/settings.py)
RSS_MARGIN_MB = 160.0  # per memory process, above its start-up RSS and cache budgets (allocator slack, buffers)


def _tokenizer() -> Any:
    """cl100k_base from the copy LiteLLM ships (no download; LiteLLM itself is not imported)."""
    spec = importlib.util.find_spec("litellm")
    if spec is not None and spec.origin is not None:
        os.environ.setdefault("TIKTOKEN_CACHE_DIR", str(Path(spec.origin).parent / "litellm_core_utils" / "tokenizers"))
    import tiktoken

    return tiktoken.get_encoding("cl100k_base")


# ------------------------------------------------------------------------------------ the fake upstream


@dataclass
class Ledger:
    """What the memory side asked the model: calls and prompt tokens per call name."""

    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    tokens: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    chat_calls: int = 0
    shown: set[str] = field(default_factory=set)  # user messages shown to extraction
    windows: list[int] = field(default_factory=list)  # exchanges per extraction call


class Upstream:
    """An OpenAI-compatible fake answering at once; ``replies`` maps a user message to the chat's answer and
    ``observations`` maps a user message to the facts a perfect extractor would find in it."""

    def __init__(self) -> None:
        self.ledger = Ledger()
        self.replies: dict[str, str] = {}
        self.default_reply: Callable[[str], str] = lambda _: "OK."  # for a message ``replies`` does not know
        self.observations: dict[str, list[str]] = {}
        self._encoding = _tokenizer()
        self._runner: web.AppRunner | None = None
        self.base_url = ""

    async def __aenter__(self) -> Upstream:
        app = web.Application(client_max_size=64 * 2**20)
        app.router.add_post("/v1/chat/completions", self._chat)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.base_url = f"http://127.0.0.1:{self._runner.addresses[0][1]}/v1"
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def prompt_tokens(self, body: Mapping[str, Any]) -> int:
        """Tokens of the messages' contents and of the response schema (providers bill both)."""
        texts = [str(m.get("content") or "") for m in body.get("messages", [])]
        schema = (body.get("response_format") or {}).get("json_schema")
        texts += [json.dumps(schema)] if schema else []
        return sum(len(self._encoding.encode(text)) for text in texts)

    async def _chat(self, request: web.Request) -> web.Response:
        body = await request.json()
        schema = ((body.get("response_format") or {}).get("json_schema") or {}).get("name")
        if schema is None:
            self.ledger.chat_calls += 1
            messages = body.get("messages", [])
            last = str(messages[-1].get("content", "")) if messages else ""
            return _completion(self.replies[last] if last in self.replies else self.default_reply(last))
        self.ledger.calls[schema] += 1
        self.ledger.tokens[schema] += self.prompt_tokens(body)
        return _completion(json.dumps(self._memory_answer(schema, body)))

    def _memory_answer(self, schema: str, body: Mapping[str, Any]) -> dict[str, Any]:
        try:
            data = json.loads(body["messages"][-1]["content"])
        except (KeyError, IndexError, TypeError, ValueError):
            data = {}
        if schema == "memory_facts":
            return {"facts": self._facts(data)}
        if schema == "memory_reconcile":
            return {"decision": "ADD", "target": 0, "text": ""}
        if schema == "memory_reconcile_many":
            return {"decisions": []}
        if schema == "memory_summary":
            return {"summary": "The user and their friend caught up on recent news.", "topics": ["news"]}
        return minimal_instance(body["response_format"]["json_schema"]["schema"])  # insights: nothing learnt

    def _facts(self, data: Mapping[str, Any]) -> list[dict[str, Any]]:
        out = []
        self.ledger.windows.append(len(data.get("exchanges", [])))
        for exchange in data.get("exchanges", []):
            for text in exchange.get("user", []):
                self.ledger.shown.add(text)
                out += [_fact(o, exchange.get("n", 0)) for o in self.observations.get(text, [])]
        return out


def chat_reply(message: str) -> str:
    """A chat model's answer to ``message`` as far as the write side can tell: unique (it quotes the message,
    so its vector is never a cache hit) and of an ordinary length (~400 characters, ~90 tokens)."""
    return (
        f'You said: "{message}". That is a lot to keep in mind at once, and it is worth taking one piece at a '
        "time. Start with what has a date attached, write down the two or three things that would make the "
        "biggest difference this week, and leave the rest for later. Tell me how it goes and I will keep it "
        "in mind."
    )


def _fact(text: str, exchange: int) -> dict[str, Any]:
    return {"text": text, "category": "other", "importance": 5, "entities": [], "sensitive": False,
            "sensitive_category": "none", "explicit_request": False, "exchange": exchange}  # fmt: skip


def _completion(content: str) -> web.Response:
    return web.json_response({
        "id": "chatcmpl-bench", "object": "chat.completion", "created": 0, "model": "fake-echo",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    })  # fmt: skip


# ------------------------------------------------------------------------------------------ memproxy


@contextlib.contextmanager
def memproxy(upstream: str, data: Path, env: Mapping[str, str]) -> Iterator[tuple[int, str]]:
    """``memproxy serve`` on a fresh data directory; yields its pid and base URL (ending in /v1)."""
    base = {
        "MEMPROXY_UPSTREAM__BASE_URL": upstream, "MEMPROXY_UPSTREAM__API_KEY": "sk-bench",
        "MEMPROXY_STORAGE__PATH": str(data), "MEMPROXY_ADMIN__API_KEY": ADMIN_KEY, **DEPLOYED_ALLOCATOR,
    }  # fmt: skip
    with memproxy_process({**base, **env}, timeout=180.0) as (proc, url):
        yield proc.popen.pid, url


PART_LINE = re.compile(r'^memproxy_memory_bytes\{(?:process="(\w+)",)?part="(\w+)"\} (\S+)$', re.M)
STAGE_LINE = re.compile(r'^memproxy_stage_seconds_(sum|count)\{stage="([a-z_]+)"\} (\S+)$', re.M)
WRITER_TEXTS_LINE = re.compile(r'^memproxy_embedder_(\w+_total)\{process="writer"\} (\S+)$', re.M)


def rss_parts_mb(pid: int) -> dict[str, float]:
    """RSS of each of memproxy's processes (the supervisor and its children), MB."""
    return {role: round(rss_mb(child), 1) for child, role in sorted(process_tree(pid).items())}


def rss_kinds_mb(pid: int, data: Path) -> dict[str, dict[str, float]]:
    """Each memproxy process's resident memory by kind (``/proc``'s RssAnon: its own heap and buffers; RssFile:
    pages of files it maps, which the kernel can take back; RssShmem), and the mapped files' share by where they
    are (``file:data/<top folder>`` inside the data directory, else ``file:other``: ``mapped_mb``), MB."""
    out = {}
    for child, role in sorted(process_tree(pid).items()):
        kinds: dict[str, float] = {}
        try:
            for line in Path(f"/proc/{child}/status").read_text().splitlines():
                if line.startswith(("RssAnon:", "RssFile:", "RssShmem:")):
                    kinds[line.split(":")[0][3:].lower()] = round(int(line.split()[1]) / 1024, 1)
            kinds.update(mapped_mb(child, data))
        except (FileNotFoundError, ProcessLookupError):
            continue
        out[role] = kinds
    return out


def mapped_mb(pid: int, data: Path) -> dict[str, float]:
    """Resident pages of the files ``pid`` maps, by where they are (``file:data/<top folder>`` or
    ``file:other``), MB."""
    root, totals, where = str(data.resolve()) + "/", {}, None
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = line.split(None, 5)
        if len(head) == 6 and "-" in head[0] and head[5].startswith("/"):  # a mapping of a file
            path = head[5]
            where = "file:data/" + path[len(root) :].split("/", 1)[0] if path.startswith(root) else "file:other"
        elif len(head) >= 5 and "-" in head[0]:
            where = None  # anonymous or special ([heap], [stack], ...)
        elif where is not None and line.startswith("Rss:"):
            totals[where] = totals.get(where, 0) + int(line.split()[1])
    return {key: round(kb / 1024, 1) for key, kb in sorted(totals.items())}


def cpu_parts_s(pid: int) -> dict[str, float]:
    """CPU seconds used so far by each of memproxy's processes, by role."""
    return {role: cpu_seconds(child) for child, role in sorted(process_tree(pid).items())}


def thread_parts_s(pid: int) -> dict[str, dict[str, float]]:
    """CPU seconds used so far by each kind of thread (``loadgen.thread_cpu_s``) of each memproxy process."""
    return {role: thread_cpu_s(child) for child, role in sorted(process_tree(pid).items()) if role != "supervisor"}


def memproxy_rss_mb(pid: int) -> float:
    """Resident memory of memproxy: the sum over its processes, in MB."""
    return sum(rss_parts_mb(pid).values())


def rss_bound_mb(rss_before: float, processes: int) -> float:
    """What memproxy's RSS must stay under: its RSS after start-up and warm-up, plus each memory process's
    configured cache budgets (``cache_budgets_mb``), plus ``RSS_MARGIN_MB`` a process (the README's statement)."""
    return round(rss_before + processes * (cache_budgets_mb() + RSS_MARGIN_MB), 1)


def cache_budgets_mb() -> float:
    """One memory process's configured cache budgets (product defaults), MB: the vector cache, LanceDB's
    caches, the conversations' ledger and the query vectors' cache (``QUERY_VECTOR_BYTES`` a text)."""
    from proxy.config import Settings

    settings = Settings()
    store, injection = settings.store_settings(), settings.injection
    total = store.vector_cache_bytes + store.lance_cache_bytes + injection.conversations_cache_bytes
    return (total + settings.embedder.query_cache_size * QUERY_VECTOR_BYTES) / 2**20


async def gauges(session: aiohttp.ClientSession, base: str, prefix: str = "memproxy_jobs_") -> dict[str, float]:
    """memproxy's ``<prefix>*`` numbers (``memproxy_jobs_*`` by default), each summed over its samples (the
    answering chat process's and the writer's, ``process="writer"``)."""
    async with session.get(base.removesuffix("/v1") + "/metrics") as response:
        text = await response.text()
    out: dict[str, float] = defaultdict(float)
    for line in text.splitlines():
        if line.startswith(prefix):
            name, value = line.rsplit(" ", 1)
            out[name.split("{", 1)[0].removeprefix(prefix)] += float(value)
    return dict(out)


async def wait_drained(data: Path, limit_s: float, *, settle_s: float = 0.0) -> float:
    """Seconds until no job but insights is due or running, and none finished or became due within ``settle_s``
    after (windows and summaries waiting for their time; insights, 15 min after a user's last activity, are not
    waited for: the probes' users, one a second, keep theirs coming due for 15 minutes after the load)."""
    started = time.monotonic()
    quiet_since, last = None, None
    while time.monotonic() - started < limit_s:
        busy, activity = await asyncio.to_thread(drain_counts, data)
        if busy or activity != last:
            quiet_since, last = (None if busy else time.monotonic()), activity
        elif quiet_since is not None and time.monotonic() - quiet_since >= settle_s:
            break
        await asyncio.sleep(0.5)
    return time.monotonic() - started


def drain_counts(data: Path) -> tuple[int, float | None]:
    """Jobs other than insights due or running, and the latest change to one of them, read (SELECT only) from the
    queue's SQLite file (see ``queue_counts``)."""
    with contextlib.closing(sqlite3.connect(data / "jobs.sqlite3" / "jobs.sqlite3")) as c:
        c.execute("PRAGMA busy_timeout=10000")
        busy = c.execute(
            "SELECT COUNT(*) FROM jobs WHERE kind != 'insights'"
            " AND (state = 'running' OR (state = 'pending' AND run_after <= ?))",
            (time.time(),),
        ).fetchone()[0]
        latest = c.execute("SELECT MAX(updated_at) FROM jobs WHERE kind != 'insights'").fetchone()[0]
        return int(busy), latest


async def chat(
    session: aiohttp.ClientSession, base: str, user: str, messages: list[dict[str, str]], mode: str,
    conversation: str | None = None,
) -> int:  # fmt: skip
    """One chat request through the proxy; returns the HTTP status."""
    headers = {"Authorization": "Bearer sk-bench", "X-Memory-User": user, "X-Memory-Mode": mode}
    if conversation is not None:
        headers["X-Memory-Conversation"] = conversation
    body = {"model": "fake-echo", "messages": messages}
    async with session.post(f"{base}/chat/completions", json=body, headers=headers) as response:
        await response.read()
        return response.status


async def listed(session: aiohttp.ClientSession, base: str, user: str, word: str) -> bool:
    """Whether the user's turns (management API) hold ``word``."""
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    url = f"{base}/memory/users/{user}/memories?kind=turn&limit=10"
    async with session.get(url, headers=headers) as response:
        page = await response.json()
    return any(word in item.get("text", "") for item in page.get("data", []))


# ---------------------------------------------------------------------------------------- sustained


@dataclass
class Minute:
    """What one minute of the sustained run saw."""

    arrivals: int = 0
    errors: int = 0
    searchable_s: list[float] = field(default_factory=list)
    slowest: tuple[float, float] | None = None  # the slowest probe: (``time.time()`` as it started, its latency)


async def client_loop(session: aiohttp.ClientSession, base: str, rng: random.Random, minutes: list[Minute],
                      started: float, end: float) -> None:  # fmt: skip
    """One closed-loop client: a message from one of 200 users, one message per conversation."""
    n = 0
    while time.monotonic() < end:
        n += 1
        user = f"user{rng.randrange(200)}"
        text = f"I have been thinking about {rng.choice(TOPICS)} and my plans for {rng.choice(TOPICS)} ({n})"
        status = await chat(session, base, user, [{"role": "user", "content": text}], "full")
        slot = minutes[min(len(minutes) - 1, int((time.monotonic() - started) // 60))]
        slot.arrivals += status == 200
        slot.errors += status != 200


TOPICS = (
    "gardening", "my sister's wedding", "the marathon", "learning Spanish", "our new flat", "jazz piano",
    "the trip to Lisbon", "my job interview", "the dog", "night shifts", "pottery", "the kids' school",
)  # fmt: skip


async def probe_loop(session: aiohttp.ClientSession, base: str, minutes: list[Minute], started: float,
                     end: float) -> None:  # fmt: skip
    """Once a second: an exchange with a unique word, then poll until its turn is listed."""
    n = 0
    while time.monotonic() < end:
        n += 1
        word = f"zqprobe{n}x"
        user = f"probe{n}"
        await chat(session, base, user, [{"role": "user", "content": f"I named my plant {word}"}], "full")
        sent, sent_at = time.monotonic(), time.time()
        slot = minutes[min(len(minutes) - 1, int((sent - started) // 60))]
        while not await listed(session, base, user, word) and time.monotonic() - sent < 120:  # noqa: ASYNC110
            await asyncio.sleep(0.1)  # polling is the measurement: what a later request would find
        latency = time.monotonic() - sent
        slot.searchable_s.append(latency)
        if slot.slowest is None or latency > slot.slowest[1]:
            slot.slowest = (sent_at, latency)
        await asyncio.sleep(max(0.0, PROBE_INTERVAL_S - (time.monotonic() - sent)))


def queue_counts(data: Path) -> dict[str, float]:
    """Jobs due and waiting, and exchange jobs finished so far, read (SELECT only) from the queue's SQLite file;
    memproxy's own gauges are a snapshot that goes stale when its queue is busy. Not ``mode=ro``: a read-only
    connection may not map the WAL index and then reads the last checkpoint, not the latest commits."""
    with contextlib.closing(sqlite3.connect(data / "jobs.sqlite3" / "jobs.sqlite3")) as c:
        c.execute("PRAGMA busy_timeout=10000")
        ready = c.execute("SELECT COUNT(*) FROM jobs WHERE state = 'pending' AND run_after <= ?", (time.time(),))
        done = c.execute("SELECT COUNT(*) FROM jobs WHERE kind = 'exchange' AND state = 'done'")
        return {"ready": float(ready.fetchone()[0]), "exchanges_done": float(done.fetchone()[0])}


async def metric_marks(session: aiohttp.ClientSession, base: str) -> dict[str, Any]:
    """From /metrics: (seconds, count) so far of each stage of the chat processes' requests
    (``memproxy_stage_seconds``), and the bytes each bounded part holds (``memproxy_memory_bytes``, MB: the
    answering chat process's as ``chat:<part>``, the writer's as ``writer:<part>``), and the texts the writer
    embedded so far, by its document model and by the static side instead (``memproxy_embedder_texts_total``,
    ``..._quick_texts_total``)."""
    async with session.get(base.removesuffix("/v1") + "/metrics") as response:
        text = await response.text()
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    for match in STAGE_LINE.finditer(text):
        kind, stage, value = match.groups()
        (sums if kind == "sum" else counts)[stage] = float(value)
    parts = PART_LINE.findall(text)
    return {
        "stages": {stage: (sums[stage], counts.get(stage, 0.0)) for stage in sums},
        "writer_texts": {name: float(value) for name, value in WRITER_TEXTS_LINE.findall(text)},
        "memory_mb": {f"{where or 'chat'}:{part}": round(float(value) / 2**20, 1) for where, part, value in parts},
    }


async def minute_marks(session: aiohttp.ClientSession, base: str, data: Path, pid: int, count: int,
                       started: float) -> list[dict[str, Any]]:  # fmt: skip
    """The queue's counts, RSS, each process's CPU time and the request stages' totals at the end of each
    minute."""
    marks = []
    for i in range(1, count + 1):
        await asyncio.sleep(max(0.0, started + 60 * i - time.monotonic()))
        parts = rss_parts_mb(pid)
        marks.append({**await asyncio.to_thread(queue_counts, data), "rss_mb": sum(parts.values()),
                      "rss_parts_mb": parts, "rss_kinds_mb": await asyncio.to_thread(rss_kinds_mb, pid, data),
                      "cpu_parts_s": cpu_parts_s(pid), "threads_s": thread_parts_s(pid),
                      **await metric_marks(session, base)})  # fmt: skip
    return marks


async def sustained(args: argparse.Namespace, upstream: Upstream, data: Path) -> dict[str, Any]:
    """The sustained mode (see the module doc)."""
    upstream.default_reply = chat_reply
    env = {"MEMPROXY_SERVER__WORKERS": str(args.workers)}
    if args.vector_cache_mb is not None:  # a working set several times the cache, sooner
        env["MEMPROXY_STORE__VECTOR_CACHE_BYTES"] = str(args.vector_cache_mb << 20)
    settings = dict(setting.split("=", 1) for setting in args.env)
    env.update(settings)
    with memproxy(upstream.base_url, data, env) as (pid, base):
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            for i in range(20):  # warm-up: models loaded, caches and pools made
                await chat(session, base, f"warm{i}", [{"role": "user", "content": "I like tea"}], "full")
            # Before, as after: the warm-up's jobs done, its fact windows (waiting facts_window_wait_s) included,
            # then 5 s of quiet; read at once, the figure caught the process still loading its model.
            await wait_drained(data, 120, settle_s=WARM_SETTLE_S)
            await asyncio.sleep(5)
            rss_before = memproxy_rss_mb(pid)
            texts_before = (await gauges(session, base, "memproxy_embedder_")).get("texts_total", 0.0)
            minutes = [Minute() for _ in range(args.minutes)]
            before: dict[str, Any] = {**await asyncio.to_thread(queue_counts, data), "cpu_parts_s": cpu_parts_s(pid),
                                      "threads_s": thread_parts_s(pid),
                                      **await metric_marks(session, base)}  # fmt: skip
            started = time.monotonic()
            end = started + 60 * args.minutes
            rng = random.Random(0)
            async with asyncio.TaskGroup() as group:
                marks_task = group.create_task(minute_marks(session, base, data, pid, args.minutes, started))
                for _ in range(args.concurrency):
                    group.create_task(client_loop(session, base, random.Random(rng.random()), minutes, started, end))
                group.create_task(probe_loop(session, base, minutes, started, end))
            drain_s = await wait_drained(data, args.drain_limit_s, settle_s=8.0)
            texts = (await gauges(session, base, "memproxy_embedder_")).get("texts_total", 0.0) - texts_before
            exchanges = (await asyncio.to_thread(queue_counts, data))["exchanges_done"] - before["exchanges_done"]
            await asyncio.sleep(5)
            rss_at_drain = memproxy_rss_mb(pid)
            await asyncio.sleep(10.0)
            await wait_ready(session, base)
            rss_after = memproxy_rss_mb(pid)
            pids = process_tree(pid)
            await asyncio.sleep(TRIM_WAIT_S)  # what a minute of quiet adds
            rss_settled = memproxy_rss_mb(pid)
            same_processes = process_tree(pid) == pids  # nothing restarted to hand memory back
    report = sustained_report(minutes, [before, *marks_task.result()], rss_before, rss_after, drain_s)
    memory_processes = sum(1 for role in pids.values() if role.startswith(("writer", "chat")))
    return {**report, "rss_at_drain_mb": round(rss_at_drain, 1), "rss_a_minute_later_mb": round(rss_settled, 1),
            "rss_bound_mb": rss_bound_mb(rss_before, memory_processes), "rss_margin_mb_per_process": RSS_MARGIN_MB,
            "cache_budgets_mb_per_process": round(cache_budgets_mb(), 1), "processes": sorted(pids.values()),
            "same_processes_after_drain": same_processes, "workers": args.workers,
            "env": settings,
            "texts_embedded_per_exchange": round(texts / exchanges, 3) if exchanges else None,
            "disk": await disk_usage(data)}  # fmt: skip


def tree_mb(path: Path) -> float:
    """Bytes of the files under ``path`` (allocated blocks, as ``du`` counts), in MB."""
    return sum(f.stat().st_blocks * 512 for f in path.rglob("*") if f.is_file()) / 1e6


async def disk_usage(data: Path) -> dict[str, float]:
    """The memory table on disk against its live data (the current version's data files, LanceDB's
    ``stats``), as memproxy left it and after a compaction that keeps no old version (``memproxy`` stopped).
    Also the whole data directory (the keyword index and the job queue with it)."""
    import lancedb

    from proxy.memory.store.manifest import MANIFEST_KEY

    lance = data / "lance"
    table_name = json.loads((lance / MANIFEST_KEY).read_text())["table"]
    db = await lancedb.connect_async(lance)
    table = await db.open_table(table_name)
    left = tree_mb(lance / f"{table_name}.lance")
    live = (await table.stats())["total_bytes"] / 1e6
    with warnings.catch_warnings():  # "removes every version except the latest": memproxy has stopped
        warnings.simplefilter("ignore", UserWarning)
        await table.optimize(cleanup_older_than=timedelta(0), delete_unverified=True)
    compacted = tree_mb(lance / f"{table_name}.lance")
    live_after = (await table.stats())["total_bytes"] / 1e6
    return {"table_live_mb": round(live_after, 1), "table_on_disk_mb": round(left, 1),
            "table_on_disk_after_compaction_mb": round(compacted, 1),
            "on_disk_after_compaction_over_live": round(compacted / live_after, 3) if live_after else None,
            "data_dir_mb": round(tree_mb(data), 1), "table_live_before_compaction_mb": round(live, 1)}  # fmt: skip


async def wait_ready(session: aiohttp.ClientSession, base: str, limit_s: float = 60.0) -> None:
    """Until memproxy's /readyz answers 200 (a restart in place takes a few seconds)."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
            async with session.get(base.removesuffix("/v1") + "/readyz") as response:
                if response.status == 200:
                    return
        await asyncio.sleep(0.5)


def per_arrival(before: Mapping[str, Any], after: Mapping[str, Any], arrivals: int) -> dict[str, float]:
    """Each process's CPU time in a minute, in ms per chat answered in it (a restarted process counts from 0)."""
    spent = {role: after["cpu_parts_s"][role] - before["cpu_parts_s"].get(role, 0.0) for role in after["cpu_parts_s"]}
    return {role: round(1000 * max(0.0, cpu) / max(1, arrivals), 2) for role, cpu in spent.items()}


def per_arrival_by_thread(before: Mapping[str, Any], after: Mapping[str, Any], arrivals: int) -> dict[str, Any]:
    """Each process's CPU time in a minute by kind of thread, in ms per chat answered in it (0.1 ms and up):
    where a process's growth comes from (LanceDB's threads, Tantivy's merges, the interpreter)."""
    out = {}
    for role, threads in after.get("threads_s", {}).items():
        earlier = before.get("threads_s", {}).get(role, {})
        spent = {name: 1000 * (cpu - earlier.get(name, 0.0)) / max(1, arrivals) for name, cpu in threads.items()}
        out[role] = {name: round(ms, 2) for name, ms in sorted(spent.items(), key=lambda kv: -kv[1]) if ms >= 0.1}
    return out


Stages = Mapping[str, tuple[float, float]]


def stage_means(before: Stages, after: Stages) -> dict[str, float]:
    """Each request stage's mean duration in a minute, ms (``memproxy_stage_seconds``: commit, retrieve, ...)."""
    out = {}
    for stage, (seconds, count) in after.items():
        seconds_before, count_before = before.get(stage, (0.0, 0.0))
        if count > count_before:
            out[stage] = round(1000 * (seconds - seconds_before) / (count - count_before), 2)
    return out


def texts_per_arrival(before: Mapping[str, Any], after: Mapping[str, Any], arrivals: int) -> dict[str, float]:
    """The writer's embeddings in a minute per chat answered in it: texts whose vectors came from its document
    model (``model``) and from the static side because the model would have been late (``quick``), texts the
    model ran (``model_ran``: a text whose caller gave up at its deadline counts here and in ``quick``), and the
    model threads' CPU (``model_cpu_ms``)."""
    was, now = before.get("writer_texts", {}), after.get("writer_texts", {})

    def spent(name: str) -> float:
        return (now.get(name, 0.0) - was.get(name, 0.0)) / max(1, arrivals)

    return {"model": round(spent("texts_total"), 3), "quick": round(spent("quick_texts_total"), 3),
            "model_ran": round(spent("model_texts_total"), 3),
            "model_cpu_ms": round(1000 * spent("model_cpu_seconds_total"), 2)}  # fmt: skip


def sustained_report(minutes: Sequence[Minute], marks: Sequence[Mapping[str, Any]], rss_before: float,
                     rss_after: float, drain_s: float) -> dict[str, Any]:  # fmt: skip
    """The sustained section of writes.json."""
    rows = []
    for i, minute in enumerate(minutes):
        done = marks[i + 1]["exchanges_done"] - marks[i]["exchanges_done"]
        lat = minute.searchable_s or [float("nan")]
        rows.append({
            "arrivals": minute.arrivals, "drained": int(done), "ready_at_end": int(marks[i + 1].get("ready", 0)),
            "turn_searchable_p50_s": round(percentile(lat, 50), 3),
            "turn_searchable_p99_s": round(percentile(lat, 99), 3),
            "rss_mb": round(marks[i + 1]["rss_mb"], 1), "errors": minute.errors, "probes": len(minute.searchable_s),
            "slowest_probe": None if minute.slowest is None else {
                "started_at": datetime.fromtimestamp(minute.slowest[0], UTC).isoformat(timespec="milliseconds"),
                "searchable_s": round(minute.slowest[1], 3)},
            "rss_parts_mb": marks[i + 1]["rss_parts_mb"],
            "rss_kinds_mb": marks[i + 1]["rss_kinds_mb"],
            "cpu_ms_per_arrival": per_arrival(marks[i], marks[i + 1], minute.arrivals),
            "cpu_ms_per_arrival_by_thread": per_arrival_by_thread(marks[i], marks[i + 1], minute.arrivals),
            "stage_mean_ms": stage_means(marks[i]["stages"], marks[i + 1]["stages"]),
            "writer_texts_per_arrival": texts_per_arrival(marks[i], marks[i + 1], minute.arrivals),
            "memory_parts_mb": marks[i + 1]["memory_mb"],
        })  # fmt: skip
    return {"minutes": rows, "rss_before_mb": round(rss_before, 1), "rss_after_drain_mb": round(rss_after, 1),
            "drain_after_load_s": round(drain_s, 1)}  # fmt: skip


# ------------------------------------------------------------------------------------------- replay


def user_message(turn: Any) -> str:
    """What the speaker "sent": the turn's text, an image described as the dataset captions it."""
    return turn.text + (f" [shared an image: {turn.caption}]" if turn.caption else "")


def speaker_user(conv: Conversation, speaker: str) -> str:
    """The memproxy user id of one speaker of a conversation."""
    return f"locomo{conv.index}-{re.sub(r'[^A-Za-z0-9]', '', speaker)}"


def prepare(upstream: Upstream, conversations: Sequence[Conversation]) -> set[str]:
    """Fill the fake's replies and oracle; returns the user messages of the observations' turns."""
    cited: set[str] = set()
    for conv in conversations:
        by_id = {t.dia_id: t for t in conv.turns}
        for turn, nxt in zip(conv.turns, [*conv.turns[1:], None], strict=True):
            if nxt is not None and nxt.speaker != turn.speaker and nxt.session == turn.session:
                upstream.replies[user_message(turn)] = user_message(nxt)
        for obs in conv.observations:
            for dia in obs.dia_ids:
                turn = by_id[dia]
                if turn.speaker == obs.speaker:
                    upstream.observations.setdefault(user_message(turn), []).append(obs.text)
                    cited.add(user_message(turn))
    return cited


async def replay_conversation(session: aiohttp.ClientSession, base: str, conv: Conversation) -> int:
    """Every turn of one conversation, in order, each from its speaker; returns the exchanges sent."""
    sent = 0
    previous = None
    for turn in conv.turns:
        messages = []
        if previous is not None and previous.session == turn.session and previous.speaker != turn.speaker:
            messages.append({"role": "assistant", "content": user_message(previous)})
        messages.append({"role": "user", "content": user_message(turn)})
        user = speaker_user(conv, turn.speaker)
        status = await chat(session, base, user, messages, "write", f"{conv.sample_id}-s{turn.session}")
        sent += status == 200
        previous = turn
    return sent


async def facts_kept(session: aiohttp.ClientSession, base: str, users: Sequence[str]) -> int:
    """Valid facts stored for ``users`` (management API)."""
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    total = 0
    for user in users:
        cursor = None
        while True:
            url = f"{base}/memory/users/{user}/memories?kind=fact&limit=500" + (f"&cursor={cursor}" if cursor else "")
            async with session.get(url, headers=headers) as response:
                page = await response.json()
            total += sum(1 for item in page["data"] if item.get("valid", True))
            cursor = page.get("next_cursor")
            if not cursor:
                break
    return total


async def replay(args: argparse.Namespace, upstream: Upstream, data: Path) -> dict[str, Any]:
    """The replay mode (see the module doc)."""
    conversations = load_conversations(DATA)[: args.conversations]
    cited = prepare(upstream, conversations)
    env = {"MEMPROXY_WRITER__SUMMARY_IDLE_S": "2"}
    with memproxy(upstream.base_url, data, env) as (_, base):
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            started = time.monotonic()
            sent = await asyncio.gather(*(replay_conversation(session, base, c) for c in conversations))
            replay_s = time.monotonic() - started
            await wait_drained(data, args.drain_limit_s, settle_s=8.0)
            users = sorted({speaker_user(c, t.speaker) for c in conversations for t in c.turns})
            kept = await facts_kept(session, base, users)
    return replay_report(upstream.ledger, sum(sent), cited, kept, sum(len(c.observations) for c in conversations),
                         replay_s)  # fmt: skip


def replay_report(ledger: Ledger, exchanges: int, cited: set[str], kept: int, observations: int,
                  replay_s: float) -> dict[str, Any]:  # fmt: skip
    """The replay section of writes.json."""
    calls, tokens = sum(ledger.calls.values()), sum(ledger.tokens.values())
    return {
        "exchanges": exchanges, "replay_s": round(replay_s, 1),
        "calls_per_exchange": round(calls / exchanges, 4), "prompt_tokens_per_exchange": round(tokens / exchanges, 1),
        "observation_turn_recall": round(len(cited & ledger.shown) / len(cited), 4),
        "facts_kept": kept, "observations": observations,
        "exchanges_per_extraction_call": round(sum(ledger.windows) / max(1, len(ledger.windows)), 2),
        "window_sizes": dict(sorted(Counter(ledger.windows).items())),
        "calls_by_kind": dict(ledger.calls), "prompt_tokens_by_kind": dict(ledger.tokens),
    }  # fmt: skip


# ------------------------------------------------------------------------------------------ the run


def checks(result: Mapping[str, Any]) -> list[tuple[bool, str]]:
    """The bar of issue 19, as (passed, description)."""
    out = []
    if "sustained" in result:
        s = result["sustained"]
        for i, row in enumerate(s["minutes"], start=1):
            out.append((row["ready_at_end"] <= row["arrivals"], f"minute {i}: ready_at_end {row['ready_at_end']} "
                        f"<= arrivals {row['arrivals']}"))  # fmt: skip
            out.append((row["turn_searchable_p99_s"] <= 2, f"minute {i}: turn searchable p99 "
                        f"{row['turn_searchable_p99_s']} s <= 2 s"))  # fmt: skip
        out += sustained_checks(s)
    if "replay" in result:
        r = result["replay"]
        out.append((r["calls_per_exchange"] <= 0.5, f"calls per exchange {r['calls_per_exchange']} <= 0.5"))
        out.append((r["prompt_tokens_per_exchange"] <= 300,
                    f"prompt tokens per exchange {r['prompt_tokens_per_exchange']} <= 300"))  # fmt: skip
        out.append((r["observation_turn_recall"] >= 0.95,
                    f"observation-turn recall {r['observation_turn_recall']} >= 0.95"))  # fmt: skip
    return out


def sustained_checks(s: Mapping[str, Any]) -> list[tuple[bool, str]]:
    """Issue 47's bar over the minutes: the chat keeps its pace, RSS flat and under its bound, no restart."""
    rows = s["minutes"]
    third = len(rows) // 3
    out = []
    if third:
        first = sum(r["arrivals"] for r in rows[:third])
        last = sum(r["arrivals"] for r in rows[-third:])
        out.append((last >= 0.8 * first, f"chat arrivals, last third / first third = {last}/{first} = "
                    f"{last / max(first, 1):.3f} >= 0.8"))  # fmt: skip
        middle_max = max(r["rss_mb"] for r in rows[third:-third] or rows[:third])
        last_max = max(r["rss_mb"] for r in rows[-third:])
        out.append((last_max <= 1.05 * middle_max, f"RSS flat: last third's max {last_max} MB <= 1.05 x the "
                    f"middle third's max {middle_max} MB"))  # fmt: skip
    if (bound := s.get("rss_bound_mb")) is not None:
        peak = max(r["rss_mb"] for r in rows)
        out.append((peak <= bound, f"RSS never above its bound: max {peak} MB <= {bound} MB"))
    if "same_processes_after_drain" in s:
        out.append((s["same_processes_after_drain"], "no memproxy process restarted during or after the load"))
    return out


def print_tables(result: Mapping[str, Any]) -> None:
    """Both tables and the checks."""
    if "sustained" in result:
        print("minute | arrivals | drained | ready_at_end | searchable p50 s | p99 s | RSS MB | errors")
        for i, row in enumerate(result["sustained"]["minutes"], start=1):
            print(f"{i:6} | {row['arrivals']:8} | {row['drained']:7} | {row['ready_at_end']:12} | "
                  f"{row['turn_searchable_p50_s']:16} | {row['turn_searchable_p99_s']:5} | {row['rss_mb']:6} | "
                  f"{row['errors']}")  # fmt: skip
        s = result["sustained"]
        print(f"RSS before {s['rss_before_mb']} MB (bound {s.get('rss_bound_mb')} MB), at the drain "
              f"{s.get('rss_at_drain_mb')} MB, 10 s later {s['rss_after_drain_mb']} MB "
              f"(drained in {s['drain_after_load_s']} s after the load), a minute later "
              f"{s.get('rss_a_minute_later_mb')} MB; texts embedded per exchange "
              f"{s.get('texts_embedded_per_exchange')}")  # fmt: skip
        if disk := s.get("disk"):
            print(f"memory table on disk {disk['table_on_disk_mb']} MB as left, "
                  f"{disk['table_on_disk_after_compaction_mb']} MB after a compaction keeping no old version, live "
                  f"data {disk['table_live_mb']} MB ({disk['on_disk_after_compaction_over_live']}x); data directory "
                  f"{disk['data_dir_mb']} MB")  # fmt: skip
    if "replay" in result:
        r = result["replay"]
        print(f"replay: {r['exchanges']} exchanges, {r['calls_per_exchange']} calls and "
              f"{r['prompt_tokens_per_exchange']} prompt tokens per exchange; facts kept {r['facts_kept']} vs "
              f"{r['observations']} observations; observation-turn recall {r['observation_turn_recall']}")  # fmt: skip
        print(f"  calls {r['calls_by_kind']}; prompt tokens {r['prompt_tokens_by_kind']}")
    for ok, text in checks(result):
        print(f"{'PASS' if ok else 'FAIL'}  {text}")


async def main(args: argparse.Namespace) -> dict[str, Any]:
    """Run the modes asked for, each on a fresh data directory and a fresh fake."""
    result: dict[str, Any] = {"meta": {"args": vars(args), "machine": platform.machine(), "cpus": os.cpu_count(),
                                       "load_1m": os.getloadavg()[0]}}  # fmt: skip
    for mode in ("sustained", "replay"):
        if args.mode in (mode, "both"):
            with tempfile.TemporaryDirectory(prefix=f"memproxy-bench-writes-{mode}-") as tmp:
                async with Upstream() as upstream:
                    run = sustained if mode == "sustained" else replay
                    print(f"[writes] {mode} ...", file=sys.stderr, flush=True)
                    result[mode] = await run(args, upstream, Path(tmp))
    result["checks"] = [{"passed": ok, "check": text} for ok, text in checks(result)]
    return result


def parse_args() -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=["sustained", "replay", "both"], default="both")
    parser.add_argument("--minutes", type=int, default=10, help="length of the sustained load")
    parser.add_argument("--concurrency", type=int, default=16, help="closed-loop clients of the sustained load")
    parser.add_argument("--conversations", type=int, default=10, help="LoCoMo conversations replayed (of 10)")
    parser.add_argument("--drain-limit-s", type=float, default=900.0)
    parser.add_argument("--workers", type=int, default=0, help="server.workers (0: one chat process per core)")
    parser.add_argument("--vector-cache-mb", type=int, help="store.vector_cache_bytes in MiB (default: the config's)")
    parser.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="MEMPROXY_...=VALUE",
        help="a setting in memproxy's environment (repeatable): MEMPROXY_STORE__FLUSH_INTERVAL_MS=200",
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    return parser.parse_args()


if __name__ == "__main__":
    arguments = parse_args()
    figures = asyncio.run(main(arguments))
    print_tables(figures)
    arguments.out.parent.mkdir(parents=True, exist_ok=True)
    previous = json.loads(arguments.out.read_text()) if arguments.out.exists() else {}
    kept = {key: previous[key] for key in ("sustained", "replay") if key in previous and arguments.mode != "both"}
    merged = {**kept, **figures}
    merged["checks"] = [{"passed": ok, "check": text} for ok, text in checks(merged)]
    arguments.out.write_text(json.dumps(merged, indent=2, default=str) + "\n")
