"""Group commit: concurrent callers that each need a durable write share one transaction and one fsync.

A durable SQLite commit costs one fsync and the queue's database runs on one thread, so commits issued one
by one cap the write path at one exchange per fsync and queue each caller behind the others' fsyncs
(``bench/commit_cost.py`` measures both). ``GroupCommit`` lets every caller
submit its item and wait; one owned flusher task takes everything submitted while the previous batch was being
written and writes it as the next batch. A single caller pays exactly one commit, as before.

A caller that is cancelled while waiting does not take its item out of the batch: the write happens anyway
(what was handed over is committed), only the caller stops waiting for the answer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")

BatchFn = Callable[[list[T]], Awaitable[Sequence[R | BaseException]]]


class GroupCommit(Generic[T, R]):
    """Coalesces concurrent ``submit`` calls into batches written by ``write_batch``, one batch at a time.

    ``write_batch`` returns one result or exception per item; if it raises, every item of the batch fails
    with that error. ``aclose`` waits for the batch in flight and everything still submitted.
    """

    def __init__(self, write_batch: BatchFn[T, R], max_batch: int = 256) -> None:
        self._write_batch = write_batch
        self._max_batch = max_batch
        self._pending: list[tuple[T, asyncio.Future[R]]] = []
        self._flusher: asyncio.Task[None] | None = None
        self.batches = 0
        self.items = 0

    async def submit(self, item: T) -> R:
        """Write ``item`` in the next batch and return its result (or raise its error)."""
        future: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        self._pending.append((item, future))
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush(), name="memproxy-group-commit")
        return await future

    async def _flush(self) -> None:
        while self._pending:
            batch, self._pending = self._pending[: self._max_batch], self._pending[self._max_batch :]
            try:
                results: Sequence[R | BaseException] = await self._write_batch([item for item, _ in batch])
            except Exception as error:  # every caller of the batch hears about it; the flusher lives on
                results = [error] * len(batch)
            self.batches += 1
            self.items += len(batch)
            for (_, future), result in zip(batch, results, strict=True):
                if future.done():  # the caller stopped waiting; the item was written all the same
                    continue
                if isinstance(result, BaseException):
                    future.set_exception(result)
                else:
                    future.set_result(result)

    async def aclose(self) -> None:
        """Wait until everything submitted so far is written."""
        if self._flusher is not None:
            await asyncio.shield(self._flusher)
            self._flusher = None
