"""How many tokens a text costs, estimated without a tokenizer at run time.

The estimate is meant as an upper bound of the common chat tokenizers (cl100k, o200k, DeepSeek's) for every
script: ASCII letter runs cost one token per 6 letters (rounded up), digit runs one per 3, CJK characters
(Han, kana, Hangul) 8 per 5, Cyrillic, Greek and accented Latin letters 3 per 4, letters (and combining
marks) of every other script 5 per 4, every other visible character one (four outside the Basic
Multilingual Plane, e.g. emoji), whitespace nothing. English is over-counted by about a fifth; Chinese,
Korean, Japanese, Arabic, Hindi, Thai, Russian and emoji text stay at or above the real counts
(``tests/test_injection_tokens.py`` checks them against the real tokenizers). The estimate adds up over
whitespace-separated parts, which lets the block's cost be summed from its lines' cached costs.
"""

from __future__ import annotations

import re

CJK_CLASS = "\u1100-\u11ff\u3040-\u30ff\u3130-\u318f\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff"
_EUROPEAN = "\u00c0-\u024f\u0370-\u052f"  # accented Latin, Greek, Cyrillic
_MARKS = (  # combining marks (not word characters to ``re``) and the Indic and Thai blocks, counted as letters
    "\u0300-\u036f\u0483-\u0489\u0591-\u05c7\u0610-\u061a\u064b-\u065f\u0670\u06d6-\u06ed\u0900-\u0dff\u0e31-\u0e4e"
)
_WORD_LETTER = r"(?=[^\W\d_])"  # the next character is a letter (a word character, not a digit or "_")
_LATIN = re.compile(r"[A-Za-z]+")
_DIGITS = re.compile(r"\d+")
_CJK_RUN = re.compile(rf"(?:{_WORD_LETTER}[{CJK_CLASS}])+")
_EUROPEAN_RUN = re.compile(rf"(?:{_WORD_LETTER}[{_EUROPEAN}])+")
_LETTERS = re.compile(rf"(?:[^\W\d_A-Za-z{CJK_CLASS}{_EUROPEAN}]|(?!\d)[{_MARKS}])+")
_OTHER = re.compile(rf"[^\w\s{_MARKS}]|_")
_ASTRAL_OTHER = re.compile(r"[^\w\s\x00-\uffff]")


def estimate_tokens(text: str) -> int:
    """A cheap, tokenizer-free estimate of how many tokens ``text`` costs (see the module docstring).

    Word characters split into ASCII letter runs, digit runs, CJK runs, European letter runs and runs of
    other letters with their combining marks; every other non-space character is one piece (four outside the
    BMP). The classes do not overlap, so each is counted on its own, and the total adds up over
    whitespace-separated parts. An ASCII text can hold only the first two kinds of run and ASCII "others", so it
    skips the other passes (the passes with a lookahead try it at every character, at several times the cost).
    """
    latin = sum((len(run) + 5) // 6 for run in _LATIN.findall(text))
    digits = sum((len(run) + 2) // 3 for run in _DIGITS.findall(text))
    if text.isascii():
        return latin + digits + len(_OTHER.findall(text))
    cjk = sum((8 * len(run) + 4) // 5 for run in _CJK_RUN.findall(text))
    european = sum((3 * len(run) + 3) // 4 for run in _EUROPEAN_RUN.findall(text))
    letters = sum((5 * len(run) + 3) // 4 for run in _LETTERS.findall(text))
    other = len(_OTHER.findall(text)) + 3 * len(_ASTRAL_OTHER.findall(text))
    return latin + digits + cjk + european + letters + other
