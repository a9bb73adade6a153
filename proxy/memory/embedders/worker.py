"""The threads that run the model: queries go first, documents get their share, no hop through the loop.

Callers on the event loop hand work to the threads and await a future; a thread takes the next piece itself
(no event-loop round trip between two model calls, so a busy loop does not leave the model idle) and answers
through ``call_soon_threadsafe``. A piece is one text for a model that embeds each text alone, else the whole
call. Queries (urgent) go before documents, but while both wait, a document piece goes after every
``urgent_run`` query pieces in a row: a steady stream of chat requests never stops turns becoming searchable,
and a query never waits behind more than one document piece per thread.

With ``threads`` > 1 several pieces run at once on one model (an onnxruntime session may be run from several
threads at a time; each run keeps to its own intra-op threads): the write side's embeddings use every core the
chat leaves free (two threads: 2.0 ms of wall time per LoCoMo turn against 4.4 with one, the same CPU).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from proxy.memory.embedders.protocol import Vectors
from proxy.memory.errors import EmbedderError

Run = Callable[[list[str]], Vectors]


@dataclass(eq=False)
class _Work:
    run: Run
    texts: list[str]
    piece: int  # texts per model call
    future: asyncio.Future[Vectors]
    loop: asyncio.AbstractEventLoop
    done: dict[int, Vectors] = field(default_factory=dict)  # by the position of the piece's first text
    claimed: int = 0  # texts handed to a thread so far
    finished: int = 0  # texts embedded so far
    in_flight: int = 0  # its pieces at the model now
    failed: bool = False


class ModelWorker:
    """Daemon threads that share the model; ``submit`` from the event loop, ``close`` to stop them."""

    def __init__(self, *, urgent_run: int = 1, name: str = "embedder", threads: int = 1) -> None:
        self._urgent: deque[_Work] = deque()
        self._other: deque[_Work] = deque()
        self._urgent_run = urgent_run
        self._streak = 0
        self._closing = False
        self._cond = threading.Condition()
        self._threads = [
            threading.Thread(target=self._serve, name=name if threads == 1 else f"{name}-{i}", daemon=True)
            for i in range(max(1, threads))
        ]
        for thread in self._threads:
            thread.start()

    async def submit(self, run: Run, texts: list[str], *, urgent: bool, per_text: bool) -> Vectors:
        """``run(texts)``, in pieces of one text when ``per_text``; cancelling the caller drops what is left."""
        loop = asyncio.get_running_loop()
        work = _Work(run, list(texts), 1 if per_text else max(1, len(texts)), loop.create_future(), loop)
        if not work.texts:
            return np.zeros((0, 0), dtype=np.float32)
        with self._cond:
            if self._closing:
                raise EmbedderError("the embedder is closed")
            (self._urgent if urgent else self._other).append(work)
            self._cond.notify()
        return await work.future

    @property
    def waiting_texts(self) -> int:
        """Texts handed in and not yet taken by a thread (an estimate's input: no lock, read as it is)."""
        return sum(len(w.texts) - w.claimed for w in (*self._urgent, *self._other))

    @property
    def threads(self) -> int:
        return len(self._threads)

    def renice(self, nice: int) -> None:
        """Run the threads at this scheduling priority (Linux: a thread's own nice value; elsewhere nothing)."""
        for thread in self._threads:
            if thread.native_id is not None:
                with contextlib.suppress(OSError, AttributeError):
                    os.setpriority(os.PRIO_PROCESS, thread.native_id, nice)

    def close(self, timeout_s: float = 30.0) -> None:
        """Finish the pieces in flight, fail what waits, stop the threads."""
        with self._cond:
            self._closing = True
            waiting = [w for w in (*self._urgent, *self._other) if not w.in_flight]  # else their thread answers
            self._urgent.clear()
            self._other.clear()
            self._cond.notify_all()
        for work in waiting:
            _answer(work, None, EmbedderError("the embedder is closed"))
        for thread in self._threads:
            if threading.current_thread() is not thread:
                thread.join(timeout_s)

    def _serve(self) -> None:
        while True:
            with self._cond:
                while not (self._urgent or self._other or self._closing):
                    self._cond.wait()
                if self._closing:
                    return
                queue = self._next_queue()
                work = queue[0]
                if work.future.cancelled() or work.failed:  # the caller gave up or was failed: nothing more
                    queue.popleft()
                    continue
                start = work.claimed
                work.claimed = min(len(work.texts), start + work.piece)
                if work.claimed >= len(work.texts):  # its last piece: no other thread takes it up
                    queue.popleft()
                work.in_flight += 1
                if self._urgent or self._other:
                    self._cond.notify()  # another thread may take the next piece meanwhile
            piece = work.texts[start : work.claimed]
            try:
                vectors = work.run(piece)
            except BaseException as error:  # any failure of the model goes to its caller, the threads serve on
                self._settle(work, None, error)
                continue
            self._settle(work, (start, vectors), None)

    def _settle(self, work: _Work, result: tuple[int, Vectors] | None, error: BaseException | None) -> None:
        """Note one piece's outcome; answer the caller once every piece is in, or at the first failure."""
        with self._cond:
            work.in_flight -= 1
            if result is not None and not work.failed:
                start, vectors = result
                work.done[start] = vectors
                work.finished += len(vectors)
            complete = work.finished >= len(work.texts)
            fail = error is not None and not work.failed
            work.failed = work.failed or fail  # its pieces still queued are skipped, as a cancelled caller's
            closing = self._closing and not complete and not work.failed
        if fail:
            _answer(work, None, error)
        elif complete and not work.failed:
            pieces = [work.done[k] for k in sorted(work.done)]
            _answer(work, pieces[0] if len(pieces) == 1 else np.concatenate(pieces), None)
        elif closing:
            _answer(work, None, EmbedderError("the embedder is closed"))

    def _next_queue(self) -> deque[_Work]:
        """Queries first; a waiting document piece after ``urgent_run`` query pieces in a row."""
        if self._urgent and (not self._other or self._streak < self._urgent_run):
            self._streak += 1
            return self._urgent
        self._streak = 0
        return self._other if self._other else self._urgent


def _answer(work: _Work, vectors: Vectors | None, error: BaseException | None) -> None:
    """Settle the caller's future on its own loop (a loop already closed has no caller left)."""

    def settle() -> None:
        if work.future.done():
            return
        if error is not None:
            work.future.set_exception(error)
        else:
            work.future.set_result(vectors)  # type: ignore[arg-type]

    with contextlib.suppress(RuntimeError):
        work.loop.call_soon_threadsafe(settle)
