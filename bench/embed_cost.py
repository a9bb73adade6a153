"""CPU per text and per exchange of the write path's embeddings, by model and way of running it.

``.venv/bin/python bench/embed_cost.py``: 300 turns of LoCoMo's second conversation (``LOCOMO_DATA``), one
onnxruntime thread, CPU time (``process_time``) so that a busy machine changes little. Per turn: the fp32 model
in sorted batches of 64 (a former default), fp32 each text alone, int8 each text alone (the default document
model), the static model (the default query side, and a document model option). Per exchange (a user turn and
its reply): the former writer (fp32, the two turns and the two "previous + turn" texts in one call) against
today's (the two turns and the turn before the exchange), with int8 and with the static model; and one question
as the read path embeds it. Prints a table only.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.locomo import DATA, load_conversations
from proxy.memory.embedders.factory import build_embedder
from proxy.memory.embedders.model_files import ONNX_MODEL_DIR_NAME, STATIC_MODEL_DIR_NAME, default_model_dirs
from proxy.memory.embedders.settings import EmbedderSettings

FP32 = EmbedderSettings(model_path=default_model_dirs("all-MiniLM-L6-v2")[0], query_model=None)
# the default's document model (queries through it too here), and its query side
INT8 = EmbedderSettings(model_path=default_model_dirs(ONNX_MODEL_DIR_NAME)[0], query_model=None)
STATIC = EmbedderSettings(model_path=default_model_dirs(STATIC_MODEL_DIR_NAME)[0])


async def cpu_ms(settings: EmbedderSettings, calls: Sequence[list[str]]) -> float:
    """CPU milliseconds of ``embed_documents`` over all ``calls`` (after one warm-up call)."""
    async with build_embedder(settings) as embedder:
        await embedder.embed_documents(calls[0])
        started = time.process_time()
        for texts in calls:
            await embedder.embed_documents(texts)
        return (time.process_time() - started) * 1000


async def query_ms(settings: EmbedderSettings, questions: Sequence[str]) -> float:
    """CPU milliseconds per question embedded as the read path does (uncached: each text once)."""
    async with build_embedder(settings) as embedder:
        await embedder.embed_query("warm-up")
        started = time.process_time()
        for question in questions:
            await embedder.embed_query(question)
        return (time.process_time() - started) * 1000 / len(questions)


async def main() -> None:
    conversation = load_conversations(DATA)[1]
    turns = [turn.text for turn in conversation.turns][:301]
    questions = list(dict.fromkeys(q.text for q in conversation.questions))
    exchanges = [(turns[i - 1], turns[i], turns[i + 1]) for i in range(1, 300, 2)]
    chunks = [turns[i : i + 64] for i in range(0, 300, 64)]
    alone = [[text] for text in turns[:300]]
    former = [[x[1], x[2], f"{x[0]}\n{x[1]}", f"{x[1]}\n{x[2]}"] for x in exchanges]  # own + pair texts
    today = [list(x) for x in exchanges]  # the turn before the exchange + own
    rows = [
        ("fp32, batches of 64 sorted by length, ms per turn", await cpu_ms(FP32, chunks) / 300),
        ("fp32, each text alone, ms per turn", await cpu_ms(FP32, alone) / 300),
        ("int8, each text alone (the default document model), ms per turn", await cpu_ms(INT8, alone) / 300),
        (
            "former writer (fp32, own + pair texts), ms per exchange",
            await cpu_ms(FP32, former) / 150,
        ),
        ("static model (as the document model), ms per turn", await cpu_ms(STATIC, alone) / 300),
        (
            "writer (int8, the default: own + the turn before), ms per exchange",
            await cpu_ms(INT8, today) / 150,
        ),
        ("writer (static, own + the turn before), ms per exchange", await cpu_ms(STATIC, today) / 150),
        ("query (int8), ms per question", await query_ms(INT8, questions)),
        ("query (static: the default query side), ms per question", await query_ms(STATIC, questions)),
    ]
    for name, value in rows:
        print(f"{name:60s} {value:7.2f}")


if __name__ == "__main__":
    asyncio.run(main())
