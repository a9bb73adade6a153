"""SQL filters over the memory table that can only ever match one user's rows.

Filters are SQL strings, so every value is quoted by ``sql_string`` (single quotes doubled, the only escape
DataFusion's string literals know), user ids are checked by ``ids.check_user_id`` before they get there, and
times are passed as integer microseconds.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from proxy.memory.store.ids import check_user_id
from proxy.memory.store.records import Kind, to_micros


def sql_string(value: str) -> str:
    """``value`` as a SQL string literal: single quotes doubled, nothing else interpreted."""
    return "'" + str(value).replace("'", "''") + "'"


def sql_in(column: str, values: Sequence[str]) -> str:
    """``column IN (...)`` over quoted ``values`` (which must not be empty)."""
    return f"{column} IN ({', '.join(sql_string(value) for value in values)})"


def record_filter(
    user_id: str,
    *,
    ids: Sequence[str] | None = None,
    kinds: Sequence[Kind] | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
    include_invalid: bool = True,
) -> str:
    """A filter that can only ever match rows of ``user_id``."""
    clauses = [f"user_id = {sql_string(check_user_id(user_id))}"]
    if ids is not None:
        clauses.append(sql_in("id", ids) if ids else "FALSE")
    if kinds:
        clauses.append(sql_in("kind", [str(Kind(kind)) for kind in kinds]))
    if since is not None:
        clauses.append(f"created_at >= to_timestamp_micros({_micros(since)})")
    if until is not None:
        clauses.append(f"created_at <= to_timestamp_micros({_micros(until)})")
    if not include_invalid:
        clauses.append("valid = TRUE")
    return " AND ".join(f"({clause})" for clause in clauses)


def due_filter(now: datetime, turns_before: datetime | None) -> str:
    """Rows of every user that retention deletes: past their ``expires_at``, and turns created before
    ``turns_before`` (none when None). The only filter here not bound to one user: the sweep's, which deletes
    each user's rows through that user's own delete."""
    clauses = [f"(expires_at IS NOT NULL AND expires_at <= to_timestamp_micros({_micros(now)}))"]
    if turns_before is not None:
        clauses.append(f"(kind = 'turn' AND created_at < to_timestamp_micros({_micros(turns_before)}))")
    return " OR ".join(clauses)


def _micros(at: datetime) -> int:
    if at.tzinfo is None:
        raise ValueError("time filters must be timezone-aware")
    return to_micros(at)
