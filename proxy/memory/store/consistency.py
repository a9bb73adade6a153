"""Keeping the keyword index consistent with the table: its documents derived from LanceDB rows, and the repair.

LanceDB is the source of truth; Tantivy holds one document per record, derived from the columns below.
``repair`` compares every record's signature in both and re-indexes what Tantivy lacks or holds stale, and
drops what LanceDB no longer has: the store runs it on open when the sync note says a write may have
reached one arm only, and after a failed keyword-index write.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pyarrow as pa
import pyarrow.compute as pc
import structlog

from proxy.memory.store.keyword import KeywordIndex
from proxy.memory.store.keyword_schema import KeywordDoc
from proxy.memory.store.table import MemoryTable

log = structlog.get_logger(__name__)

KEYWORD_COLUMNS = ["id", "user_id", "kind", "text", "created_at", "valid"]


def keyword_docs(batch: pa.RecordBatch) -> list[KeywordDoc]:
    """The keyword-index documents of a batch of rows (of ``KEYWORD_COLUMNS``)."""
    created = pc.cast(batch["created_at"], pa.int64()).to_pylist()
    columns = zip(
        batch["id"].to_pylist(),
        batch["user_id"].to_pylist(),
        batch["kind"].to_pylist(),
        batch["text"].to_pylist(),
        created,
        batch["valid"].to_pylist(),
        strict=True,
    )
    return [KeywordDoc(*values) for values in columns]


async def table_keyword_docs(table: MemoryTable, where: str | None = None) -> AsyncIterator[list[KeywordDoc]]:
    """The documents of every row (matching ``where``, from ``filters.record_filter``), batch by batch."""
    async for batch in table.batches(KEYWORD_COLUMNS, where):
        yield keyword_docs(batch)


async def repair_keyword_index(table: MemoryTable, keyword: KeywordIndex) -> dict[str, int]:
    """Make Tantivy agree with LanceDB: index what it lacks or holds stale, drop what LanceDB lost."""
    indexed = await keyword.signatures()
    seen: set[str] = set()
    stale: list[KeywordDoc] = []
    async for docs in table_keyword_docs(table):
        for doc in docs:
            seen.add(doc.id)
            if indexed.get(doc.id) != doc.sig:
                stale.append(doc)
    orphans = [record_id for record_id in indexed if record_id not in seen]
    if stale or orphans:
        await keyword.remove_ids(orphans)
        await keyword.upsert(stale)
        await keyword.commit()
        log.warning("memory.repaired", reindexed=len(stale), dropped=len(orphans))
    return {"reindexed": len(stale), "dropped": len(orphans)}
