"""The store's background tasks: the batch writer (one commit per batch of callers) and the maintenance ticker."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import structlog

from proxy.memory.errors import StoreError
from proxy.memory.store.faults import StorageHealth, is_storage_fault

log = structlog.get_logger(__name__)

_T = TypeVar("_T")


@dataclass
class Submission(Generic[_T]):
    """One caller's items and the future that tells it they are written."""

    items: Sequence[_T]
    done: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


_STOP = object()


class BatchWriter(Generic[_T]):
    """Coalesces concurrent submissions into one ``flush`` call per ``max_rows`` items or ``interval_s``.

    ``flush`` receives the batch's submissions and returns, for each, None (written) or the exception to
    raise to that caller; if ``flush`` itself raises, every caller of the batch gets the error.
    """

    def __init__(
        self,
        flush: Callable[[list[Submission[_T]]], Awaitable[list[BaseException | None]]],
        max_rows: int,
        interval_s: float,
        max_pending: int = 1024,
        health: StorageHealth | None = None,
    ) -> None:
        self._flush = flush
        self._health = health or StorageHealth()
        self._max_rows = max_rows
        self._interval = interval_s
        self._queue: asyncio.Queue[Any] = asyncio.Queue(max_pending)
        self._task: asyncio.Task[None] | None = None
        self._closed = False

    async def __aenter__(self) -> BatchWriter[_T]:
        self._task = asyncio.create_task(self._run(), name="memory-batch-writer")
        return self

    async def __aexit__(self, *exc: object) -> None:
        """Flush everything submitted so far, then stop."""
        self._closed = True
        if self._task is None:
            return
        await self._queue.put(_STOP)
        await self._task
        self._task = None

    async def submit(self, items: Sequence[_T]) -> None:
        """Queue ``items`` and wait until the flush that carries them is done."""
        if self._closed or self._task is None:
            raise StoreError("the memory store is closed")
        if self._task.done():
            raise StoreError("the memory store's writer has stopped")
        submission = Submission(items)
        await self._queue.put(submission)
        await submission.done

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        stopping = False
        while not stopping:
            first = await self._queue.get()
            if first is _STOP:
                return
            batch, rows = [first], len(first.items)
            deadline = loop.time() + self._interval
            while rows < self._max_rows:
                item = await self._next(deadline - loop.time())
                if item is None:
                    break
                if item is _STOP:
                    stopping = True
                    break
                batch.append(item)
                rows += len(item.items)
            await self._flush_batch(batch)

    async def _next(self, wait_s: float) -> Any:
        """The next queued item, waiting at most ``wait_s`` seconds (None when there is none)."""
        with contextlib.suppress(asyncio.QueueEmpty):
            return self._queue.get_nowait()
        if wait_s <= 0:
            return None
        try:
            return await asyncio.wait_for(self._queue.get(), wait_s)
        except TimeoutError:
            return None

    async def _flush_batch(self, batch: list[Submission[_T]]) -> None:
        try:
            errors = await self._flush(batch)
        except Exception as exc:  # every caller of the batch must hear about it, and the writer lives on
            if is_storage_fault(exc):  # logged once per fault, not once per batch
                self._health.fault("store", exc)
            else:
                log.exception("memory.flush_failed", submissions=len(batch))
            errors = [exc] * len(batch)
        else:
            self._health.ok("store")
        for submission, error in zip(batch, errors, strict=True):
            if submission.done.done():
                continue
            if error is None:
                submission.done.set_result(None)
            else:
                submission.done.set_exception(error)


class Ticker:
    """Calls ``fn`` every ``interval_s`` seconds, or sooner when ``wake()``-d, until closed; errors are logged,
    not fatal."""

    def __init__(
        self, name: str, interval_s: float, fn: Callable[[], Awaitable[None]], health: StorageHealth | None = None
    ) -> None:
        self._name = name
        self._interval = interval_s
        self._fn = fn
        self._health = health or StorageHealth()
        self._task: asyncio.Task[None] | None = None
        self._woken = asyncio.Event()

    def wake(self) -> None:
        """Run ``fn`` now rather than at the end of the interval (once, however often woken meanwhile)."""
        self._woken.set()

    async def __aenter__(self) -> Ticker:
        self._task = asyncio.create_task(self._run(), name=self._name)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._interval):
                    await self._woken.wait()
            self._woken.clear()
            try:
                await self._fn()
            except Exception as exc:  # a failed maintenance round is retried at the next tick
                if is_storage_fault(exc):  # once per fault, not once a second
                    self._health.fault(self._name, exc)
                else:
                    log.exception("memory.maintenance_failed", task=self._name)
            else:
                self._health.ok(self._name)
