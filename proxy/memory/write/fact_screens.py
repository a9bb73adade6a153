"""The screens on extracted facts, enforced in code: what the model found that must not be stored.

A wrong memory is worse than none: it is repeated in every later chat. So the model's answer is never trusted
alone. After extraction, code drops

- facts that read as instructions to a model (the poisoning screen: "ignore previous instructions", "you
  must", role or tool-call syntax, "system prompt"...), always, even when the user asked to remember them;
- sensitive facts (health, religion, politics, sexual orientation, ethnicity, criminal record, union
  membership, identifiers: the model's flag, backed by the keyword screen of ``screens``) and facts holding
  identifiers found by patterns (Luhn-valid card numbers, IBANs, SSN-like ids, account numbers, credentials)
  or a redaction marker, unless the user explicitly asked to remember them in their own words;
- facts whose named entities occur only in the assistant's reply (the assistant's claims, not the user's).

Every dropped fact is logged as ``memory.rejected`` with the reason (never the text).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

from proxy.memory.write.extraction import ExtractedFact, ExtractionSettings, normalise
from proxy.memory.write.identifiers import REDACTION_MARK, identifier_reason
from proxy.memory.write.instructions import injection_reason
from proxy.memory.write.prompts import ExchangeText
from proxy.memory.write.screens import asked_to_remember
from proxy.memory.write.sensitive import sensitive_category

_I = re.IGNORECASE

_REMEMBER_CLAUSE = re.compile(
    r"\b(?:remember|memori[sz]e|keep\s+in\s+mind|(?:don'?t|do\s+not)\s+forget|note\s+(?:down\s+)?)"
    r"\s*(?:that\s+|this\s*:?\s*|:\s*)?(?P<clause>[^.!?\n]{3,300})",
    _I,
)


def remember_fallback(user_messages: Sequence[str]) -> ExtractedFact | None:
    """A fact for an explicit "remember that ..." the model missed, so that such a request is never lost."""
    for text in user_messages:
        if not asked_to_remember(text):
            continue
        match = _REMEMBER_CLAUSE.search(text)
        if match is not None:
            clause = match.group("clause").strip().rstrip(",;:")
            return ExtractedFact(
                text=f'The user asked to remember: "{clause}"', category="other", importance=8,
                sensitive=False, sensitive_category="none", explicit_request=True,
            )  # fmt: skip
    return None


def sensitive_reason(fact: ExtractedFact, settings: ExtractionSettings) -> str | None:
    """Why a fact counts as sensitive under ``settings`` (model flag or identifier patterns), or None."""
    category = fact.sensitive_category
    if category == "none" and fact.sensitive:
        category = "unspecified"
    if category == "none":  # the code-side screen backs the model's own flag
        category = sensitive_category(" ".join([fact.text, *fact.entities])) or "none"
    if category in settings.blocked_sensitive:
        return f"sensitive:{category}"
    found = identifier_reason(" ".join([fact.text, *fact.entities]), settings.extra_sensitive_patterns)
    if found is not None and ("identifier" in settings.blocked_sensitive or found == "configured_pattern"):
        return f"sensitive:identifier:{found}"
    return None


def ungrounded(fact: ExtractedFact, exchange: ExchangeText) -> bool:
    """True when the fact names things only the assistant mentioned (an assistant claim, not the user's)."""
    names = [name.lower() for name in fact.entities if len(name.strip()) >= 3 and name.lower() != "user"]
    if not names:
        return False
    user_text, reply = exchange.user_text.lower(), exchange.reply.lower()
    return not any(name in user_text for name in names) and any(name in reply for name in names)


@dataclasses.dataclass(frozen=True)
class Screened:
    """A fact that passed the screens, with whether the user asked for it explicitly."""

    fact: ExtractedFact
    explicit: bool


def screen_fact(fact: ExtractedFact, exchange: ExchangeText, settings: ExtractionSettings) -> Screened | str:
    """The fact if it may be stored, else the reason it may not (poisoning, sensitive, ungrounded, length)."""
    reason = injection_reason(" ".join([fact.text, *fact.entities]), settings.extra_injection_patterns)
    if reason is not None:
        return f"instruction_like:{reason}"
    if len(fact.text) > settings.max_fact_chars:
        return "too_long"
    if REDACTION_MARK in fact.text:  # learned from a redacted turn: the secret is gone, the fact is empty
        return "sensitive:identifier:redacted"
    explicit = fact.explicit_request and asked_to_remember(exchange.user_text)
    if not explicit and ungrounded(fact, exchange):
        return "not_said_by_user"
    if not explicit:
        sensitive = sensitive_reason(fact, settings)
        if sensitive is not None:
            return sensitive
    return Screened(fact, explicit)


def screen_facts(
    facts: Sequence[ExtractedFact], exchange: ExchangeText, settings: ExtractionSettings
) -> tuple[list[Screened], list[str]]:
    """Split facts into those that may be stored and the reasons the others may not (in order)."""
    if not any(f.explicit_request for f in facts):
        fallback = remember_fallback(exchange.user_messages)
        facts = [fallback, *facts] if fallback is not None else facts
    kept: list[Screened] = []
    reasons: list[str] = []
    seen: set[str] = set()
    for fact in facts[: settings.max_facts]:
        outcome = screen_fact(fact, exchange, settings)
        key = normalise(fact.text)
        if isinstance(outcome, str):
            reasons.append(outcome)
        elif key not in seen:
            seen.add(key)
            kept.append(outcome)
    return kept, reasons
