"""Tests of the dates a query names: months and years, and whole days."""

from __future__ import annotations

from datetime import date

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
