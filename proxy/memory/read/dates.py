"""Dates a query names: months and years ("May 2023", "last August") and whole days ("October 13, 2023").

The date boosts of fusion lift memories dated in a month, year or day the query names. Ambiguous month words
("may", "mar", "march") count only when capitalised or followed by a year.
"""

from __future__ import annotations

import re
from datetime import date

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


# What every date ``_DATE`` finds holds: a year, or a month word standing alone (any case). Most queries have
# neither, and this one search costs a fraction of ``_DATE``'s, which tries every word of three or more letters.
_DATE_HINT = re.compile(
    r"(?:19|20)\d\d|\b(?:jan(?:uary)?|feb(?:ruary)?|mar(?:ch)?|apr(?:il)?|may|june?|july?|aug(?:ust)?"
    r"|sept?(?:ember)?|oct(?:ober)?|nov(?:ember)?|dec(?:ember)?)\b",
    re.IGNORECASE,
)
_YEAR_HINT = re.compile(r"(?:19|20)\d\d")  # in every whole day the patterns below find


def query_dates(text: str) -> list[tuple[int | None, int | None]]:
    """(year, month) pairs the text names ("May 2023", "in 2022", "last August"); None where unnamed."""
    if _DATE_HINT.search(text) is None:
        return []
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
    if _YEAR_HINT.search(text) is None:
        return []
    found: dict[date, None] = {}
    for pattern in (_DAY_FIRST, _MONTH_FIRST):
        for match in pattern.finditer(text):
            day = _day(match.group("year"), _MONTHS.get(match.group("month").lower()), match.group("day"))
            found.update({day: None} if day is not None else {})
    for match in _ISO_DAY.finditer(text):
        day = _day(match.group("year"), int(match.group("month")), match.group("day"))
        found.update({day: None} if day is not None else {})
    return sorted(found)
