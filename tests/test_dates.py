"""Tests of the dates a query names: months and years, and whole days."""

from __future__ import annotations

import re
from datetime import date
from unittest.mock import patch

from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.memory.read import dates
from proxy.memory.read.dates import query_dates, query_days


def test_query_dates_reads_months_and_years() -> None:
    """Named months and years are found; the verb "may" and the word "march" are not dates."""
    assert query_dates("What happened in May 2023?") == [(2023, 5)]
    assert query_dates("Where did she go last August?") == [(None, 8)]
    assert query_dates("in 2022 we moved") == [(2022, None)]
    assert query_dates("you may go, we march on") == []
    assert query_dates("May I ask something?") == []


def test_query_days_reads_whole_dates_only() -> None:
    """Days written with their month and year are found in any common order; a month and year alone is not a day."""
    assert query_days("What did Gina find on 1 February, 2023?") == [date(2023, 2, 1)]
    both = [date(2023, 5, 3), date(2023, 10, 13)]
    assert query_days("the painting shown on October 13, 2023 and on 2023-05-03") == both
    assert query_days("the 3rd of June 2023") == [date(2023, 6, 3)]
    assert query_days("in May 2023, or on 31 February 2023") == []


_WORDS = [
    "May", "may", "MAR", "march", "Sept.", "sept", "Dec", "decided", "Mayday", "market", "in", "the", "on", "13",
    "3rd", "2023", "1999", "2023-05-13", "12,", "of", "Junebug", "October", "oct.", "x2023", "20233",
]  # fmt: skip


@settings(max_examples=400, deadline=None)
@given(st.lists(st.sampled_from(_WORDS), max_size=8), st.sampled_from([" ", "  ", ", ", "\n"]))
def test_the_quick_checks_skip_only_texts_without_dates(words: list[str], gap: str) -> None:
    """A text the cheap first search passes over names no month, year or day that the full patterns would
    find: the answers match those of the patterns run on every text."""
    text = gap.join(words)
    anything = re.compile("")  # finds a match in every text
    with patch.object(dates, "_DATE_HINT", anything), patch.object(dates, "_YEAR_HINT", anything):
        full_dates, full_days = query_dates(text), query_days(text)
    assert query_dates(text) == full_dates
    assert query_days(text) == full_days
