"""A SIGKILL at any moment of a write leaves every record in both arms or in neither, after restart.

A child process (``tests/crash_writer.py``) writes batches, edits, deletes and forgets, and is killed
with SIGKILL at a random moment, several times over the same data directory. After each kill the store
is reopened (running its startup repair) and checked against what the child had acknowledged.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from proxy.memory.embedders.protocol import Embedder
from proxy.memory.store.memory_store import MemoryStore, StoreSettings
from tests.crash_writer import make_embedder

ROOT = Path(__file__).resolve().parents[1]
ITERATIONS = 4


def embedder_kind() -> str:
    """The shipped local model when its files are present (as in ``make test``), else the test embedder."""
    try:
        from proxy.memory.embedders.model_files import resolve_model_dir

        resolve_model_dir(None)
    except Exception:  # no model files: the hashing embedder exercises the same store code
        return "hashing"
    return "local"


@dataclass
class Ledger:
    """What the killed writers promised: records that must exist and records that must not."""

    present: dict[str, str] = field(default_factory=dict)  # id -> user
    gone: set[str] = field(default_factory=set)
    in_doubt: dict[str, str] = field(default_factory=dict)

    def read(self, lines: list[str]) -> None:
        forgetting: dict[str, str] = {}
        for line in lines:
            verb, _, rest = line.partition(" ")
            if verb == "ADDED":
                record_id, user = rest.split(" ", 1)
                self.present[record_id] = user
            elif verb == "DELETING":
                self.in_doubt[rest] = self.present.pop(rest)
            elif verb == "DELETED":
                self.in_doubt.pop(rest)
                self.gone.add(rest)
            elif verb == "FORGETTING":
                forgetting = {i: u for i, u in {**self.present, **self.in_doubt}.items() if u == rest}
                for record_id in forgetting:
                    self.present.pop(record_id, None)
                    self.in_doubt[record_id] = rest
            elif verb == "FORGOTTEN":
                for record_id in forgetting:
                    self.in_doubt.pop(record_id)
                    self.gone.add(record_id)

    def settle(self, stored: set[str]) -> None:
        """Records in doubt are now known to be stored or not."""
        for record_id, user in self.in_doubt.items():
            if record_id in stored:
                self.present[record_id] = user
            else:
                self.gone.add(record_id)
        self.in_doubt.clear()


def run_and_kill(path: Path, seed: int, kind: str, logs: Path) -> list[str]:
    """Start a writer, let it write for a random while, SIGKILL it; the complete protocol lines."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    protocol = logs / f"protocol-{seed}.txt"
    protocol.touch()
    args = [sys.executable, "-m", "tests.crash_writer", str(path), str(seed), kind, str(protocol)]
    with (logs / f"output-{seed}.log").open("wb") as out:
        child = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        deadline = time.monotonic() + 120
        while b"ADDED" not in protocol.read_bytes():  # kill mid-stream, not while it is still starting
            assert child.poll() is None, f"writer exited early with {child.returncode}"
            assert time.monotonic() < deadline, "writer never wrote anything"
            time.sleep(0.02)
        time.sleep(random.Random(seed).uniform(0.0, 2.0))
        child.send_signal(signal.SIGKILL)
        child.wait()
    text = protocol.read_text()
    return text[: text.rfind("\n") + 1].splitlines()


async def stored_records(store: MemoryStore) -> dict[str, tuple[str, str, bool]]:
    """Every record in LanceDB: id -> (user, text, valid)."""
    out: dict[str, tuple[str, str, bool]] = {}
    for user in await store.user_ids():
        page = await store.list(user, limit=1_000_000, include_invalid=True)
        out.update({r.id: (r.user_id, r.text, r.valid) for r in page.data})
    return out


async def check(store: MemoryStore, ledger: Ledger, embedder: Embedder) -> int:
    """Both arms agree with LanceDB, acknowledged writes are there and deleted records are not."""
    stored = await stored_records(store)
    assert set(ledger.present) <= set(stored), "an acknowledged record was lost"
    assert not ledger.gone & set(stored), "a deleted record came back"
    indexed = await store._keyword.signatures()
    assert set(indexed) == set(stored), "the keyword index disagrees with LanceDB"
    for record_id, (user, text, _) in stored.items():
        token = text.rsplit(" ", 1)[1]
        hits = await store.keyword_search(user, token, 3, include_invalid=True)
        assert record_id in [h.record.id for h in hits], f"{record_id} not found by its keyword"
    for record_id, (user, text, _) in random.Random(len(stored)).sample(sorted(stored.items()), min(20, len(stored))):
        hits = await store.vector_search(user, await embedder.embed_query(text), 5, include_invalid=True)
        assert record_id in [h.record.id for h in hits], f"{record_id} not found by its vector"
    ledger.settle(set(stored))
    return len(stored)


@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_sigkill_at_random_moments_keeps_both_arms_consistent(tmp_path: Path) -> None:
    """Four writers killed mid-write: each time, reopening yields a store whose two arms match LanceDB."""
    kind = embedder_kind()
    path, ledger = tmp_path / "data", Ledger()
    embedder = make_embedder(kind)
    sizes = []
    for iteration in range(ITERATIONS):
        lines = run_and_kill(path, iteration, kind, tmp_path)
        ledger.read(lines)
        async with MemoryStore(StoreSettings(path=path), embedder) as store:
            sizes.append(await check(store, ledger, embedder))
    if hasattr(embedder, "aclose"):
        await embedder.aclose()
    assert sizes[-1] > 0
    assert len(ledger.present) > 0
