"""The identifier screen: card numbers, IBANs, national ids, account numbers, API keys and credentials.

Luhn-valid card numbers, IBANs with a valid mod-97 check, SSN/NI-like and other national-id-like numbers,
account/passport/licence numbers, private keys, passwords and PINs, and every credential shape of ``secrets``
(cloud and registry tokens, connection strings, secret assignments, Authorization headers, seed phrases, card
security codes, random keys). ``redact_identifiers`` replaces the secret itself by ``[redacted:<kind>]``; the words
around it stay, so "my card is ..." still says that a card was mentioned. Redaction is idempotent: nothing inside
a ``[redacted:...]`` marker is found again. What a user asked to remember is kept, except credentials that only
give access (``NEVER_KEPT``: keys, tokens, connection strings, seed phrases, card security codes).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Collection, Iterator, Sequence

from proxy.memory.write.folding import fold
from proxy.memory.write.secrets import secret_spans

_I = re.IGNORECASE
REDACTION = "[redacted:{kind}]"

REDACTION_MARK = "[redacted:"
_MARKER = re.compile(r"\[redacted:[a-z_]*\]?")
NEVER_KEPT = frozenset({"api_key", "token", "private_key", "connection_string", "secret_assignment", "seed_phrase",
                        "card_security_code", "high_entropy"})  # fmt: skip


_CARD = re.compile(r"(?<![\d-])\d(?:[ -]?\d){12,18}(?![\d-])")

_IBAN = re.compile(r"\b[A-Z]{2}\d{2}(?:[ ]?[A-Z0-9]){11,30}\b", _I)

_CJK_PUNCT = "\u3002\uff0c\u3001\uff01\uff1f"  # ideographic full stop, fullwidth comma, ... question mark

_PUNCT_END = rf"(?=[.,;:!?)\]'\"{_CJK_PUNCT}]*(?:\s|$))"
# Each rule's ``secret`` group (or the whole match) is what gets redacted.
_IDENTIFIER_RULES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("ssn", re.compile(r"\b\d{3}-\d{2}-\d{4}\b")),
    ("national_insurance", re.compile(r"\b[A-CEGHJ-PR-TW-Z]{2}\s?\d{2}\s?\d{2}\s?\d{2}\s?[A-D]\b")),
    (
        "private_key",
        re.compile(
            r"-----BEGIN [A-Z ]*PRIVATE KEY(?: BLOCK)?-----[\s\S]*?(-----END [A-Z ]*PRIVATE KEY(?: BLOCK)?-----|$)"
        ),
    ),
    (
        "credential",
        re.compile(
            r"\b(password|passwd|passcode|passphrase|pass\s*word|pin(\s+(code|number))?|cvv|cvc|security\s+code|"
            r"api[\s_-]?key|secret(\s+key)?|access\s+token|auth\s+token|token|2fa\s+code|otp|mot\s+de\s+passe|"
            r"passwort|contraseña)\s*(is|was|are|:|=)\s*"
            rf"(?P<secret>(?![\"'`\u201c\u2018])\S+?){_PUNCT_END}"  # a quoted value: ``secrets.passwords``
            rf"|(密码|密碼|口令|パスワード|暗証番号|비밀번호)\s*(是|为|は|:|=|는|은)?\s*(?P<cjk>[^\s{_CJK_PUNCT}]+)",
            _I,
        ),
    ),
    ("pin", re.compile(r"\bpin\s*(code|number|#)?\s*(?P<secret>\d{4,8})\b", _I)),
    (
        "account_number",
        re.compile(
            r"\b(account|acct|routing|sort\s+code|passport|licen[cs]e|national\s+id|id\s+number|id\s+card|"
            r"tax\s+id|social\s+security|insurance\s+number|policy\s+number|member(ship)?\s+number|card|"
            r"身份证|マイナンバー|주민등록번호)[^\d\n]{0,25}(?P<secret>\d[\d -]{3,}\d)",
            _I,
        ),
    ),
    (
        "national_id",
        re.compile(
            r"\b(passport|national\s+id|id\s+number|id\s+card|licen[cs]e|tax\s+id)\b[^\n]{0,25}?"
            r"(?P<secret>\b(?=[A-Z0-9]*\d{4})[A-Z]{1,3}\d[A-Z0-9]{4,}\b)",
            _I,
        ),
    ),
)


# Cheap prefilters: a rule can only match text (lower-cased) holding one of its needles.
_NEEDLES: dict[str, tuple[str, ...]] = {
    "private_key": ("-----begin",),
    "credential": ("pass", "pin", "cvv", "cvc", "security", "api", "secret", "token", "2fa", "otp", "mot de",
                   "contrase", "密码", "密碼", "口令", "パスワード", "暗証番号", "비밀번호"),
    "pin": ("pin",),
    "account_number": ("account", "acct", "routing", "sort", "passport", "licen", "national", "id", "tax",
                       "social", "insurance", "policy", "member", "card", "身份证", "マイナンバー", "주민등록번호"),
    "national_id": ("passport", "national", "id", "licen", "tax"),
}  # fmt: skip


def _may_match(name: str, lowered: str) -> bool:
    needles = _NEEDLES.get(name)
    return needles is None or any(needle in lowered for needle in needles)


def luhn_valid(digits: str) -> bool:
    """Whether a digit string passes the Luhn checksum (payment card numbers do)."""
    total = 0
    for i, char in enumerate(reversed(digits)):
        value = int(char)
        if i % 2 == 1:
            value = value * 2 - 9 if value > 4 else value * 2
        total += value
    return len(digits) > 1 and total % 10 == 0


def iban_valid(candidate: str) -> bool:
    """Whether a string is an IBAN with a valid ISO 13616 mod-97 check."""
    text = re.sub(r"\s", "", candidate).upper()
    if not re.fullmatch(r"[A-Z]{2}\d{2}[A-Z0-9]{11,30}", text):
        return False
    rearranged = text[4:] + text[:4]
    return int("".join(str(int(char, 36)) for char in rearranged)) % 97 == 1


@dataclasses.dataclass(frozen=True, slots=True)
class Span:
    """One identifier found in a text: where it is and what kind it is."""

    start: int
    end: int
    kind: str


def _valid_iban_prefix(match: re.Match[str]) -> Span | None:
    """The longest valid IBAN at the start of a match (the pattern may run on into the next word)."""
    text = match.group()
    while len(re.sub(r"\s", "", text)) >= 15:
        if iban_valid(text):
            return Span(match.start(), match.start() + len(text), "iban")
        text = text[:-1].rstrip()
    return None


def _checksum_spans(text: str) -> list[Span]:
    spans = [Span(m.start(), m.end(), "card_number") for m in _CARD.finditer(text)
             if luhn_valid(re.sub(r"\D", "", m.group()))]  # fmt: skip
    ibans = (_valid_iban_prefix(m) for m in _IBAN.finditer(text))
    return spans + [span for span in ibans if span is not None]


_DIGIT = re.compile(r"\d")

_NEEDS_DIGITS = frozenset({"ssn", "national_insurance", "pin", "account_number", "national_id"})


# Keyword rules can only match where one of these (lower case) starts: they are tried at those places only,
# instead of at every position, where a long text made every rule's scan slow.
_ANCHORS: dict[str, tuple[str, ...]] = {
    "credential": ("pass", "pin", "cvv", "cvc", "security", "api", "secret", "access", "auth", "token", "2fa",
                   "otp", "mot", "contrase", "密码", "密碼", "口令", "パスワード", "暗証番号", "비밀번호"),
    "pin": ("pin",),
    "account_number": ("account", "acct", "routing", "sort", "passport", "licen", "national", "id", "tax",
                       "social", "insurance", "policy", "member", "card", "身份证", "マイナンバー", "주민등록번호"),
    "national_id": ("passport", "national", "id", "licen", "tax"),
}  # fmt: skip


def _matches(name: str, pattern: re.Pattern[str], text: str, lowered: str) -> Iterator[re.Match[str]]:
    anchors = _ANCHORS.get(name)
    if anchors is None or len(lowered) != len(text):  # lower() moved indexes (rare letters): scan it all
        yield from pattern.finditer(text)
        return
    for anchor in anchors:
        at = lowered.find(anchor)
        while at != -1:
            match = pattern.match(text, at)
            if match is not None:
                yield match
            at = lowered.find(anchor, at + 1)


def identifier_spans(text: str, extra: Sequence[str] = ()) -> list[Span]:
    """Every identifier in ``text`` (positions in ``text`` itself), without overlaps, in order."""
    digits = _DIGIT.search(text) is not None
    lowered = text.lower()
    # the credential shapes first: for the same span, their kind (api_key, seed_phrase...) is the more specific
    spans = [Span(start, end, kind) for start, end, kind in secret_spans(text)]
    spans += _checksum_spans(text) if digits else []
    for name, pattern in _IDENTIFIER_RULES:
        if (not digits and name in _NEEDS_DIGITS) or not _may_match(name, lowered):
            continue
        for match in _matches(name, pattern, text, lowered):
            group = next((g for g in ("secret", "cjk") if g in pattern.groupindex and match.group(g)), 0)
            spans.append(Span(match.start(group), match.end(group), name))
    for pattern_text in extra:
        spans += [Span(m.start(), m.end(), "configured_pattern") for m in re.finditer(pattern_text, text, _I)]
    spans = [span for span in spans if span.kind != "credential" or not _plain_word(text[span.start : span.end])]
    return _outermost(spans, _markers(text))


# What follows "password is" in talk about a password rather than in one: "the password is on the fridge".
_PLAIN_WORDS = frozenset(
    [
        "on",
        "in",
        "at",
        "the",
        "a",
        "an",
        "my",
        "your",
        "his",
        "her",
        "our",
        "their",
        "its",
        "under",
        "not",
        "still",
        "written",
        "saved",
        "stored",
        "somewhere",
        "here",
        "there",
        "same",
        "easy",
        "hard",
        "too",
        "very",
        "so",
        "also",
        "just",
        "what",
        "that",
        "this",
        "it",
        "inside",
        "behind",
        "taped",
        "expired",
        "wrong",
        "changed",
        "reset",
        "weak",
        "strong",
        "long",
        "short",
        "different",
        "new",
        "old",
        "simple",
    ]
)


def _plain_word(value: str) -> bool:
    return value.lower().rstrip(".,;:!?") in _PLAIN_WORDS


def _markers(text: str) -> list[tuple[int, int]]:
    return [m.span() for m in _MARKER.finditer(text)] if REDACTION_MARK in text else []


def _outermost(spans: list[Span], markers: list[tuple[int, int]]) -> list[Span]:
    """The spans without overlaps (the first and longest wins), none touching a redaction marker."""
    kept: list[Span] = []
    for span in sorted(spans, key=lambda s: (s.start, -s.end)):
        if any(span.start < end and start < span.end for start, end in markers):
            continue
        if span.end > span.start and (not kept or span.start >= kept[-1].end):
            kept.append(span)
    return kept


def identifier_reason(text: str, extra: Sequence[str] = ()) -> str | None:
    """The kind of the first identifier ``text`` holds (card, IBAN, SSN-like, account, credential...), or None."""
    for target in (text, fold(text)):
        spans = identifier_spans(target, extra)
        if spans:
            return spans[0].kind
    return None


def redact_identifiers(text: str, extra: Sequence[str] = (), keep: Collection[str] = ()) -> tuple[str, tuple[str, ...]]:
    """``text`` with every identifier replaced by ``[redacted:<kind>]`` (except those in ``keep``, the ones
    the user asked to remember), and the kinds replaced.

    The original text is searched first; when only its folded form shows an identifier (fullwidth digits,
    zero-width characters inside a number), the folded form is what gets redacted and stored.
    """
    source, spans = text, identifier_spans(text, extra)
    if not spans:
        source = fold(text)
        spans = identifier_spans(source, extra) if source != text else []
    spans = [span for span in spans if span.kind in NEVER_KEPT or source[span.start : span.end] not in keep]
    if not spans:
        return text, ()
    out, last = [], 0
    for span in spans:
        out += [source[last : span.start], REDACTION.format(kind=span.kind)]
        last = span.end
    out.append(source[last:])
    return "".join(out), tuple(dict.fromkeys(span.kind for span in spans))
