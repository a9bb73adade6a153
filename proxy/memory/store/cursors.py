"""Listing cursors: opaque tokens for a position in a user's records, newest first by (created_at, id)."""

from __future__ import annotations

import base64

import numpy as np
import numpy.typing as npt
import orjson
import pyarrow as pa

from proxy.memory.errors import InvalidCursor


def page_keys(keys: pa.Table, cursor: str | None, limit: int) -> tuple[list[str], str | None]:
    """The ids of one page of ``keys`` (id, created_at) after ``cursor``, and the next page's cursor (or None)."""
    ordered = keys.sort_by([("created_at", "descending"), ("id", "descending")])
    created = ordered["created_at"].cast(pa.int64()).to_numpy()
    ids = ordered["id"].to_pylist()
    start = cursor_position(created, ids, cursor) if cursor else 0
    page_ids = ids[start : start + max(0, limit)]
    more = start + len(page_ids) < len(ids) and page_ids
    next_cursor = encode_cursor(int(created[start + len(page_ids) - 1]), page_ids[-1]) if more else None
    return page_ids, next_cursor


def encode_cursor(created_us: int, record_id: str) -> str:
    """The cursor of the position just after the key (created_at in microseconds, id)."""
    raw = orjson.dumps([created_us, record_id])
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str) -> tuple[int, str]:
    """The key a cursor names; ``InvalidCursor`` if it is not one of ours."""
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        created_us, record_id = orjson.loads(raw)
    except (ValueError, TypeError) as exc:
        raise InvalidCursor("invalid cursor") from exc
    if not isinstance(created_us, int) or not isinstance(record_id, str):
        raise InvalidCursor("invalid cursor")
    return created_us, record_id


def cursor_position(created: npt.NDArray[np.int64], ids: list[str], cursor: str) -> int:
    """Index of the first key strictly after the cursor in (created_at, id) descending order."""
    created_us, record_id = decode_cursor(cursor)
    for i in range(int(np.searchsorted(-created, -created_us, side="left")), len(ids)):
        if created[i] < created_us or ids[i] < record_id:
            return i
    return len(ids)
