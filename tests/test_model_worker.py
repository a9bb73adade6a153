"""The model's thread: queries first, documents their share piece by piece, callers that leave, failures, close."""

from __future__ import annotations

import asyncio
import os
import threading

import numpy as np
import pytest

from proxy.memory.embedders.worker import ModelWorker
from proxy.memory.errors import EmbedderError

pytestmark = pytest.mark.asyncio


class Model:
    """A stand-in for the model: one row per text (its length), noting the texts of every call; the first
    call waits until ``release`` so that work can queue behind it."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []
        self.started = threading.Event()
        self.release = threading.Event()

    def __call__(self, texts: list[str]) -> np.ndarray:
        if not self.calls:
            self.started.set()
            self.release.wait(10)
        self.calls.append(list(texts))
        if "boom" in texts:
            raise EmbedderError("the model failed")
        return np.array([[float(len(t))] for t in texts], dtype=np.float32)


async def _queued(worker: ModelWorker, model: Model, *work: tuple[list[str], bool]) -> list[asyncio.Task[np.ndarray]]:
    """``work`` submitted in order while the model is busy with a first document."""
    first = asyncio.create_task(worker.submit(model, ["first"], urgent=False, per_text=True))
    await asyncio.to_thread(model.started.wait, 10)
    tasks = [first]
    for texts, urgent in work:
        tasks.append(asyncio.create_task(worker.submit(model, texts, urgent=urgent, per_text=True)))
        await asyncio.sleep(0)  # submitted in this order
    return tasks


async def test_queries_go_first_and_documents_get_every_other_piece() -> None:
    """While queries wait, a document piece goes after each query: a query waits for at most one text."""
    model, worker = Model(), ModelWorker(urgent_run=1)
    tasks = await _queued(worker, model, (["doc a1", "doc a2", "doc a3"], False), (["doc b"], False),
                          *((["q" + str(i)], True) for i in range(4)))  # fmt: skip
    model.release.set()
    results = await asyncio.gather(*tasks)
    worker.close()
    assert [c[0] for c in model.calls] == ["first", "q0", "doc a1", "q1", "doc a2", "q2", "doc a3", "q3", "doc b"]
    assert all(len(call) == 1 for call in model.calls)
    np.testing.assert_array_equal(results[1], [[6.0], [6.0], [6.0]])  # a document's rows, in its order


async def test_a_caller_that_leaves_gets_no_more_model_time() -> None:
    """A cancelled caller's pieces not yet run are dropped; the others are served."""
    model, worker = Model(), ModelWorker()
    tasks = await _queued(worker, model, (["gone 1", "gone 2"], False), (["kept"], False))
    tasks[1].cancel()
    model.release.set()
    assert (await tasks[2]).tolist() == [[4.0]]
    worker.close()
    assert ["gone 1"] not in model.calls
    assert ["gone 2"] not in model.calls
    assert tasks[1].cancelled()


async def test_a_failure_reaches_its_caller_and_the_thread_serves_on() -> None:
    """An error of the model goes to the caller whose text failed, not to the next one."""
    model, worker = Model(), ModelWorker()
    tasks = await _queued(worker, model, (["boom"], True), (["fine"], True))
    model.release.set()
    with pytest.raises(EmbedderError, match="failed"):
        await tasks[1]
    assert (await tasks[2]).tolist() == [[4.0]]
    worker.close()


async def test_close_fails_waiting_callers_and_refuses_new_work() -> None:
    """Closing finishes the piece in flight, fails what waits, and refuses what comes after."""
    model, worker = Model(), ModelWorker()
    tasks = await _queued(worker, model, (["waiting"], False))
    closing = asyncio.create_task(asyncio.to_thread(worker.close))
    for _ in range(1000):  # close has begun (not a fixed sleep: a busy machine may start the thread late)
        if worker._closing:
            break
        await asyncio.sleep(0.01)
    model.release.set()
    await closing
    assert (await tasks[0]).tolist() == [[5.0]]
    with pytest.raises(EmbedderError, match="closed"):
        await tasks[1]
    with pytest.raises(EmbedderError, match="closed"):
        await worker.submit(model, ["late"], urgent=True, per_text=True)


class Overlapping:
    """A stand-in model that notes how many calls run at once and on which threads: its first call waits until a
    second one has begun (so two threads must be at it together); "boom" fails its call."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.calls = 0
        self.running = 0
        self.most = 0
        self.threads: set[str] = set()
        self.second = threading.Event()

    def __call__(self, texts: list[str]) -> np.ndarray:
        with self.lock:
            self.calls += 1
            call = self.calls
            self.running += 1
            self.most = max(self.most, self.running)
            self.threads.add(threading.current_thread().name)
        if call == 1:
            self.second.wait(10)
        elif call == 2:
            self.second.set()
        with self.lock:
            self.running -= 1
        if "boom" in texts:
            raise EmbedderError("the model failed")
        return np.array([[float(len(t))] for t in texts], dtype=np.float32)


async def test_two_threads_run_pieces_of_one_call_at_once_and_keep_its_order() -> None:
    """With ``threads=2`` two pieces are at the model at once (one call's texts spread over both threads); the
    caller gets its rows in its own order; a failing piece fails its call once and the threads serve on."""
    model, worker = Overlapping(), ModelWorker(threads=2)
    texts = ["a" * n for n in range(1, 9)]
    rows = await worker.submit(model, texts, urgent=False, per_text=True)
    assert rows.ravel().tolist() == [float(n) for n in range(1, 9)]
    assert model.most == 2
    assert len(model.threads) == 2
    with pytest.raises(EmbedderError, match="failed"):
        await worker.submit(model, ["x", "boom", "y", "z"], urgent=False, per_text=True)
    assert (await worker.submit(model, ["fine"], urgent=True, per_text=True)).tolist() == [[4.0]]
    worker.close()


async def test_renice_lowers_the_threads_priority_only() -> None:
    """``renice`` sets the model threads' own nice value (Linux: per thread), not the caller's."""
    if not hasattr(os, "getpriority"):
        pytest.skip("no per-thread priorities here")
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    worker = ModelWorker(threads=2)
    target = min(19, mine + 5)
    worker.renice(target)
    ids = [t.native_id for t in worker._threads if t.native_id is not None]
    assert len(ids) == 2
    assert all(os.getpriority(os.PRIO_PROCESS, tid) == target for tid in ids)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine
    worker.close()
