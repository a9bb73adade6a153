"""The memory table's maintenance round: compact small fragments, fold new rows into the indexes, drop old versions.

LanceDB's ``AsyncTable.optimize()`` does the same three steps but compacts with Lance's default target of 1M rows
per fragment: every fragment under it is a candidate, so a table that grows by small appends has its one big
fragment merged with the new small ones in *every* round, and each round rewrites the whole table (lancedb#2325).
Under ``make bench-writes`` that was the writer's LanceDB threads climbing from 28% to 52% of a core in 12 minutes
while the appends stayed the same. Here compaction targets ``TARGET_ROWS`` rows per fragment: a fragment that has
reached it is left alone unless deletions make it a candidate, so a round rewrites at most about ``TARGET_ROWS``
rows plus what arrived since the last round, however large the table.

That bound still had every row rewritten many times: each round merged the new appends into the partial
fragment (up to ``TARGET_ROWS`` rows) until it filled, a sawtooth of 0.8 -> 2.5 s a round under
``make bench-writes``. So compaction has two tiers: a round merges the appends (fragments under ``SMALL_ROWS``)
and leaves the fragments between ``SMALL_ROWS`` and ``TARGET_ROWS`` alone until those hold ``TARGET_ROWS`` rows
between them; that round merges them into full fragments.

The new rows go into the scalar indexes (Bitmap on users, BTree on ids) as a delta segment of their own
(``num_indices_to_merge=0``: the new rows' cost alone). Folding them into the one segment (Lance's default)
rewrote the whole index every round: 0.06 -> 0.85 s a round over 30 minutes of ``make bench-writes``. At
``MERGE_SEGMENTS_AT`` segments a round merges them into one (a read consults every segment). Lance merges only
fragments that the same index segments cover, so the appends of consecutive rounds stay apart until then: the
fragments a round leaves number at most about ``MERGE_SEGMENTS_AT`` more. The vector index, once built, takes the
new rows into its newest segment as before.

pylance (the Lance package that LanceDB is built on; the same Lance release as the lancedb pinned) opens the
dataset for the round; its commits are Lance transactions like LanceDB's, resolved against appends committed
meanwhile. Only the process that owns the table's writes runs this.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import structlog

from proxy.memory.store.indexes import SCALAR_INDEXES

log = structlog.get_logger(__name__)
SCALAR_COLUMNS = frozenset(column for column, _ in SCALAR_INDEXES)

# Rows per fragment compaction aims for: large enough that a scan of a million rows meets ~30 files, small enough
# that a round's rewrite (up to this many rows of the last partial fragment, plus the new ones) stays a fraction of
# a second of one core.
TARGET_ROWS = 1 << 15
# A fragment under this is an append or a round's appends merged: always a candidate (merged with its neighbours
# once the same index segments cover them).
SMALL_ROWS = 1 << 11
# Index segments (the merged one and the rounds' deltas) that make a round merge them into one.
MERGE_SEGMENTS_AT = 8
# Old versions are removed this often, by a ticker of their own (beside the rounds, outside the store's locks).
# Removing them reads every manifest kept (ten minutes of commits: thousands under load, each listing every
# fragment); done in every round it grew with the commit rate and took more of a round than the compaction (0.1 ->
# 2.1 s in 4 minutes of ``make bench-writes``).
CLEANUP_EVERY_S = 300.0
# The caches of the dataset a round opens (manifests, index pages while remapping and merging): freed with it.
_ROUND_CACHE_BYTES = 64 << 20


@dataclass(frozen=True)
class RoundStats:
    """What one round did."""

    fragments_removed: int
    fragments_added: int
    compact_s: float
    index_s: float
    merged: bool = False  # the middle tier was a candidate (Lance merges what one set of index segments covers)
    segments: int = 0  # the most segments an index had before the round (merged into one at MERGE_SEGMENTS_AT)


def middle_tier(rows: Sequence[tuple[int, int]]) -> tuple[list[int], bool]:
    """Of (fragment id, live rows), the middle tier's fragments (between ``SMALL_ROWS`` and ``TARGET_ROWS`` rows)
    and whether they hold ``TARGET_ROWS`` rows between them: then a round merges them, else it leaves them alone."""
    middle = [(fragment, count) for fragment, count in rows if SMALL_ROWS <= count < TARGET_ROWS]
    return [fragment for fragment, _ in middle], sum(count for _, count in middle) >= TARGET_ROWS


def _round(uri: str, storage_options: dict[str, str] | None) -> RoundStats:
    import lance  # only the table's writer needs it: chat processes never import it

    started = time.perf_counter()
    dataset = lance.dataset(
        uri,
        storage_options=storage_options,
        index_cache_size_bytes=_ROUND_CACHE_BYTES,
        metadata_cache_size_bytes=_ROUND_CACHE_BYTES,
    )
    rows = [(f.fragment_id, f.metadata.physical_rows - f.metadata.num_deletions) for f in dataset.get_fragments()]
    middle, full = middle_tier(rows)
    alone = [] if full else middle
    compaction = dataset.optimize.compact_files(target_rows_per_fragment=TARGET_ROWS, excluded_fragment_ids=alone)
    compacted = time.perf_counter()
    described = dataset.describe_indices()
    scalar = [index for index in described if index.field_names[0] in SCALAR_COLUMNS]
    segments = max((len(index.segments) for index in scalar), default=0)
    if scalar:  # 0: the new rows as a delta segment; n: they and the n newest segments (all of them) as one
        merge = segments if segments >= MERGE_SEGMENTS_AT else 0
        dataset.optimize.optimize_indices(index_names=[index.name for index in scalar], num_indices_to_merge=merge)
    if vector := [index.name for index in described if index.field_names[0] not in SCALAR_COLUMNS]:
        dataset.optimize.optimize_indices(index_names=vector)  # the new rows into its newest segment, as before
    return RoundStats(
        fragments_removed=compaction.fragments_removed,
        fragments_added=compaction.fragments_added,
        compact_s=compacted - started,
        index_s=time.perf_counter() - compacted,
        merged=full,
        segments=segments,
    )


async def maintain(table: Any, storage_options: dict[str, str] | None) -> RoundStats:
    """Compact the LanceDB ``table`` and fold new rows into its indexes (in a thread), then point the table at the
    result. Old versions stay (``remove_versions``)."""
    stats = await asyncio.to_thread(_round, await table.uri(), storage_options)
    await table.checkout_latest()
    log.info(
        "memory.compacted",
        fragments_removed=stats.fragments_removed,
        fragments_added=stats.fragments_added,
        compact_ms=round(stats.compact_s * 1000),
        index_ms=round(stats.index_s * 1000),
        merged=stats.merged,
        index_segments=stats.segments,
    )
    return stats


def _remove_versions(
    uri: str, storage_options: dict[str, str] | None, older_than: timedelta, delete_unverified: bool
) -> tuple[int, int]:
    import lance

    dataset = lance.dataset(uri, storage_options=storage_options, metadata_cache_size_bytes=_ROUND_CACHE_BYTES)
    cleanup = dataset.cleanup_old_versions(older_than=older_than, delete_unverified=delete_unverified)
    return cleanup.old_versions, cleanup.bytes_removed


async def remove_versions(
    table: Any, storage_options: dict[str, str] | None, older_than: timedelta, *, delete_unverified: bool = False
) -> None:
    """Remove the ``table``'s versions older than ``older_than`` and the files only they use (in a thread).

    Commits nothing, so it runs beside writes of every kind (the store calls it outside its locks: reading
    every manifest kept takes seconds under load, 17-21 s with ten minutes of commits in ``make bench-writes``).
    ``delete_unverified`` also deletes files no version references however young (a failed write's), which is
    safe only while no other process writes the table.
    """
    started = time.perf_counter()
    uri = await table.uri()
    versions, removed = await asyncio.to_thread(_remove_versions, uri, storage_options, older_than, delete_unverified)
    log.info("memory.versions_removed", versions=versions, bytes_removed=removed,
             ms=round((time.perf_counter() - started) * 1000))  # fmt: skip
