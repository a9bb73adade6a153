"""The retrieval query of a chat request, and the word terms every read-path step shares.

The query is the latest user message; when that message is short or leans on what came before
("and her?", "what about that one"), the previous user turn is put in front of it so the arms have
something to match. ``terms`` is the one tokeniser of the read path (keyword gating, entity names,
excerpts): lowercase word tokens with a small English stop list, CJK runs as overlapping bigrams like the
store's CJK field.

One analysis of words, the keyword index's own: ``words`` is Tantivy's ``simple`` tokenizer with long tokens
removed and lowercasing (the index's ``text`` field), and ``stem`` is Tantivy's English Snowball stemmer (the
index's ``text_stem`` field: "running" -> "run", "studied" -> "studi"), both run by Tantivy itself, so that
what the read path calls a word or a stem is exactly what BM25 matched.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import date
from typing import Any

from tantivy import Filter, TextAnalyzerBuilder, Tokenizer

from proxy.memory.text_cap import MAX_QUERY_CHARS, cap_text

MAX_TOKEN_CHARS = 40  # as the keyword index: longer tokens are dropped
_CASED_WORDS = TextAnalyzerBuilder(Tokenizer.simple()).filter(Filter.remove_long(MAX_TOKEN_CHARS)).build()
_WORDS = (
    TextAnalyzerBuilder(Tokenizer.simple()).filter(Filter.remove_long(MAX_TOKEN_CHARS)).filter(Filter.lowercase())
).build()
_STEMMER = TextAnalyzerBuilder(Tokenizer.simple()).filter(Filter.stemmer("english")).build()
_CJK = re.compile(r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff]")
_CJK_RUN = re.compile(r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff]+")

STOPWORDS = frozenset(
    """a about above after again against all also am an and any are as at be because been before being
    below between both but by can could did do does doing down during each few for from further had has
    have having he her here hers herself him himself his how i if in into is it its itself just let me
    more most my myself no nor not now of off on once only or other our ours ourselves out over own same
    she should so some such than that the their theirs them themselves then there these they this those
    through to too under until up very was we were what when where which while who whom why will with
    would you your yours yourself yourselves s t d ll m re ve don didn doesn isn wasn weren won wouldn
    ok okay yes yeah hey hi hello please thanks thank tell know think said say get got one""".split()  # noqa: SIM905 - a word list reads best as text
)

# Words that make a message lean on the previous turn.
_ANAPHORIC = frozenset(
    "he she him her his hers they them their it its that this those these there one ones".split()  # noqa: SIM905
)
_CONTINUATIONS = ("and ", "but ", "also ", "what about", "how about", "so ", "then ", "or ")


@dataclass(frozen=True, slots=True)
class Query:
    """What the read path searches with: the text, its content terms, and whether it was expanded."""

    text: str
    latest: str
    terms: tuple[str, ...]
    expanded: bool


def message_text(message: Mapping[str, Any]) -> str:
    """The text of one chat message: a string content, or its text parts joined by newlines."""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [p.get("text") for p in content if isinstance(p, Mapping) and p.get("type") == "text"]
        return "\n".join(p for p in parts if isinstance(p, str))
    return ""


def user_texts(messages: Sequence[Mapping[str, Any]]) -> list[str]:
    """The non-empty texts of the user messages, oldest first."""
    texts = (message_text(m) for m in messages if isinstance(m, Mapping) and m.get("role") == "user")
    return [t for t in texts if t.strip()]


def has_cjk(text: str) -> bool:
    """Whether ``text`` holds Chinese, Japanese or Korean characters."""
    return _CJK.search(text) is not None


def words(text: str) -> list[str]:
    """Lowercase word tokens (no stop list, no bigrams), as the keyword index's ``text`` field sees them."""
    return list(_WORDS.analyze(text))


def cased_words(text: str) -> list[str]:
    """The same tokens as ``words`` with their case kept (to tell names written with a capital)."""
    return list(_CASED_WORDS.analyze(text))


@functools.lru_cache(maxsize=65_536)  # a vocabulary is small; every request stems the same words again
def stem(word: str) -> str:
    """The index's Snowball (Porter2) English stem of one lowercase word ("hiking", "hikes", "hike" -> "hike")."""
    return "".join(_STEMMER.analyze(word)) or word


def _cjk_bigrams(run: str) -> list[str]:
    """Overlapping character bigrams of a CJK run (the run itself when it is one character)."""
    if len(run) == 1:
        return [run]
    return [run[i : i + 2] for i in range(len(run) - 1)]


def terms(text: str, *, drop_stopwords: bool = True) -> tuple[str, ...]:
    """Distinct content terms of ``text`` in order of first appearance."""
    out: dict[str, None] = {}
    for token in words(text):
        if has_cjk(token):
            for run in _CJK_RUN.findall(token):
                out.update(dict.fromkeys(_cjk_bigrams(run)))
            rest = _CJK_RUN.sub(" ", token).split()
            out.update(dict.fromkeys(t for t in rest if not drop_stopwords or t not in STOPWORDS))
        elif not drop_stopwords or token not in STOPWORDS:
            out[token] = None
    return tuple(out)


def stems(text: str) -> frozenset[str]:
    """The stemmed terms of ``text`` (stop words kept), for "does this text hold that term" checks."""
    return frozenset(stem(t) for t in terms(text, drop_stopwords=False))


def is_anaphoric(text: str, short_words: int) -> bool:
    """Whether a message is short or leans on an earlier turn ("and her?", "what about that one")."""
    tokens = words(text)
    lowered = text.strip().lower()
    if len(tokens) <= short_words or lowered.startswith(_CONTINUATIONS):
        return True
    content = [t for t in tokens if t not in STOPWORDS]
    return len(content) <= 2 and any(t in _ANAPHORIC for t in tokens)


def build_query(messages: Sequence[Mapping[str, Any]], *, short_words: int = 4, expand: bool = True) -> Query | None:
    """The query of a chat request, or None when it has no user text to search with."""
    texts = user_texts(messages)
    if not texts:
        return None
    latest = cap_text(texts[-1], MAX_QUERY_CHARS).strip()  # a huge message costs a bounded search
    expanded = expand and len(texts) > 1 and is_anaphoric(latest, short_words)
    text = f"{cap_text(texts[-2], MAX_QUERY_CHARS).strip()}\n{latest}" if expanded else latest
    return Query(text=text, latest=latest, terms=terms(text), expanded=expanded)


_MONTHS = {
    name: number
    for number, names in enumerate(
        [
            ("january", "jan"),
            ("february", "feb"),
            ("march", "mar"),
            ("april", "apr"),
            ("may",),
            ("june", "jun"),
            ("july", "jul"),
            ("august", "aug"),
            ("september", "sep", "sept"),
            ("october", "oct"),
            ("november", "nov"),
            ("december", "dec"),
        ],
        start=1,
    )
    for name in names
}
_DATE = re.compile(
    r"\b(?:(?P<month>[A-Za-z]{3,9})\.?(?:\s+\d{1,2}(?:st|nd|rd|th)?,?)?(?:\s+(?P<year1>(?:19|20)\d\d))?"
    r"|(?P<year2>(?:19|20)\d\d))\b"
)


def _month(word: str | None, has_year: bool) -> int | None:
    """The month a word names; ambiguous forms ("may", "mar", "march") only when capitalised or dated."""
    if word is None:
        return None
    number = _MONTHS.get(word.lower())
    if number is None:
        return None
    if has_year:
        return number
    if word.lower() == "may":  # "May I ask..." starts many sentences: the month needs its year
        return None
    full_and_unambiguous = len(word) > 3 and word.lower() != "march"
    return number if full_and_unambiguous or word[0].isupper() else None


def query_dates(text: str) -> list[tuple[int | None, int | None]]:
    """(year, month) pairs the text names ("May 2023", "in 2022", "last August"); None where unnamed."""
    found: dict[tuple[int | None, int | None], None] = {}
    for match in _DATE.finditer(text):
        year_text = match.group("year1") or match.group("year2")
        year = int(year_text) if year_text else None
        month = _month(match.group("month"), year is not None)
        if year is not None or month is not None:
            found[(year, month)] = None
    return list(found)


_DAY = r"(?P<day>\d{1,2})(?:st|nd|rd|th)?"
_YEAR = r"(?P<year>(?:19|20)\d\d)"
_DAY_FIRST = re.compile(rf"\b{_DAY}\s+(?:of\s+)?(?P<month>[A-Za-z]{{3,9}})\.?,?\s+{_YEAR}\b")
_MONTH_FIRST = re.compile(rf"\b(?P<month>[A-Za-z]{{3,9}})\.?\s+{_DAY},?\s+{_YEAR}\b")
_ISO_DAY = re.compile(r"\b(?P<year>(?:19|20)\d\d)-(?P<month>\d\d)-(?P<day>\d\d)\b")


def _day(year: str, month: int | None, day: str) -> date | None:
    """The calendar day, or None when the parts do not make one."""
    try:
        return date(int(year), month, int(day)) if month is not None else None
    except ValueError:
        return None


def query_days(text: str) -> list[date]:
    """Whole days the text names ("October 13, 2023", "13 May 2023", "2023-05-13"), in order, distinct."""
    found: dict[date, None] = {}
    for pattern in (_DAY_FIRST, _MONTH_FIRST):
        for match in pattern.finditer(text):
            day = _day(match.group("year"), _MONTHS.get(match.group("month").lower()), match.group("day"))
            found.update({day: None} if day is not None else {})
    for match in _ISO_DAY.finditer(text):
        day = _day(match.group("year"), int(match.group("month")), match.group("day"))
        found.update({day: None} if day is not None else {})
    return sorted(found)
