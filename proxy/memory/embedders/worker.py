"""The one thread that runs the model: queries go first, documents get their share, no hop through the loop.

Callers on the event loop hand work to the thread and await a future; the thread takes the next piece itself
(no event-loop round trip between two model calls, so a busy loop does not leave the model idle) and answers
through ``call_soon_threadsafe``. A piece is one text for a model that embeds each text alone, else the whole
call. Queries (urgent) go before documents, but while both wait, a document piece goes after every
``urgent_run`` query pieces in a row: a steady stream of chat requests never stops turns becoming searchable,
and a query never waits behind more than one document piece.
"""

from __future__ import annotations

import asyncio
import contextlib
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
    done: list[Vectors] = field(default_factory=list)
    position: int = 0


class ModelWorker:
    """One daemon thread that owns the model; ``submit`` from the event loop, ``close`` to stop it."""

    def __init__(self, *, urgent_run: int = 1, name: str = "embedder") -> None:
        self._urgent: deque[_Work] = deque()
        self._other: deque[_Work] = deque()
        self._urgent_run = urgent_run
        self._streak = 0
        self._closing = False
        self._running: _Work | None = None  # the work whose piece is at the model
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    async def submit(self, run: Run, texts: list[str], *, urgent: bool, per_text: bool) -> Vectors:
        """``run(texts)``, in pieces of one text when ``per_text``; cancelling the caller drops what is left."""
        loop = asyncio.get_running_loop()
        work = _Work(run, list(texts), 1 if per_text else max(1, len(texts)), loop.create_future(), loop)
        with self._cond:
            if self._closing:
                raise EmbedderError("the embedder is closed")
            (self._urgent if urgent else self._other).append(work)
            self._cond.notify()
        return await work.future

    def close(self, timeout_s: float = 30.0) -> None:
        """Finish the piece in flight, fail what waits, stop the thread."""
        with self._cond:
            self._closing = True
            waiting = [w for w in (*self._urgent, *self._other) if w is not self._running]
            self._urgent.clear()
            self._other.clear()
            self._cond.notify()
        for work in waiting:
            _answer(work, None, EmbedderError("the embedder is closed"))
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)

    def _serve(self) -> None:
        while True:
            with self._cond:
                while not (self._urgent or self._other or self._closing):
                    self._cond.wait()
                if self._closing:
                    return
                queue = self._next_queue()
                work = self._running = queue[0]
            if work.future.cancelled():  # the caller gave up: nothing more for it
                self._drop(queue, work)
                continue
            piece = work.texts[work.position : work.position + work.piece]
            try:
                vectors = work.run(piece) if piece else np.zeros((0, 0), dtype=np.float32)
            except BaseException as error:  # any failure of the model goes to its caller, the thread serves on
                self._drop(queue, work)
                _answer(work, None, error)
                continue
            work.done.append(vectors)
            work.position += len(piece)
            if work.position >= len(work.texts):
                self._drop(queue, work)
                _answer(work, work.done[0] if len(work.done) == 1 else np.concatenate(work.done), None)
            elif self._closing:
                _answer(work, None, EmbedderError("the embedder is closed"))

    def _drop(self, queue: deque[_Work], work: _Work) -> None:
        with self._cond:
            if work in queue:
                queue.remove(work)
            self._running = None

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
