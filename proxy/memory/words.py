"""Words as the keyword index sees them: the one tokeniser every path shares (read and write).

``words`` is Tantivy's ``simple`` tokenizer with long tokens removed and lowercasing (the keyword index's ``text``
field), and ``stem`` is Tantivy's English Snowball stemmer (the index's ``text_stem`` field: "running" -> "run",
"studied" -> "studi"), both run by Tantivy itself, so that what the read path calls a word or a stem is exactly
what BM25 matched. ``terms`` adds a small English stop list and turns CJK runs into overlapping bigrams like the
store's CJK field; ``normalise_name`` is how the name index (read path) and subject records (write path) key a
name.
"""

from __future__ import annotations

import functools
import re

from tantivy import Filter, TextAnalyzerBuilder, Tokenizer

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
        if not token.isascii() and has_cjk(token):
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


def normalise_name(name: str) -> str:
    """A name as the name index keys it: lowercase word tokens joined by single spaces."""
    return " ".join(words(name))
