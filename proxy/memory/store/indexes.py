"""The memory table's indexes: Bitmap on ``user_id`` and BTree on ``id`` (scalar, as soon as the table holds
rows), HNSW-SQ cosine on ``embedding`` (once the table is large enough for an index to beat a scan).

Functions of a LanceDB ``AsyncTable``; ``table.MemoryTable`` calls them from its maintenance, purge and reindex.
"""

from __future__ import annotations

from typing import Any

import lancedb
from lancedb.index import Bitmap, BTree, HnswSq

# HNSW build parameters, cheaper than Lance's defaults (m 20, ef_construction 300): the build took a
# fraction of the time on two busy cores, for the same recall on the read path's pools.
ANN_M = 16
ANN_EF_CONSTRUCTION = 100
SCALAR_INDEXES: tuple[tuple[str, type[Bitmap | BTree]], ...] = (("user_id", Bitmap), ("id", BTree))


async def indexed_columns(table: Any) -> dict[tuple[str, ...], str]:
    """Each index's columns -> its name."""
    return {tuple(index.columns): index.name for index in await table.list_indices()}


async def missing_scalar_indexes(table: Any) -> list[tuple[str, type[Bitmap | BTree]]]:
    """The scalar indexes the table lacks (none while it holds no rows). A store written in one go, or
    imported, lacks them before its first maintenance round: every read, update and delete by id or user then
    scans it whole."""
    if await table.count_rows() == 0:
        return []
    have = await indexed_columns(table)
    return [(column, config) for column, config in SCALAR_INDEXES if (column,) not in have]


async def ensure_scalar_indexes(table: Any) -> None:
    """Create the Bitmap (``user_id``) and BTree (``id``) indexes if missing (fast even at a million rows)."""
    for column, config in await missing_scalar_indexes(table):
        await table.create_index(column, config=config())


async def rebuild_scalar_indexes(table: Any) -> None:
    """Rebuild both scalar indexes (after a purge: the Bitmap index keeps a forgotten user's id as a key)."""
    if await table.count_rows() == 0:
        return
    for column, config in SCALAR_INDEXES:
        await table.create_index(column, config=config(), replace=True)


async def ensure_ann_index(table: Any, min_rows: int) -> bool:
    """Build the HNSW-SQ (cosine) index once the table has ``min_rows``; True if one was built.

    Slow for a large table, so the store runs it outside its write lock: an index build commits alongside
    appends and deletes without conflict.
    """
    if ("embedding",) in await indexed_columns(table) or await table.count_rows() < min_rows:
        return False
    config = HnswSq(distance_type="cosine", m=ANN_M, ef_construction=ANN_EF_CONSTRUCTION)
    await table.create_index("embedding", config=config)
    return True


async def drop_ann_index(table: Any) -> None:
    """Drop the vector index, if any (a purge rewrites rows it holds)."""
    name = (await indexed_columns(table)).get(("embedding",))
    if name is not None:
        await table.drop_index(name)


def lance_session(cache_bytes: int | None) -> Any:
    """A LanceDB session whose caches hold at most ``cache_bytes`` (three quarters for indexes), or the default."""
    if cache_bytes is None:
        return None
    index = cache_bytes * 3 // 4
    return lancedb.Session(index_cache_size_bytes=index, metadata_cache_size_bytes=cache_bytes - index)
