"""Latency of the whole read path at 10k memories per user (``make bench-readpath``).

Builds the real ``MemoryEngine`` (default settings, local embedder, LanceDB + Tantivy in a temporary
directory) and fills it: one user with about 10k memories (LoCoMo's turns, each session a conversation of the
last 14 days so that every turn is inside the default window; its observations and annotated events as facts
with their speaker as entity; its session summaries as summaries; a few insights; older turns, outside the
window, make up the number), plus background users with
the same number of memories, so that the keyword index is shared as in a real deployment. Vectors come from
the LoCoMo harness's embedding cache when present (else they are embedded now).

Then each request is one chat body (a system prompt and one LoCoMo question, never asked before, so the
query embedding is never a cache hit) through ``MemoryEngine.inject``: query embedding, the dense, keyword
and entity arms, insights and recent activity, fusion, scoring, the injection block and the touch of what was
injected: exactly what the proxy runs before forwarding a chat. Wall time and process CPU time per request,
p50/p90/p99, sequential requests; a second pass through ``retrieve`` gives the per-stage times, a third
empties the read cache before each request (a user whose last request is older than the cache's lifetime
pays for listing their name index, insights and newest turns), and a fourth asks as many new questions,
every other one after ``--idle-ms`` of sleep (a proxy serving one chat at a time idles while the upstream
answers, and the read then starts on cold CPU caches: part of what separates ``make bench-load``'s CPU per
request at c=1 from that at c=16). Prints a table and writes
``bench/results/readpath.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.locomo import CACHE, DATA, Conversation, VectorCache, load_conversations
from proxy.app import engine_settings
from proxy.config import load_settings
from proxy.engine import MemoryEngine
from proxy.memory.read.injection import inject
from proxy.memory.read.retrieval import retrieve
from proxy.memory.service import ReadRequest
from proxy.memory.store.records import Kind, MemoryRecord, new_id, utcnow
from proxy.memory.write.llm import LLMUnavailable

RESULTS = Path(__file__).resolve().parent / "results" / "readpath.json"
SYSTEM = {"role": "system", "content": "You are a helpful assistant."}


class NoModel:
    """The memory-side model, unreachable: the read path never calls it."""

    async def complete_json(
        self, model: str, messages: list[dict[str, Any]], schema: dict[str, Any], schema_name: str
    ) -> dict[str, Any]:
        raise LLMUnavailable("no model in the read-path benchmark")


def _texts(conversations: Sequence[Conversation], raw: list[dict[str, Any]]) -> dict[str, list[tuple[str, Any]]]:
    """Memory texts by kind, each with what it needs (turn: the turn; fact: speaker; summary: session)."""
    turns = [(t.memory_text, (c.index, t)) for c in conversations for t in c.turns]
    facts = [(o.text, o.speaker) for c in conversations for o in c.observations]
    summaries = []
    for sample in raw:
        for by_speaker in sample.get("event_summary", {}).values():
            facts += [
                (event, speaker) for speaker, events in by_speaker.items() if speaker != "date" for event in events
            ]
        summaries += [(text, key) for key, text in sample.get("session_summary", {}).items() if text]
    return {"turns": turns, "facts": facts, "summaries": summaries}


def _records(
    user_id: str, texts: dict[str, list[tuple[str, Any]]], vectors: dict[str, Any], now: datetime, limit: int
) -> list[MemoryRecord]:
    """``limit`` memories of one user: every turn within the last 14 days, facts, summaries, a few insights, and
    older turns (outside the window) to make up the number."""
    out: list[MemoryRecord] = []
    span = timedelta(days=13.5)
    turns = texts["turns"]
    for i, (text, (conv, turn)) in enumerate(turns):
        at = now - span + span * (i / len(turns))
        out.append(
            MemoryRecord(
                user_id=user_id,
                kind=Kind.TURN,
                text=text,
                id=new_id(),
                created_at=at,
                embedding=vectors[text],
                conversation_id=f"c{conv}-s{turn.session}",
                role="user" if i % 2 == 0 else "assistant",
            )
        )
    for i, (text, speaker) in enumerate(texts["facts"]):
        out.append(
            MemoryRecord(
                user_id=user_id,
                kind=Kind.FACT,
                text=text,
                id=new_id(),
                embedding=vectors[text],
                created_at=now - timedelta(days=200) + timedelta(minutes=i),
                entities=(speaker,),
            )
        )
    for i, (text, _) in enumerate(texts["summaries"]):
        out.append(
            MemoryRecord(
                user_id=user_id,
                kind=Kind.SUMMARY,
                text=text,
                id=new_id(),
                embedding=vectors[text],
                created_at=now - timedelta(days=30) + timedelta(hours=i),
            )
        )
    out += [
        MemoryRecord(
            user_id=user_id,
            kind=Kind.INSIGHT,
            text=f"Insight {i}: {text}",
            id=new_id(),
            confidence=0.8,
            embedding=vectors[text],
        )
        for i, (text, _) in enumerate(texts["summaries"][:8])
    ]
    older = [
        MemoryRecord(
            user_id=user_id,
            kind=Kind.TURN,
            text=text,
            id=new_id(),
            embedding=vectors[text],
            created_at=now - timedelta(days=60) + timedelta(minutes=i),
            conversation_id=f"old-{i // 20}",
            role="user" if i % 2 == 0 else "assistant",
        )
        for i, (text, _) in enumerate(turns[: max(0, limit - len(out))])
    ]
    return (out + older)[:limit]


def _percentiles(values: Sequence[float]) -> dict[str, float]:
    """p50, p90, p99 and max of ``values`` (milliseconds), rounded."""
    ordered = sorted(values)

    def at(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)

    return {"p50": at(0.50), "p90": at(0.90), "p99": at(0.99), "max": round(ordered[-1], 3)}


async def _fill(engine: MemoryEngine, args: argparse.Namespace) -> tuple[str, int]:
    """Store the benchmark user and the background users; returns the user id and its memory count."""
    conversations = load_conversations(args.data)
    raw = json.loads(args.data.read_text())
    texts = _texts(conversations, raw)
    cache = VectorCache(engine.embedder, None if args.no_cache else args.cache)
    every = list(dict.fromkeys(t for group in texts.values() for t, _ in group))
    vectors = dict(zip(every, await cache.embed(every, "embed memories"), strict=True))
    cache.save()
    now = utcnow()
    users = ["bench-user", *(f"background-{i}" for i in range(args.background_users))]
    for user in tqdm(users, desc="store users", file=sys.stderr):
        records = _records(user, texts, vectors, now, args.memories)
        for start in range(0, len(records), 2000):
            await engine.store.add(records[start : start + 2000])
    await engine.store.optimize()
    return users[0], len(_records(users[0], texts, vectors, now, args.memories))


def _questions(args: argparse.Namespace) -> list[str]:
    """Distinct LoCoMo questions (categories 1-4), in file order."""
    return list(dict.fromkeys(q.text for c in load_conversations(args.data) for q in c.questions))


async def _whole_path(
    engine: MemoryEngine, user: str, questions: Sequence[str], *, cold: bool = False, idle_ms: float = 0.0
) -> dict[str, Any]:
    """``MemoryEngine.inject`` per question: wall and CPU milliseconds, and how many got a memory block.

    ``cold``: the read cache (name index, insights, newest turns) is emptied before each request, as for a
    user whose previous request is older than the cache's lifetime. ``idle_ms``: every other request comes
    after that long a sleep, as when a proxy serving one chat at a time waits on the upstream between two
    reads (the CPU's caches are then no longer warm); those are reported apart (``after_idle``), so both
    halves see the same warmth of the per-text caches.
    """
    wall, cpu, idle_wall, idle_cpu, injected = [], [], [], [], 0
    desc = "engine.inject" + (" cold" if cold else "") + (f" / after {idle_ms:g} ms idle" if idle_ms else "")
    for i, question in enumerate(tqdm(questions, desc=desc, file=sys.stderr)):
        body = {"messages": [SYSTEM, {"role": "user", "content": question}]}
        if cold:
            engine.names.invalidate(user)
        idle = bool(idle_ms) and i % 2 == 1
        if idle:
            await asyncio.sleep(idle_ms / 1000)
        started, cpu_started = time.perf_counter(), time.process_time()
        result = await engine.inject(ReadRequest(user, f"bench-conversation-{i}", body["messages"]))
        (idle_wall if idle else wall).append((time.perf_counter() - started) * 1000)
        (idle_cpu if idle else cpu).append((time.process_time() - cpu_started) * 1000)
        injected += bool(result.injected_ids)
    out = {
        "wall_ms": _percentiles(wall),
        "cpu_ms": _percentiles(cpu),
        "requests": len(questions),
        "with_memory_block": injected,
    }
    if idle_ms:
        out["after_idle"] = {"wall_ms": _percentiles(idle_wall), "cpu_ms": _percentiles(idle_cpu)}
    return out


async def _stages(engine: MemoryEngine, user: str, questions: Sequence[str]) -> dict[str, Any]:
    """The same path through ``retrieve`` and ``inject`` directly: each stage's wall milliseconds."""
    stages: dict[str, list[float]] = {}
    for question in tqdm(questions, desc="stages", file=sys.stderr):
        messages = [SYSTEM, {"role": "user", "content": question}]
        result = await retrieve(
            engine.store,
            engine.embedder,
            messages,
            user,
            engine.settings.retrieval,
            utcnow(),
            conversation_id="bench-stages",
            names=engine.names,
        )
        started = time.perf_counter()
        inject(messages, result.items, result.query.terms if result.query else (), engine.settings.injection)
        stages.setdefault("injection", []).append((time.perf_counter() - started) * 1000)
        for name, ms in result.timings_ms.items():
            stages.setdefault(name, []).append(ms)
        stages.setdefault("candidates", []).append(float(len(result.candidates)))
    return {name: _percentiles(values) for name, values in stages.items()}


async def _main(args: argparse.Namespace) -> dict[str, Any]:
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="readpath-") as tmp:
        retrieval = dict(pair.split("=", 1) for pair in args.retrieval)
        embedder = dict(pair.split("=", 1) for pair in args.embedder)
        overrides = {"storage": {"path": tmp}, "retrieval": retrieval, "embedder": embedder}
        settings = load_settings(None, environ={}, overrides=overrides)
        async with MemoryEngine(engine_settings(settings), NoModel()) as engine:
            user, count = await _fill(engine, args)
            questions = _questions(args)
            warm, measured = questions[: args.warmup], questions[args.warmup : args.warmup + args.requests]
            staged = questions[args.warmup + args.requests : args.warmup + 2 * args.requests]
            cold = questions[args.warmup + 2 * args.requests : args.warmup + 2 * args.requests + args.cold_requests]
            rest = questions[args.warmup + 2 * args.requests + args.cold_requests :][: args.requests]
            await _whole_path(engine, user, warm)
            whole = await _whole_path(engine, user, measured)
            stages = await _stages(engine, user, staged or measured)
            cold_path = await _whole_path(engine, user, cold or measured[: args.cold_requests], cold=True)
            after_idle = (
                await _whole_path(engine, user, rest or measured, idle_ms=args.idle_ms) if args.idle_ms else None
            )
    return {
        "whole_read_path": whole,
        "whole_read_path_after_idle": after_idle,
        "stages_ms": stages,
        "whole_read_path_cold_cache": cold_path,
        "meta": {
            "user_memories": count,
            "background_users": args.background_users,
            "idle_ms": args.idle_ms,
            "memories_per_background_user": count,
            "retrieval_overrides": retrieval,
            "embedder_overrides": embedder,
            "retrieval": settings.retrieval.model_dump(mode="json"),
            "embedder": settings.embedder.model_dump(mode="json"),
            "python": platform.python_version(),
            "machine": f"{platform.machine()}, {os.cpu_count()} cpus",
            "load_before": round(load_before, 2),
            "load_after": round(os.getloadavg()[0], 2),
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
        },
    }


def _print(document: dict[str, Any]) -> None:
    whole = document["whole_read_path"]
    print(
        f"whole read path (MemoryEngine.inject), {whole['requests']} requests, "
        f"{document['meta']['user_memories']} memories of the user:"
    )
    for kind in ("wall_ms", "cpu_ms"):
        row = whole[kind]
        print(
            f"  {kind:<8} p50 {row['p50']:>8.2f}  p90 {row['p90']:>8.2f}  p99 {row['p99']:>8.2f}  "
            f"max {row['max']:>8.2f}"
        )
    cold = document["whole_read_path_cold_cache"]
    print(
        f"  cold read cache ({cold['requests']} requests): wall p50 {cold['wall_ms']['p50']:.2f}  "
        f"p99 {cold['wall_ms']['p99']:.2f}  cpu p50 {cold['cpu_ms']['p50']:.2f}"
    )
    if (pair := document["whole_read_path_after_idle"]) is not None:
        idle = pair["after_idle"]
        print(
            f"  {pair['requests']} new questions, every other one after {document['meta']['idle_ms']:g} ms idle: "
            f"cpu p50 {pair['cpu_ms']['p50']:.2f} back to back, {idle['cpu_ms']['p50']:.2f} after idle "
            f"(p90 {pair['cpu_ms']['p90']:.2f} / {idle['cpu_ms']['p90']:.2f})"
        )
    print("stages (retrieve + inject, wall ms):")
    for name, row in document["stages_ms"].items():
        print(f"  {name:<12} p50 {row['p50']:>8.2f}  p90 {row['p90']:>8.2f}  p99 {row['p99']:>8.2f}")
    meta = document["meta"]
    print(f"load average {meta['load_before']} before, {meta['load_after']} after, {meta['machine']}")


def main() -> None:
    """Run the benchmark, print the table, write the results."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=DATA, help="LoCoMo-layout file the memories come from")
    parser.add_argument("--memories", type=int, default=10_000, help="memories of the measured user (at most)")
    parser.add_argument("--background-users", type=int, default=2, help="other users of the same size")
    parser.add_argument("--requests", type=int, default=300, help="measured requests")
    parser.add_argument("--warmup", type=int, default=30, help="requests before measuring")
    parser.add_argument("--cold-requests", type=int, default=50, help="requests with an emptied read cache")
    parser.add_argument(
        "--idle-ms",
        type=float,
        default=10.0,
        help="sleep before every other request of the last pass (0: no such pass)",
    )
    parser.add_argument("--cache", type=Path, default=CACHE, help="directory of the embedding cache")
    parser.add_argument("--no-cache", action="store_true", help="embed everything afresh, store nothing")
    parser.add_argument(
        "--retrieval",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="override [retrieval] settings, e.g. dense_k=50 (default: the defaults)",
    )
    parser.add_argument(
        "--embedder",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="override [embedder] settings, e.g. threads=2 (default: the defaults)",
    )
    parser.add_argument("--out", type=Path, default=RESULTS, help="where to write the results")
    args = parser.parse_args()
    document = asyncio.run(_main(args))
    _print(document)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(document, indent=2) + "\n")


if __name__ == "__main__":
    main()
