"""``make bench-cache``: what memory does to the provider's prompt cache, placement by placement.

Each LoCoMo conversation is played as a user of a real ``memproxy serve`` (fake upstream on 127.0.0.1 that
records what it receives): its earlier sessions are told first, one stored conversation per session (``write``
mode, as an app's past chats); then its last ``--chat-sessions`` sessions are replayed as one chat whose history
grows turn by turn, as a chat app sends it (the first speaker as the user, the second's lines as the scripted
reply), once with memory off and once per placement (``read`` mode, so that every run sees the same store),
through chat completions and through Anthropic's Messages API with the app's own ``cache_control`` breakpoints
(the system prompt and the latest user message, Anthropic's recipe for a growing chat).

Billing is simulated on the forwarded requests, in bytes / 4 as tokens:
- OpenAI: a request's cached part is the longest prefix it shares with an earlier request of the same chat, in
  128-token steps from 1,024 tokens; cached tokens cost 0.1x.
- Anthropic: a request reads the longest prefix cached at an earlier request's breakpoint (looked up at its own
  breakpoints and up to 20 block boundaries before each), at 0.1x; what it adds up to its last breakpoint is
  written at 1.25x; the rest costs 1x; 1,024 tokens at least; a 5-minute lifetime (never reached here).
``billed_input_ratio_vs_off_*`` is a placement's bill over memory off's. ``block_recall@10``: after the replay,
each question whose evidence lies in the told sessions is asked as the chat's next message; the share of its
evidence turns among the first 10 memories the forwarded request carries (``X-Memory-Ids``).
``unshared_ratio``: the bytes of each forwarded request that no earlier request shares as a prefix, summed, over
(the same sum with memory off + the bytes memory added): 1.0 means memory re-bills none of the app's own bytes.
``memory_side.cached_share``: the memory side's own calls (extraction, summaries) under the OpenAI rule.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from bench.locomo import Conversation, Turn, load_conversations
from tests.support.processes import fake_upstream_process, memproxy_process

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data" / "locomo" / "locomo10.json"
RESULTS = ROOT / "bench" / "results" / "cache.json"
ADMIN_KEY = "bench-admin-key-0001"
PLACEMENTS = ("cached", "system", "user")
SYSTEM_PROMPT = (
    "You are a warm, attentive friend in a long-running chat. Answer in one or two sentences, in the voice of "
    "the person you are speaking as, and keep the conversation going with a short question when it fits."
)
TOKEN_BYTES = 4
OPENAI_STEP, MIN_CACHE_TOKENS, READ_PRICE, WRITE_PRICE = 128, 1024, 0.1, 1.25


# --- the dialog as exchanges ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Exchange:
    """One user message (the first speaker's run of turns) and the scripted reply (the next run)."""

    user: str
    reply: str
    session: int


def exchanges(turns: Sequence[Turn]) -> list[Exchange]:
    """The dialog cut into exchanges: runs of one speaker, the first speaker's as the user's."""
    runs: list[tuple[str, list[Turn]]] = []
    for turn in turns:
        if runs and runs[-1][0] == turn.speaker:
            runs[-1][1].append(turn)
        else:
            runs.append((turn.speaker, [turn]))
    first = turns[0].speaker if turns else ""
    out = []
    for index, (speaker, run) in enumerate(runs):
        if speaker != first:
            continue
        reply = runs[index + 1][1] if index + 1 < len(runs) else []
        text = "\n".join(t.memory_text for t in run)
        out.append(Exchange(text, "\n".join(t.memory_text for t in reply) or "(no reply)", run[0].session))
    return out


# --- talking to memproxy ----------------------------------------------------------------------------------


def chat_body(history: Sequence[Mapping[str, str]], exchange: Exchange) -> dict[str, Any]:
    """A chat completion request: the system prompt, the history, the new user message."""
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, *history, {"role": "user", "content": exchange.user}]
    return {"model": "gpt-bench", "messages": messages, "metadata": {"fake_reply": exchange.reply}}


def messages_body(history: Sequence[Mapping[str, str]], exchange: Exchange) -> dict[str, Any]:
    """The same request in Anthropic's shape, with the app's breakpoints on the system prompt and the new message."""
    messages: list[dict[str, Any]] = [dict(m) for m in history]
    last = {"type": "text", "text": exchange.user, "cache_control": {"type": "ephemeral"}}
    messages.append({"role": "user", "content": [last]})
    system = [{"type": "text", "text": SYSTEM_PROMPT, "cache_control": {"type": "ephemeral"}}]
    return {"model": "claude-bench", "max_tokens": 300, "system": system, "messages": messages,
            "metadata": {"fake_reply": exchange.reply}}  # fmt: skip


async def send(session: aiohttp.ClientSession, url: str, body: Mapping[str, Any], headers: Mapping[str, str]) -> Any:
    """POST one request; the answer's ``X-Memory-*`` headers."""
    async with session.post(url, json=body, headers=headers) as response:
        await response.read()
        if response.status != 200:
            raise RuntimeError(f"{url}: HTTP {response.status}")
        return response.headers


def recorded(upstream: str) -> list[dict[str, Any]]:
    """Every request the fake upstream has received so far."""
    with urllib.request.urlopen(upstream.removesuffix("/v1") + "/_fake/requests", timeout=60) as answer:  # noqa: S310
        return list(json.loads(answer.read()))


# --- billing (pure) ---------------------------------------------------------------------------------------


def serialized(request: Mapping[str, Any]) -> tuple[bytes, list[int], list[int]]:
    """A forwarded request as the provider reads it (system, then messages, block by block), the byte offsets
    where blocks end, and those where the app's ``cache_control`` breakpoints end."""
    parts: list[bytes] = []
    ends: list[int] = []
    marks: list[int] = []
    size = 0

    def add(text: str, marked: bool = False) -> None:
        nonlocal size
        data = text.encode()
        parts.append(data)
        size += len(data)
        ends.append(size)
        if marked:
            marks.append(size)

    body = request["json"]
    for field in ("tools", "response_format"):  # schemas are part of the cached prefix, before the messages
        if body.get(field):
            add(f"{field}:{json.dumps(body[field], sort_keys=True)}\n")
    for block in _blocks(body.get("system")) if "system" in body else []:
        add(f"system:{block[0]}\n", block[1])
    if isinstance(body.get("instructions"), str):
        add(f"system:{body['instructions']}\n")
    for message in body.get("messages") or []:
        for text, marked in _blocks(message.get("content")):
            add(f"{message.get('role')}:{text}\n", marked)
    return b"".join(parts), ends, marks


def _blocks(content: Any) -> list[tuple[str, bool]]:
    if isinstance(content, str):
        return [(content, False)]
    return [
        (str(b.get("text", "")), "cache_control" in b) for b in content or [] if isinstance(b, Mapping)
    ]  # fmt: skip


def common_prefix(a: bytes, b: bytes) -> int:
    """The length of the longest common prefix of two byte strings."""
    low, high = 0, min(len(a), len(b))
    while low < high:  # binary search on equal prefixes (bytes comparison is C-fast)
        mid = (low + high + 1) // 2
        if a[:mid] == b[:mid]:
            low = mid
        else:
            high = mid - 1
    return low


@dataclass(frozen=True, slots=True)
class Bill:
    """Tokens of one chat's forwarded requests and what they cost, in full-price token equivalents."""

    tokens: float
    cached: float
    billed: float


def openai_bill(texts: Sequence[bytes]) -> Bill:
    """Automatic prefix caching: the longest prefix shared with an earlier request, in 128-token steps."""
    tokens = cached = billed = 0.0
    for index, text in enumerate(texts):
        shared = max((common_prefix(text, earlier) for earlier in texts[:index]), default=0) / TOKEN_BYTES
        hit = (shared // OPENAI_STEP) * OPENAI_STEP if shared >= MIN_CACHE_TOKENS else 0.0
        total = len(text) / TOKEN_BYTES
        tokens, cached, billed = tokens + total, cached + hit, billed + (total - hit) + READ_PRICE * hit
    return Bill(tokens, cached, billed)


def anthropic_bill(requests: Sequence[tuple[bytes, list[int], list[int]]]) -> Bill:
    """Breakpoint caching: reads of prefixes written at earlier breakpoints, writes up to the last breakpoint."""
    written: set[bytes] = set()
    tokens = cached = billed = 0.0
    for text, ends, marks in requests:
        read = 0
        for mark in marks:
            before = [e for e in ends if e <= mark][-21:]  # the breakpoint and up to 20 boundaries before it
            read = max([read, *(e for e in before if e / TOKEN_BYTES >= MIN_CACHE_TOKENS and text[:e] in written)])
        last = max(marks, default=0)
        write = max(0, last - read) if last / TOKEN_BYTES >= MIN_CACHE_TOKENS else 0
        for mark in marks:
            if mark / TOKEN_BYTES >= MIN_CACHE_TOKENS:
                written.add(text[:mark])
        rest = len(text) - read - write
        tokens += len(text) / TOKEN_BYTES
        cached += read / TOKEN_BYTES
        billed += (READ_PRICE * read + WRITE_PRICE * write + rest) / TOKEN_BYTES
    return Bill(tokens, cached, billed)


def unshared_bytes(texts: Sequence[bytes]) -> int:
    """The bytes of each request that no earlier request shares as a prefix, summed."""
    return sum(
        len(t) - max((common_prefix(t, e) for e in texts[:i]), default=0) for i, t in enumerate(texts)
    )  # fmt: skip


# --- one run ----------------------------------------------------------------------------------------------


@dataclass(slots=True)
class Replay:
    """What one placement's replay of one conversation forwarded, and what its probes carried."""

    chat: list[bytes]
    anthropic: list[tuple[bytes, list[int], list[int]]]
    injected: list[int]
    recall: list[float]


async def replay(
    proxy: str, upstream: str, conv: Conversation, chat: Sequence[Exchange], mode: str, ids_to_turns: Any
) -> Replay:
    """The chat replayed through chat completions and Messages, then the probes."""
    user = f"cache-{conv.sample_id}"
    root = proxy.removesuffix("/v1")
    before = len(recorded(upstream))
    injected: list[int] = []
    async with aiohttp.ClientSession() as session:
        for dialect, url, build in (("chat", f"{proxy}/chat/completions", chat_body),
                                    ("messages", f"{root}/v1/messages", messages_body)):  # fmt: skip
            headers = {"X-Memory-User": user, "X-Memory-Mode": mode, "X-Memory-Conversation": f"{dialect}-{mode}",
                       "Authorization": "Bearer sk-bench", "x-api-key": "sk-bench"}  # fmt: skip
            history: list[dict[str, str]] = []
            for exchange in chat:
                answer = await send(session, url, build(history, exchange), headers)
                if dialect == "chat":
                    injected.append(int(answer.get("X-Memory-Injected", "0")))
                history += [
                    {"role": "user", "content": exchange.user},
                    {"role": "assistant", "content": exchange.reply},
                ]
        seen = recorded(upstream)[before:]
        recall = await probes(session, proxy, user, mode, chat, conv, ids_to_turns)
    chat_texts = [serialized(r)[0] for r in seen if r.get("path") == "/v1/chat/completions" and _replayed(r)]
    anthropic = [serialized(r) for r in seen if r.get("path") == "/v1/messages" and _replayed(r)]
    return Replay(chat_texts, anthropic, injected, recall)


def _replayed(request: Mapping[str, Any]) -> bool:
    metadata = request["json"].get("metadata")
    return isinstance(metadata, Mapping) and "fake_reply" in metadata


async def probes(
    session: aiohttp.ClientSession,
    proxy: str,
    user: str,
    mode: str,
    chat: Sequence[Exchange],
    conv: Conversation,
    ids_to_turns: Any,
) -> list[float]:
    """Each question with evidence in the told sessions asked as the chat's next message: evidence recall@10."""
    if mode == "off":
        return []
    told = {t.dia_id for t in conv.turns if t.session < chat[0].session}
    history: list[dict[str, str]] = []
    for exchange in chat:
        history += [{"role": "user", "content": exchange.user}, {"role": "assistant", "content": exchange.reply}]
    headers = {"X-Memory-User": user, "X-Memory-Mode": mode, "X-Memory-Conversation": f"chat-{mode}",
               "Authorization": "Bearer sk-bench"}  # fmt: skip
    out = []
    for question in conv.questions:
        if not set(question.evidence) <= told:
            continue
        body = {"model": "gpt-bench", "messages": [{"role": "system", "content": SYSTEM_PROMPT}, *history,
                                                   {"role": "user", "content": question.text}]}  # fmt: skip
        answer = await send(session, f"{proxy}/chat/completions", body, headers)
        ids = [i for i in answer.get("X-Memory-Ids", "").split(",") if i][:10]
        found = set().union(*(ids_to_turns(i) for i in ids)) if ids else set()
        out.append(len(found & set(question.evidence)) / len(question.evidence))
    return out


async def tell(proxy: str, conv: Conversation, sessions: Sequence[int]) -> int:
    """The told sessions, one stored conversation each (``write`` mode); returns how many exchanges."""
    user = f"cache-{conv.sample_id}"
    count = 0
    async with aiohttp.ClientSession() as session:
        for number in sessions:
            history: list[dict[str, str]] = []
            headers = {"X-Memory-User": user, "X-Memory-Mode": "write", "X-Memory-Conversation": f"s{number}",
                       "Authorization": "Bearer sk-bench"}  # fmt: skip
            for exchange in exchanges([t for t in conv.turns if t.session == number]):
                await send(session, f"{proxy}/chat/completions", chat_body(history, exchange), headers)
                history += [
                    {"role": "user", "content": exchange.user},
                    {"role": "assistant", "content": exchange.reply},
                ]
                count += 1
    return count


def admin_get(proxy: str, path: str) -> Any:
    """A management API answer."""
    request = urllib.request.Request(  # noqa: S310 (loopback)
        proxy.removesuffix("/v1") + path, headers={"Authorization": f"Bearer {ADMIN_KEY}"}
    )
    with urllib.request.urlopen(request, timeout=60) as answer:  # noqa: S310
        return json.loads(answer.read())


def stored_turns(proxy: str, user: str) -> list[dict[str, Any]]:
    """Every stored turn of the user."""
    out, cursor = [], None
    while True:
        query = "?kind=turn&limit=500" + (f"&cursor={cursor}" if cursor else "")
        page = admin_get(proxy, f"/v1/memory/users/{user}/memories{query}")
        out += page["data"]
        cursor = page.get("next_cursor")
        if not cursor:
            return out


def turn_map(records: Sequence[Mapping[str, Any]], conv: Conversation) -> dict[str, set[str]]:
    """Memory id -> the dia_ids whose text it holds."""
    out: dict[str, set[str]] = {}
    for record in records:
        text = str(record.get("text", ""))
        out[str(record["id"])] = {t.dia_id for t in conv.turns if t.memory_text in text}
    return out


# --- the whole bench --------------------------------------------------------------------------------------


def _env(data: Path, upstream: str, placement: str, extra: Sequence[str] = ()) -> dict[str, str]:
    return {
        **dict(item.split("=", 1) for item in extra),
        "MEMPROXY_UPSTREAM__BASE_URL": upstream,
        "MEMPROXY_UPSTREAM__ANTHROPIC_BASE_URL": upstream.removesuffix("/v1"),
        "MEMPROXY_STORAGE__PATH": str(data),
        "MEMPROXY_ADMIN__API_KEY": ADMIN_KEY,
        "MEMPROXY_INJECTION__PLACEMENT": placement,
        "MEMPROXY_MEMORY__RETRIEVAL_TIMEOUT_MS": "5000",
    }


def wait_stored(proxy: str, users: Mapping[str, int], timeout: float = 900.0) -> None:
    """Until every told exchange's two turns are stored and searchable."""
    deadline = time.monotonic() + timeout
    for user, exchanges_told in users.items():
        while len(stored_turns(proxy, user)) < 2 * exchanges_told:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{user}: turns not stored in time")
            time.sleep(1.0)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Tell, replay per placement, bill."""
    conversations = load_conversations(DATA)[: args.conversations]
    plan = {c.sample_id: sorted({t.session for t in c.turns}) for c in conversations}
    data = Path(tempfile.mkdtemp(prefix="bench-cache-"))
    replays: dict[tuple[str, str], list[Replay]] = {}
    with ExitStack() as stack:
        _, upstream = stack.enter_context(fake_upstream_process(record=True))
        maps: dict[str, dict[str, set[str]]] = {}
        with memproxy_process(_env(data, upstream, "cached"), timeout=180.0) as (_, proxy):
            told = {}
            for conv in conversations:
                sessions = plan[conv.sample_id][: -args.chat_sessions]
                told[f"cache-{conv.sample_id}"] = asyncio.run(tell(proxy, conv, sessions))
                print(f"told {conv.sample_id}: {len(sessions)} sessions", flush=True)
            wait_stored(proxy, told)
            for conv in conversations:
                maps[conv.sample_id] = turn_map(stored_turns(proxy, f"cache-{conv.sample_id}"), conv)
        memory_side = [r for r in recorded(upstream) if "response_format" in r["json"]]
        for placement in args.placements:
            with memproxy_process(_env(data, upstream, placement, args.env), timeout=180.0) as (_, proxy):
                for mode in ("off", "read") if placement == args.placements[0] else ("read",):
                    key = ("memory off" if mode == "off" else placement, mode)
                    for conv in conversations:
                        chat = [
                            e for e in exchanges(conv.turns) if e.session in plan[conv.sample_id][-args.chat_sessions :]
                        ]
                        mapping = maps[conv.sample_id]
                        replays.setdefault(key, []).append(
                            asyncio.run(replay(proxy, upstream, conv, chat, mode, lambda i, m=mapping: m.get(i, set())))
                        )
                    print(f"replayed {key[0]} ({mode})", flush=True)
    return report(replays, memory_side, args)


def report(
    replays: Mapping[tuple[str, str], list[Replay]], memory_side: Sequence[Any], args: argparse.Namespace
) -> dict[str, Any]:
    """The JSON document: one row per placement and mode."""
    off = replays[("memory off", "off")]
    off_openai = sum(openai_bill(r.chat).billed for r in off)
    off_anthropic = sum(anthropic_bill(r.anthropic).billed for r in off)
    off_unshared = sum(unshared_bytes(r.chat) for r in off)
    off_bytes = sum(len(t) for r in off for t in r.chat)
    rows = []
    for (placement, mode), runs in replays.items():
        openai = [openai_bill(r.chat) for r in runs]
        added = sum(len(t) for r in runs for t in r.chat) - off_bytes
        recall = [x for r in runs for x in r.recall]
        later = [n for r in runs for n in r.injected[len(r.injected) // 2 :]]
        rows.append({
            "placement": placement,
            "mode": "off" if mode == "off" else "on",
            "cached_share": round(sum(b.cached for b in openai) / sum(b.tokens for b in openai), 4),
            "billed_input_ratio_vs_off_openai": round(sum(b.billed for b in openai) / off_openai, 4),
            "billed_input_ratio_vs_off_anthropic": round(
                sum(anthropic_bill(r.anthropic).billed for r in runs) / off_anthropic, 4
            ),
            "block_recall@10": round(sum(recall) / len(recall), 4) if recall else None,
            "unshared_ratio": round(sum(unshared_bytes(r.chat) for r in runs) / (off_unshared + max(added, 0)), 4),
            "later_requests_with_memory": round(sum(1 for n in later if n > 0) / len(later), 4) if later else None,
            "requests": sum(len(r.chat) for r in runs),
            "questions": len(recall),
        })  # fmt: skip
    side = openai_bill([serialized(r)[0] for r in memory_side])
    side_share = round(side.cached / side.tokens, 4) if side.tokens else None
    return {
        "rows": rows,
        "memory_side": {"calls": len(memory_side), "cached_share": side_share},
        "meta": {"conversations": args.conversations, "chat_sessions": args.chat_sessions, "token_bytes": TOKEN_BYTES,
                 "python": platform.python_version(), "argv": sys.argv[1:]},
    }  # fmt: skip


def table(document: Mapping[str, Any]) -> Iterator[str]:
    """The rows as a text table."""
    yield "placement     mode  cached  openai x off  anthropic x off  block R@10  unshared  later w/ memory"
    for row in document["rows"]:
        recall = row["block_recall@10"]
        later = row["later_requests_with_memory"]
        yield (
            f"{row['placement']:<13} {row['mode']:<5} {row['cached_share']:>6.3f} "
            f"{row['billed_input_ratio_vs_off_openai']:>13.3f} {row['billed_input_ratio_vs_off_anthropic']:>16.3f} "
            f"{'' if recall is None else f'{recall:.3f}':>11} {row['unshared_ratio']:>9.3f} "
            f"{'' if later is None else f'{later:.2f}':>16}"
        )
    yield f"memory side: {document['memory_side']}"


def main() -> None:
    """``make bench-cache``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=10, help="LoCoMo conversations (of 10)")
    parser.add_argument("--chat-sessions", type=int, default=6, help="sessions replayed as the growing chat")
    parser.add_argument("--placements", nargs="*", default=list(PLACEMENTS), help="placements to replay")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--env", nargs="*", default=[], help="MEMPROXY_X__Y=value settings for the replays")
    args = parser.parse_args()
    document = run(args)
    print("\n".join(table(document)))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(document, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
