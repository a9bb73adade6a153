"""What the screens on stored text cost and catch, on LoCoMo's turns and on hostile 100 kB inputs.

Prints, for the 5,882 LoCoMo turns: how many would be flagged (instruction-like), redacted (identifiers) and
marked sensitive, the mean CPU time of ``screen_text`` (worker) and ``redact_identifiers`` (request path) per
turn; then the time for texts crafted to make regexes backtrack and for 16,000 characters (the stored-turn
cap). ``.venv/bin/python bench/screens.py [--data locomo10.json]``.
"""

from __future__ import annotations

import argparse
import collections
import json
import time
from pathlib import Path

from bench.locomo import DATA
from proxy.memory.write.identifiers import redact_identifiers
from proxy.memory.write.screens import screen_text

HOSTILE = {
    "a-" * 50_000: "'a-' x 50k",
    "1 " * 50_000: "'1 ' x 50k",
    "card " + "1 " * 50_000: "card + digits",
    "from now on " * 10_000: "'from now on' x 10k",
    "<" * 100_000: "'<' x 100k",
    "passport " + "A1" * 50_000: "passport + 'A1' x 50k",
    "我去年确诊了糖尿病。" * 10_000: "CJK health x 10k",
}


def turns(path: Path) -> list[str]:
    """Every turn text of the LoCoMo file."""
    samples = json.loads(path.read_text())
    return [turn["text"] for sample in samples for key, session in sample["conversation"].items()
            if key.startswith("session_") and isinstance(session, list) for turn in session]  # fmt: skip


def per_item_us(fn: object, texts: list[str]) -> float:
    """Mean microseconds of ``fn(text)`` over ``texts``."""
    started = time.perf_counter()
    for text in texts:
        fn(text)  # type: ignore[operator]
    return (time.perf_counter() - started) / len(texts) * 1e6


def main() -> None:
    """Print the tables."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--data", type=Path, default=DATA)
    texts = turns(parser.parse_args().data)
    counts: collections.Counter[str] = collections.Counter()
    for text in texts:
        screened = screen_text(text)
        counts["flagged"] += screened.flagged is not None
        counts["redacted"] += bool(screened.redacted)
        counts["sensitive"] += screened.sensitive is not None
    print(
        f"LoCoMo turns: {len(texts)} (mean {sum(map(len, texts)) / len(texts):.0f} chars); flagged "
        f"{counts['flagged']}, redacted {counts['redacted']}, marked sensitive {counts['sensitive']}"
    )
    print(
        f"screen_text {per_item_us(screen_text, texts):.1f} us/turn, "
        f"redact_identifiers {per_item_us(redact_identifiers, texts):.1f} us/turn"
    )
    capped = " ".join(texts)[:16_000]
    print(
        f"16,000 chars of LoCoMo: screen_text {per_item_us(screen_text, [capped]) / 1000:.1f} ms, "
        f"redact_identifiers {per_item_us(redact_identifiers, [capped]) / 1000:.1f} ms"
    )
    print(f"{'hostile input':24} {'chars':>8} {'ms':>8}")
    for text, name in HOSTILE.items():
        print(f"{name:24} {len(text):8d} {per_item_us(screen_text, [text]) / 1000:8.1f}")


if __name__ == "__main__":
    main()
