"""``memproxy eval --data FILE``: the retrieval benchmark on a file in LoCoMo's layout, with this configuration.

The same measure as ``bench/locomo.py`` (the developer harness, with its variants and ablations), reduced to
one question an operator asks: how well does *my* configuration (embedder, ``[retrieval]``, ``[rerank]``,
``[store]``) find the evidence? Each conversation of the file becomes one user whose memories are its turns
(``"Speaker: text"``, an image caption appended, dated by the session, 30 s apart), stored through the real
``MemoryStore`` in a temporary directory; each category 1-4 question with evidence goes through the proxy's
read path (``retrieve``) on the dataset's own clock (an hour after the conversation's last turn), and its
ranked memories, mapped to turn ids, are scored: evidence recall@5/@10, hit@1/5/10, all@10, MRR.

Like the harness, the settings a dataset of months-old conversations cannot exercise are neutralised
(``NEUTRALISED``: a configured window of past turns would hide almost every turn; there are no other
conversations, no insights, and arm deadlines are for live traffic, not a batch run); everything else is the
configuration as given, recency included. The report lists what was neutralised.
"""

from __future__ import annotations

import contextlib
import json
import re
import sys
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import IO, Any

import uvloop
from tqdm import tqdm

from proxy.config import Settings, StorageSettings
from proxy.memory.embedders import build_embedder
from proxy.memory.read import NameIndexCache, Reranker, retrieve
from proxy.memory.store import Kind, MemoryRecord, MemoryStore
from proxy.transfer import content_id

CATEGORIES = {1: "multi-hop", 2: "temporal", 3: "open-domain", 4: "single-hop"}
TURN_SPACING = timedelta(seconds=30)
NEUTRALISED = {"turn_window_days": None, "recent_messages": 0, "max_insights": 0, "arm_timeout_ms": 60_000.0}
METRICS = ("evidence_recall@5", "evidence_recall@10", "hit@1", "hit@5", "hit@10", "all@10", "mrr")
_SESSION = re.compile(r"^session_(\d+)$")
_DIA = re.compile(r"D:?(\d+):(\d+)")


class EvalDataError(ValueError):
    """The file is not in LoCoMo's layout; the message says where."""


@dataclass(frozen=True, slots=True)
class Conversation:
    """One sample: its turns as memories (with their turn ids) and its questions (text, category, evidence)."""

    sample_id: str
    turns: tuple[tuple[str, MemoryRecord], ...]
    questions: tuple[tuple[str, int, tuple[str, ...]], ...]


def session_date(text: str) -> datetime:
    """A session's ``"1:56 pm on 8 May, 2023"`` as a UTC datetime."""
    return datetime.strptime(text.strip(), "%I:%M %p on %d %B, %Y").replace(tzinfo=UTC)


def dia_ids(raw: object, existing: Iterable[str]) -> tuple[str, ...]:
    """Turn ids named in an evidence value (a string or list), normalised, existing ones only, de-duplicated."""
    known = set(existing)
    values = raw if isinstance(raw, list) else [raw]
    found = (f"D{int(s)}:{int(t)}" for value in values for s, t in _DIA.findall(str(value)))
    return tuple(dict.fromkeys(d for d in found if d in known))


def _turns(user_id: str, conversation: Mapping[str, Any]) -> list[tuple[str, MemoryRecord]]:
    out = []
    first = conversation.get("speaker_a")
    sessions = sorted(int(m.group(1)) for key in conversation if (m := _SESSION.match(key)))
    for n in sessions:
        start = session_date(conversation[f"session_{n}_date_time"])
        for i, raw in enumerate(conversation[f"session_{n}"]):
            caption = f" [shared an image: {raw['blip_caption']}]" if raw.get("blip_caption") else ""
            text = f"{raw['speaker']}: {raw['text']}{caption}"
            role = "user" if raw["speaker"] == (first or raw["speaker"]) else "assistant"
            record = MemoryRecord(
                user_id=user_id,
                kind=Kind.TURN,
                text=text,
                role=role,
                id=content_id(user_id, "turn", raw["dia_id"]),
                conversation_id=f"session_{n}",
                created_at=start + i * TURN_SPACING,
            )
            out.append((raw["dia_id"], record))
    return out


def load_locomo(path: Path) -> list[Conversation]:
    """Every sample of a file in LoCoMo's layout (``EvalDataError`` naming the sample when it is not)."""
    try:
        samples = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise EvalDataError(f"{path}: not a readable JSON file: {exc}") from None
    if not isinstance(samples, list):
        raise EvalDataError(f"{path}: expected a JSON list of samples")
    out = []
    for index, sample in enumerate(samples):
        try:
            turns = _turns(f"eval-{index}", sample["conversation"])
            known = {dia for dia, _ in turns}
            questions = tuple(
                (qa["question"], int(qa["category"]), dia_ids(qa.get("evidence", []), known))
                for qa in sample["qa"]
                if qa.get("category") in CATEGORIES
            )
        except (KeyError, TypeError, ValueError) as exc:
            problem = f"{type(exc).__name__}: {exc}"
            raise EvalDataError(f"{path}: sample {index}: not in LoCoMo's layout ({problem})") from None
        kept = tuple(q for q in questions if q[2])
        out.append(Conversation(str(sample.get("sample_id", index)), tuple(turns), kept))
    return out


def question_metrics(ranked: Sequence[str], gold: Sequence[str]) -> dict[str, float]:
    """Evidence recall@5/@10, hit@1/5/10, all@10 and the reciprocal rank of the first gold turn (pure)."""
    wanted = set(gold)
    first = next((i for i, d in enumerate(ranked) if d in wanted), None)

    def found(k: int) -> int:
        return len(wanted & set(ranked[:k]))

    return {
        "evidence_recall@5": found(5) / len(wanted),
        "evidence_recall@10": found(10) / len(wanted),
        "hit@1": float(found(1) > 0),
        "hit@5": float(found(5) > 0),
        "hit@10": float(found(10) > 0),
        "all@10": float(found(10) == len(wanted)),
        "mrr": 0.0 if first is None else 1.0 / (first + 1),
    }


def _mean(rows: Sequence[Mapping[str, float]]) -> dict[str, float]:
    return {name: round(sum(r[name] for r in rows) / len(rows), 4) for name in METRICS} if rows else {}


def summarise(rows: Sequence[tuple[int, Mapping[str, float]]]) -> dict[str, Any]:
    """Overall and per-category means of per-question metrics."""
    by_category = {
        CATEGORIES[c]: _mean([m for cat, m in rows if cat == c]) for c in CATEGORIES if any(cat == c for cat, _ in rows)
    }
    return {"questions": len(rows), "overall": _mean([m for _, m in rows]), "by_category": by_category}


async def evaluate(
    settings: Settings, conversations: Sequence[Conversation], *, bar: tqdm[Any] | None = None
) -> dict[str, Any]:
    """Ingest every conversation into a temporary store and score every question with ``settings``."""
    rows: list[tuple[int, Mapping[str, float]]] = []
    with tempfile.TemporaryDirectory(prefix="memproxy-eval-") as tmp:
        retrieval = settings.retrieval.model_copy(update=NEUTRALISED)
        scratch = settings.model_copy(update={"storage": StorageSettings(path=Path(tmp)), "retrieval": retrieval})
        async with contextlib.AsyncExitStack() as stack:
            embedder = await stack.enter_async_context(build_embedder(settings.embedder))
            reranker = await stack.enter_async_context(Reranker(settings.rerank))
            store = await stack.enter_async_context(MemoryStore(scratch.store_settings(), embedder))
            for conv in conversations:
                rows += await _conversation(store, embedder, reranker, scratch, conv)
                if bar is not None:
                    bar.update(len(conv.questions))
    return {
        "model": settings.embedder.label,
        "fusion": settings.retrieval.fusion,
        "neutralised": NEUTRALISED,
        **summarise(rows),
    }


async def _conversation(
    store: MemoryStore, embedder: Any, reranker: Reranker, settings: Settings, conv: Conversation
) -> list[tuple[int, Mapping[str, float]]]:
    if not conv.turns:
        return []
    await store.add([record for _, record in conv.turns])
    turn_of = {record.id: dia for dia, record in conv.turns}
    user_id = conv.turns[0][1].user_id
    now = max(record.created_at for _, record in conv.turns) + timedelta(hours=1)
    names = NameIndexCache()
    rows: list[tuple[int, Mapping[str, float]]] = []
    try:
        for text, category, evidence in conv.questions:
            result = await retrieve(
                store,
                embedder,
                [{"role": "user", "content": text}],
                user_id,
                settings.retrieval,
                now,
                names=names,
                reranker=reranker,
            )
            ranked = list(dict.fromkeys(turn_of[c.id] for c in result.candidates if c.id in turn_of))
            rows.append((category, question_metrics(ranked, evidence)))
    finally:
        await names.aclose()
    return rows


def _width(name: str) -> int:
    return max(len(name), 5) + 2


def table(report: Mapping[str, Any]) -> str:
    """The report as an aligned text table: overall, then one line per category."""
    lines = [
        f"{report['questions']} questions, embedder {report['model']}, fusion {report['fusion']}",
        f"{'':<12}" + "".join(f"{name:>{_width(name)}}" for name in METRICS),
    ]
    for label, values in [("overall", report["overall"]), *report["by_category"].items()]:
        lines.append(f"{label:<12}" + "".join(f"{values.get(name, 0.0):>{_width(name)}.3f}" for name in METRICS))
    return "\n".join(lines)


def run_eval_command(settings: Settings, data: Path, *, as_json: bool, out: IO[str]) -> int:
    """``memproxy eval``: load, evaluate with a progress bar on a terminal, print a table (or JSON)."""
    conversations = load_locomo(data)
    total = sum(len(c.questions) for c in conversations)
    with tqdm(total=total, unit="question", desc="eval", disable=not sys.stderr.isatty()) as bar:
        report = uvloop.run(evaluate(settings, conversations, bar=bar))
    out.write((json.dumps(report, indent=2) if as_json else table(report)) + "\n")
    return 0
