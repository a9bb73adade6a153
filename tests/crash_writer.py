"""Helper process for the crash test: writes to a store until killed, printing what was acknowledged.

``python -m tests.crash_writer DATA_DIR SEED {local,hashing} PROTOCOL_FILE``. Writes ``READY`` to the
protocol file once the store is open,
then loops: concurrent batched adds (``ADDED id user``), and now and then an edit (``UPDATED id``), a
delete (``DELETING id`` / ``DELETED id``) or a forget of one user (``FORGETTING user`` / ``FORGOTTEN
user``). A line is printed only after the store call returned, so every printed ``ADDED``, ``DELETED``
and ``FORGOTTEN`` is a promise the store must keep after a SIGKILL.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import sys
from pathlib import Path

from proxy.memory.embedders.protocol import Embedder
from proxy.memory.store.memory_store import MemoryStore, StoreSettings
from proxy.memory.store.records import Kind, MemoryRecord
from tests.support.embedder import HashingEmbedder

USERS = ("crash-alice", "crash-bob", "crash-forget")
WORDS = ("apple", "river", "morning", "train", "coffee", "garden", "letter", "music", "window", "doctor")


_protocol: list[int] = []


def say(line: str) -> None:
    """One protocol line, written whole with one system call (a kill never leaves half of it)."""
    os.write(_protocol[0], (line + "\n").encode())


def make_embedder(kind: str) -> Embedder:
    """The local model if asked for, else the deterministic test embedder."""
    if kind == "local":
        from proxy.memory.embedders.factory import build_embedder
        from proxy.memory.embedders.settings import EmbedderSettings

        return build_embedder(EmbedderSettings(threads=1))
    return HashingEmbedder()


def text_for(rng: random.Random, record_id: str) -> str:
    """A sentence with a token unique to the record, for the keyword check after the crash."""
    words = " ".join(rng.choice(WORDS) for _ in range(6))
    return f"{words} tok{record_id.replace('-', '')}"


class Writer:
    """The write loop of one process."""

    def __init__(self, store: MemoryStore, seed: int) -> None:
        self.store = store
        self.seed = seed
        self.rng = random.Random(seed)
        self.acked: list[MemoryRecord] = []
        self.round = 0

    async def add_round(self) -> None:
        batches = []
        for b in range(self.rng.randint(1, 4)):
            user = self.rng.choice(USERS)
            ids = [f"s{self.seed}-r{self.round}-b{b}-{i}" for i in range(self.rng.randint(1, 8))]
            batches.append([MemoryRecord(user_id=user, kind=Kind.TURN, text=text_for(self.rng, i), id=i) for i in ids])
        results = await asyncio.gather(*(self.store.add(batch) for batch in batches))
        for records in results:
            for record in records:
                say(f"ADDED {record.id} {record.user_id}")
                self.acked.append(record)

    async def change_round(self) -> None:
        if not self.acked:
            return
        record = self.rng.choice(self.acked)
        roll = self.rng.random()
        if roll < 0.4:
            say(f"DELETING {record.id}")
            await self.store.delete(record.user_id, record.id)
            say(f"DELETED {record.id}")
            self.acked.remove(record)
        elif roll < 0.8:
            new_id = f"{record.id}-edit{self.round}"
            await self.store.update(record.user_id, record.id, text=text_for(self.rng, new_id), valid=roll < 0.6)
            say(f"UPDATED {record.id}")
        else:
            say(f"FORGETTING {USERS[2]}")
            await self.store.forget_user(USERS[2])
            say(f"FORGOTTEN {USERS[2]}")
            self.acked = [r for r in self.acked if r.user_id != USERS[2]]

    async def run(self) -> None:
        while True:
            self.round += 1
            await self.add_round()
            if self.rng.random() < 0.6:
                await self.change_round()


async def main(path: Path, seed: int, kind: str) -> None:
    """Open the store and write until killed."""
    settings = StoreSettings(path=path, flush_interval_ms=5, optimize_interval_s=1.5)
    embedder = make_embedder(kind)
    async with contextlib.AsyncExitStack() as stack:
        if isinstance(embedder, contextlib.AbstractAsyncContextManager):
            await stack.enter_async_context(embedder)  # load the model before saying READY
        store = await stack.enter_async_context(MemoryStore(settings, embedder))
        say("READY")
        await Writer(store, seed).run()


if __name__ == "__main__":
    _protocol.append(os.open(sys.argv[4], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644))
    asyncio.run(main(Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]))
