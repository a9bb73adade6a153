"""How the screens read a text: NFKC, lookalike brackets and slashes mapped, invisible marks removed.

A fullwidth closer (U+FF1C /memory U+FF1E) or one with a zero-width space inside reads as "</memory>", so
every screen matches on ``fold(text)``. The instruction screen reads further (``unmasked``): HTML entities
unescaped (``&lt;/memory&gt;``), Cyrillic and Greek letters that look Latin mapped to it ("ignore" spelt with a
Cyrillic i),
letters spaced apart joined ("i g n o r e") and runs of spaces collapsed.
"""

from __future__ import annotations

import html
import re
import unicodedata

_INVISIBLE = re.compile("[\u00ad\u034f\u061c\u115f\u1160\u17b4\u17b5\u180e\u200b-\u200f\u202a-\u202e"
                        "\u2060-\u206f\u3164\ufe00-\ufe0f\ufeff\uffa0]")  # fmt: skip

_LOOKALIKES = str.maketrans({
    "\u2039": "<", "\u203a": ">", "\u2329": "<", "\u232a": ">", "\u3008": "<", "\u3009": ">",
    "\u300a": "<", "\u300b": ">", "\u27e8": "<", "\u27e9": ">", "\u02c2": "<", "\u02c3": ">",
    "\u1438": "<", "\u1433": ">", "\u276e": "<", "\u276f": ">", "\u276c": "<", "\u276d": ">",
    "\u00ab": "<", "\u00bb": ">", "\u2264": "<", "\u2265": ">", "\u2215": "/", "\u2044": "/",
    "\u29f8": "/", "\u0338": "/",
})  # fmt: skip


def fold(text: str) -> str:
    """``text`` as the screens read it: NFKC, lookalike brackets and slashes mapped, invisible marks removed."""
    return _INVISIBLE.sub("", unicodedata.normalize("NFKC", text).translate(_LOOKALIKES))


# Cyrillic and Greek letters drawn like Latin ones (Unicode's confusables for the Latin alphabet, these scripts).
_HOMOGLYPHS = str.maketrans(
    "\u0410\u0412\u0415\u041a\u041c\u041d\u041e\u0420\u0421\u0422\u0423\u0425\u0406\u0408\u0405"
    "\u0430\u0435\u043e\u0440\u0441\u0443\u0445\u0456\u0458\u0455\u0501\u051b\u051d\u04bb\u0262"
    "\u0391\u0392\u0395\u0396\u0397\u0399\u039a\u039c\u039d\u039f\u03a1\u03a4\u03a5\u03a7"
    "\u03bf\u03bd\u03b9\u03c1\u0261\u0131",
    "ABEKMHOPCTYXIJSaeopcyxijsdqwhgABEZHIKMNOPTYXovipgi",
)
_SPACED = re.compile(r"(?<!\S)(?:\w[ \t]){3,}\w(?!\S)")
_SPACES = re.compile(r"[ \t\u00a0]+")


def _joined(match: re.Match[str]) -> str:
    return re.sub(r"[ \t]", "", match.group())


def unmasked(text: str) -> str:
    """``fold(text)`` with HTML entities unescaped, look-alike letters mapped to Latin, letters spaced apart
    joined (runs of three spaces between them stay word breaks) and runs of spaces collapsed."""
    if "&" in text:
        text = html.unescape(html.unescape(text))
    text = fold(text).translate(_HOMOGLYPHS)
    text = _SPACED.sub(_joined, re.sub(r"[ \t]{2,}", "  ", text)) if "  " in text or " " in text else text
    return _SPACES.sub(" ", text)
