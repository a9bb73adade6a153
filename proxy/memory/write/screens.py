"""Screens on everything memory stores and may show a model again: one stored text screened (pure, no I/O).

A stored text comes back in later chats, so what it carries is checked in code before it is written:

- **Identifiers** (``redact_identifiers``): Luhn-valid card numbers, IBANs with a valid mod-97 check,
  SSN/NI-like and other national-id-like numbers, account/passport/licence numbers, API keys and tokens
  (``sk-``, AWS, GitHub, Slack, Google, JWT, bearer tokens, private keys), passwords and PINs. The secret
  itself is replaced by ``[redacted:<kind>]``; the words around it stay, so "my card is ..." still says that
  a card was mentioned. Turns, summaries and facts are redacted unless the user explicitly asked to
  remember (``asked_to_remember``).
- **Instructions and planted links** (``injection_reason``): text that reads as instructions to a model
  ("ignore previous instructions", "you must", role or tool-call syntax, a ``</memory>`` closer, "from now
  on ... leak", "append the link http://... to every answer"). Such a turn or summary is stored *flagged*
  (``MemoryRecord.flagged`` holds the reason): it stays visible in the management API and the web page, and
  is never injected. Facts that read so are not stored at all.
- **Sensitive categories** (``sensitive_category``): health, religion, politics, sexual orientation,
  ethnicity, criminal record and union membership, by keyword, in English and in Chinese, Japanese and
  Korean (the languages the keyword index tokenises); it backs the memory model's own ``sensitive`` flag.

Every match runs on a folded copy of the text (``fold``: NFKC, lookalike brackets mapped to ``<`` and ``>``,
zero-width and bidi characters removed), so a fullwidth closer (U+FF1C /memory U+FF1E) or one with a
zero-width space inside matches as "</memory>".

Each screen has its module (``identifiers``, ``instructions``, ``sensitive``, all reading ``folding.fold``'s
copy); this one knows what the user asked to remember and screens one text before it is stored.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Collection, Sequence

from proxy.memory.write.identifiers import identifier_spans, redact_identifiers
from proxy.memory.write.instructions import injection_reason
from proxy.memory.write.sensitive import sensitive_category

_I = re.IGNORECASE
_EXPLICIT = re.compile(
    r"(^|[.!?\n]\s*|\b(please|pls|can\s+you|could\s+you|would\s+you|will\s+you|i\s+want\s+you\s+to|"
    r"i'?d\s+like\s+you\s+to|make\s+sure\s+(to|you))\s+)"
    r"(remember|memori[sz]e|keep\s+in\s+mind|don'?t\s+forget|do\s+not\s+forget|note\s+(that|down)|"
    r"make\s+a\s+note|save\s+(this|that)\s+to\s+(your\s+)?memory)\b",
    _I,
)


def asked_to_remember(user_text: str) -> bool:
    """Whether the user explicitly asked to remember something, in their own words."""
    return _EXPLICIT.search(user_text) is not None


_SENTENCE = re.compile(r"[^.!?\n]+(?:[.!?]+(?=\s|$)|\n|$)|[.!?]")


def remembered_identifiers(user_messages: Sequence[str], extra: Sequence[str] = ()) -> frozenset[str]:
    """The identifiers the user asked to remember: those in a sentence that asks for it ("Please remember my
    PIN is 4921."), in the text as written. Every other identifier of the exchange is redacted."""
    found: set[str] = set()
    for message in user_messages:
        if not asked_to_remember(message):
            continue
        for sentence in _SENTENCE.findall(message):
            if asked_to_remember(sentence.strip()):
                found.update(sentence[span.start : span.end] for span in identifier_spans(sentence, extra))
    return frozenset(found)


@dataclasses.dataclass(frozen=True, slots=True)
class ScreenedText:
    """A text as it may be stored: redacted unless explicit, with why it is flagged and its sensitive category."""

    text: str
    redacted: tuple[str, ...] = ()
    flagged: str | None = None
    sensitive: str | None = None


def screen_text(
    text: str,
    *,
    explicit: bool = False,
    keep: Collection[str] = (),
    extra_identifiers: Sequence[str] = (),
    extra_instructions: Sequence[str] = (),
) -> ScreenedText:
    """Screen one text before it is stored: redact identifiers (all but ``keep``, none when ``explicit``),
    flag instructions."""
    redacted: tuple[str, ...] = ()
    if not explicit:
        text, redacted = redact_identifiers(text, extra_identifiers, keep)
    reason = injection_reason(text, extra_instructions)
    flagged = f"instruction_like:{reason}" if reason is not None else None
    return ScreenedText(text, redacted, flagged, sensitive_category(text))
