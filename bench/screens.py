"""What the screens on stored text catch and cost (``make bench-screens``): labelled secrets and instruction-like
plants, LoCoMo's turns, hostile 100 kB inputs.

Prints and writes ``bench/results/screens.json``:

- ``secrets``: recall over ``bench.screen_cases.SECRETS`` (a case counts when no piece of its secret is left
  after ``redact_identifiers``; goal >= 0.95), whether redacting again changes nothing (idempotent), the misses;
- ``instructions``: recall over ``INSTRUCTIONS`` (flagged by ``injection_reason``, so never injected), the misses;
- ``locomo``: for the 5,882 turns, how many would be redacted (false positives: goal 0), flagged (goal 0) and
  marked sensitive, with the kinds and rules that fired and the turns themselves;
- ``cost``: mean CPU time of ``screen_text`` (worker) and ``redact_identifiers`` (request path) per turn, over
  16,000 characters (the stored-turn cap), and over texts crafted to make regexes backtrack.

``.venv/bin/python bench/screens.py [--data locomo10.json]``.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.locomo import DATA
from bench.screen_cases import INSTRUCTIONS, SECRETS
from proxy.memory.write.identifiers import redact_identifiers
from proxy.memory.write.instructions import injection_reason
from proxy.memory.write.screens import screen_text

RESULTS = Path(__file__).resolve().parent / "results" / "screens.json"

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


def secret_left(text: str, secret: str) -> list[str]:
    """The pieces of ``secret`` (split on spaces, 3+ characters) still in ``text``."""
    return [piece for piece in secret.split() if len(piece) >= 3 and piece in text]


def secrets_report() -> dict[str, Any]:
    """Recall and idempotence of the identifier screen over the labelled secrets."""
    misses, unstable = [], []
    for text, secret in SECRETS:
        once = redact_identifiers(text)[0]
        if secret_left(once, secret):
            misses.append({"text": text, "redacted": once})
        if redact_identifiers(once)[0] != once:
            unstable.append(once)
    recall = 1 - len(misses) / len(SECRETS)
    return {"cases": len(SECRETS), "recall": round(recall, 4), "idempotent": not unstable, "misses": misses,
            "not_idempotent": unstable}  # fmt: skip


def instructions_report() -> dict[str, Any]:
    """Recall of the instruction screen over the labelled plants (each flagged: never injected)."""
    reasons = {text: injection_reason(text) for text in INSTRUCTIONS}
    misses = [text for text, reason in reasons.items() if reason is None]
    return {"cases": len(INSTRUCTIONS), "recall": round(1 - len(misses) / len(INSTRUCTIONS), 4), "misses": misses,
            "rules": dict(collections.Counter(r for r in reasons.values() if r is not None))}  # fmt: skip


def locomo_report(texts: list[str]) -> dict[str, Any]:
    """What the screens would do to LoCoMo's turns (ordinary chat: every redaction or flag is a false positive)."""
    kinds: collections.Counter[str] = collections.Counter()
    rules: collections.Counter[str] = collections.Counter()
    redacted, flagged, sensitive = [], [], 0
    for text in texts:
        screened = screen_text(text)
        if screened.redacted:
            redacted.append(screened.text)
            kinds.update(screened.redacted)
        if screened.flagged is not None:
            flagged.append(text)
            rules[screened.flagged] += 1
        sensitive += screened.sensitive is not None
    return {"turns": len(texts), "redacted": len(redacted), "flagged": len(flagged), "sensitive": sensitive,
            "redacted_kinds": dict(kinds), "flagged_rules": dict(rules), "redacted_turns": redacted[:50],
            "flagged_turns": flagged[:50]}  # fmt: skip


def cost_report(texts: list[str]) -> dict[str, Any]:
    """CPU per turn, per capped turn and per hostile input."""
    capped = " ".join(texts)[:16_000]
    return {
        "screen_text_us_per_turn": round(per_item_us(screen_text, texts), 1),
        "redact_identifiers_us_per_turn": round(per_item_us(redact_identifiers, texts), 1),
        "screen_text_ms_16k": round(per_item_us(screen_text, [capped]) / 1000, 2),
        "redact_identifiers_ms_16k": round(per_item_us(redact_identifiers, [capped]) / 1000, 2),
        "hostile_ms": {name: round(per_item_us(screen_text, [text]) / 1000, 1) for text, name in HOSTILE.items()},
    }


def main() -> None:
    """Measure, print the tables and write ``bench/results/screens.json``."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--data", type=Path, default=DATA)
    texts = turns(parser.parse_args().data)
    report = {"secrets": secrets_report(), "instructions": instructions_report(), "locomo": locomo_report(texts),
              "cost": cost_report(texts)}  # fmt: skip
    RESULTS.write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n")
    sec, ins, loc, cost = report["secrets"], report["instructions"], report["locomo"], report["cost"]
    print(f"{'labelled set':14} {'cases':>6} {'recall':>7} {'goal':>6}")
    print(f"{'secrets':14} {sec['cases']:6d} {sec['recall']:7.3f} {0.95:6.2f}   idempotent: {sec['idempotent']}")
    print(f"{'instructions':14} {ins['cases']:6d} {ins['recall']:7.3f} {0.95:6.2f}")
    for miss in sec["misses"]:
        print(f"  secret missed: {miss['redacted'][:100]!r}")
    for miss in ins["misses"]:
        print(f"  plant missed: {miss[:100]!r}")
    print(
        f"LoCoMo turns: {loc['turns']}; false positives: redacted {loc['redacted']} {loc['redacted_kinds']}, "
        f"flagged {loc['flagged']} {loc['flagged_rules']} (goal 0 each); marked sensitive {loc['sensitive']}"
    )
    print(
        f"screen_text {cost['screen_text_us_per_turn']} us/turn, redact_identifiers "
        f"{cost['redact_identifiers_us_per_turn']} us/turn; 16,000 chars: {cost['screen_text_ms_16k']} ms, "
        f"{cost['redact_identifiers_ms_16k']} ms"
    )
    print(f"{'hostile input':24} {'chars':>8} {'ms':>8}")
    for text, name in HOSTILE.items():
        print(f"{name:24} {len(text):8d} {cost['hostile_ms'][name]:8.1f}")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
