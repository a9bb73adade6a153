"""Turns at the one model worker: queries (urgent) go before document batches, without starving them."""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
from collections.abc import AsyncIterator


class Turns:
    """One model call at a time, in order, except that waiting urgent calls (queries) go before the others.

    A chat request's query must not wait behind a queue of document batches from the write path; but after
    ``urgent_run`` urgent turns in a row, a waiting document batch goes next, so that a steady stream of
    queries never starves the write path (turns would stop becoming searchable).
    """

    def __init__(self, urgent_run: int = 4) -> None:
        self._busy = False
        self._waiting: list[tuple[int, int, asyncio.Future[None]]] = []
        self._order = itertools.count()
        self._urgent_run = urgent_run
        self._urgent_streak = 0

    @contextlib.asynccontextmanager
    async def turn(self, *, urgent: bool) -> AsyncIterator[None]:
        """Hold the one turn for the body of the ``async with``."""
        if self._busy:
            handed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            heapq.heappush(self._waiting, (0 if urgent else 1, next(self._order), handed))
            try:
                await handed
            except asyncio.CancelledError:
                if handed.done() and not handed.cancelled():  # the turn was ours: pass it on
                    self._release()
                raise
        else:
            self._busy = True
        try:
            yield
        finally:
            self._release()

    def _release(self) -> None:
        while self._waiting:
            rank, _, handed = self._next_waiting()
            if not handed.done():
                self._urgent_streak = self._urgent_streak + 1 if rank == 0 else 0
                handed.set_result(None)  # the turn passes straight on; still busy
                return
        self._busy = False

    def _next_waiting(self) -> tuple[int, int, asyncio.Future[None]]:
        """The most urgent waiter, or the oldest other one once urgent turns had ``urgent_run`` in a row."""
        if self._urgent_streak >= self._urgent_run:
            others = [entry for entry in self._waiting if entry[0] != 0]
            if others:
                oldest = min(others)
                self._waiting.remove(oldest)
                heapq.heapify(self._waiting)
                return oldest
        return heapq.heappop(self._waiting)
