"""The read gate: reads of the table run together, and a cleanup that deletes old versions' files waits them out."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


class ReadGate:
    """Lets reads run together, and lets a cleanup that deletes old versions' files wait them out."""

    def __init__(self) -> None:
        self._readers = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._open = asyncio.Event()
        self._open.set()

    @contextlib.asynccontextmanager
    async def read(self) -> AsyncIterator[None]:
        """Hold the gate open for one read."""
        await self._open.wait()
        self._readers += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._readers -= 1
            if self._readers == 0:
                self._idle.set()

    @contextlib.asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        """Wait for running reads to finish and hold new ones back."""
        self._open.clear()
        try:
            await self._idle.wait()
            yield
        finally:
            self._open.set()
