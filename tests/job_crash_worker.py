"""A write-path worker process for the crash test: it enqueues exchanges and processes them until killed.

Usage: ``python -m tests.job_crash_worker DATA_DIR LLM_BASE_URL COUNT``. Prints ``READY`` once open,
``ACK <n> <job id>`` after each enqueue has returned (the exchange is acknowledged: durable), and
``START <kind> <job id>`` when a job starts. The test kills it with SIGKILL part-way through.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from datetime import UTC, datetime
from pathlib import Path

from proxy.memory.service import Exchange
from proxy.memory.store.memory_store import MemoryStore, StoreSettings
from proxy.memory.write.extraction import ExtractionSettings, Extractor
from proxy.memory.write.job_types import JobQueueSettings
from proxy.memory.write.llm import OpenAICompatibleLLM, OpenAICompatibleSettings
from proxy.memory.write.queue import Handler, Job, JobQueue
from proxy.memory.write.runner import JobRunner
from proxy.memory.write.settings import WriterSettings
from proxy.memory.write.writer import Writer
from tests.support.embedder import HashingEmbedder


def exchange(n: int) -> Exchange:
    """The n-th exchange of the crash test (three users, unique text)."""
    return Exchange(
        request_id=f"req-{n}", user_id=f"u{n % 3}", conversation_id=f"c{n % 3}", model="chat-model",
        route="default", user_messages=(f"I own item number {n}",), assistant_text=f"Reply {n}",
        partial=False, finished_at=datetime.now(UTC),
    )  # fmt: skip


def announced(kind: str, handler: Handler) -> Handler:
    """``handler``, printing a START line first."""

    async def run(job: Job) -> None:
        print(f"START {kind} {job.id}", flush=True)
        await handler(job)

    return run


async def main(data: Path, llm_url: str, count: int) -> None:
    """Open the write path on ``data``, enqueue ``count`` exchanges while processing, then idle until killed."""
    async with contextlib.AsyncExitStack() as stack:
        store = await stack.enter_async_context(MemoryStore(StoreSettings(path=data / "store"), HashingEmbedder()))
        queue = await stack.enter_async_context(
            JobQueue(JobQueueSettings(path=data / "queue", poll_interval_s=0.05, backoff_base_s=0.05))
        )
        llm = await stack.enter_async_context(OpenAICompatibleLLM(OpenAICompatibleSettings(base_url=llm_url)))
        writer = Writer(
            WriterSettings(summary_idle_s=3600, insights_debounce_s=3600, facts_window_wait_s=0.2),
            store, queue, Extractor(ExtractionSettings(), llm),
        )  # fmt: skip
        handlers = {kind: announced(kind, h) for kind, h in writer.handlers().items()}
        await stack.enter_async_context(JobRunner(queue, handlers))
        print("READY", flush=True)
        for n in range(count):
            job_id = await writer.record(exchange(n))
            print(f"ACK {n} {job_id}", flush=True)
            await asyncio.sleep(0.01)
        await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])))
