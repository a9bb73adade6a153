"""Excerpts: the part of a long memory that fits an item's token budget and holds most of the query's terms.

A long text is cut into chunks (words, and single CJK characters), each with its cost inside the quotes and the
stems it holds, cached per text; a query's few stems then count their chunks without a pass over all of them, and
the best window of chunks within the budget is the excerpt. A chunk's cost and stems are cached per chunk too:
words recur from text to text, and working them out (quoting, the token estimate's passes, stemming) was most of
cutting a text the first time (a block's long turns, seen once each, were a tenth of a busy chat process's CPU).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from proxy.memory.read.block import quote, quoted_cost
from proxy.memory.read.byte_cache import MIB, byte_cache, text_bytes
from proxy.memory.read.tokens import CJK_CLASS, estimate_tokens
from proxy.memory.words import stems

_CHUNK = re.compile(rf"[{CJK_CLASS}]|[^\s{CJK_CLASS}]+")


class _Chunks(NamedTuple):
    """A long text cut into chunks, as arrays (a few hundred bytes for a turn, against tens of kilobytes as
    tuples of spans and a dict of lists per stem, which made the cache of texts large)."""

    spans: npt.NDArray[np.int32]  # (chunks, 2): each chunk's [start, end) in the text
    costs: npt.NDArray[np.int32]  # each chunk's cost inside the quotes
    stem_hashes: npt.NDArray[np.int64]  # every (stem, chunk) pair of the text: the stem's hash ...
    stem_chunks: npt.NDArray[np.int32]  # ... and the chunk holding it


@byte_cache(8 * MIB, lambda text, chunks: text_bytes(text) + sum(a.nbytes for a in chunks))
def _chunked(text: str) -> _Chunks:
    """A long text's chunks, each chunk's cost inside the quotes, and which chunks hold which stems (cached
    per text; a query's few stems then count their chunks without a pass over all of them)."""
    found = list(_CHUNK.finditer(text))
    known = [_chunk[m.group()] for m in found]
    costs = [cost for cost, _ in known]
    pairs = [(stem_hash, index) for index, (_, hashes) in enumerate(known) for stem_hash in hashes]
    hashes, chunks = zip(*pairs, strict=True) if pairs else ((), ())
    return _Chunks(
        np.array([m.span() for m in found], dtype=np.int32).reshape(-1, 2),
        np.array(costs, dtype=np.int32),
        np.array(hashes, dtype=np.int64),
        np.array(chunks, dtype=np.int32),
    )


@byte_cache(2 * MIB, lambda chunk, known: text_bytes(chunk) + 36 * len(known[1]))
def _chunk(chunk: str) -> tuple[int, tuple[int, ...]]:
    """A chunk's cost inside the quotes and the hashes of its stems."""
    return estimate_tokens(quote(chunk)) - 2, tuple(hash(stem) for stem in stems(chunk))


@functools.lru_cache(maxsize=256)
def _query_stems(query_terms: tuple[str, ...]) -> npt.NDArray[np.int64]:
    """The hashes of a query's stems, as ``_chunked`` keeps them (one query excerpts every item of its block)."""
    return np.array(sorted({hash(stem) for stem in stems(" ".join(query_terms))}), dtype=np.int64)


def _held(values: npt.NDArray[np.int64], wanted: npt.NDArray[np.int64]) -> npt.NDArray[np.bool_]:
    """``np.isin(values, wanted)`` for a sorted ``wanted``: one binary search per value (np.isin sorts both
    sides, wasted work for a long turn's stem hashes against a query's few)."""
    if not len(wanted):
        return np.zeros(len(values), dtype=np.bool_)
    at = np.minimum(np.searchsorted(wanted, values), len(wanted) - 1)
    held: npt.NDArray[np.bool_] = wanted[at] == values
    return held


def _best_window(
    costs: Sequence[int] | npt.NDArray[np.int32], hits: Sequence[int] | npt.NDArray[np.int64], limit: int
) -> tuple[int, int]:
    """The [start, end) chunk window within ``limit`` tokens holding most hits (earliest on ties)."""
    if not len(costs):
        return (0, 0)
    spent = np.concatenate(([0], np.cumsum(costs)))
    found = np.concatenate(([0], np.cumsum(hits)))
    starts = np.arange(len(costs))
    ends = np.searchsorted(spent, spent[:-1] + limit, side="right") - 1  # longest window from each start
    held = np.where(ends > starts, found[ends] - found[starts], -1)
    start = int(np.argmax(held))  # the first of the best
    return (start, int(ends[start])) if held[start] >= 0 else (0, 0)


def _prefix_within(text: str, limit: int) -> str:
    """The longest prefix of ``text`` whose quoted form fits ``limit`` tokens (binary search)."""
    low, high = 0, len(text)
    while low < high:
        middle = (low + high + 1) // 2
        if quoted_cost[text[:middle]] <= limit:
            low = middle
        else:
            high = middle - 1
    return text[:low]


def excerpt(text: str, query_terms: Sequence[str], max_tokens: int) -> str:
    """``text`` if it fits ``max_tokens`` once quoted, else the window holding most query terms, with "…"."""
    if quoted_cost[text] <= max_tokens:
        return text
    spans, costs, stem_hashes, stem_chunks = _chunked[text]
    held = stem_chunks[_held(stem_hashes, _query_stems(tuple(query_terms)))]
    hits = np.bincount(held, minlength=len(costs))  # per chunk, how many of the query's stems it holds
    start, end = _best_window(costs, hits, max(1, max_tokens - 4))  # the quotes and two "…"
    if end <= start:
        return _prefix_within(text, max_tokens - 1) + "…"
    cut = text[spans[start][0] : spans[end - 1][1]]
    cut = ("…" if start > 0 else "") + cut + ("…" if end < len(spans) else "")
    if cut.isprintable() and int(costs[start:end].sum()) + 4 <= max_tokens:
        return cut  # spaces only between chunks (nothing quoting escapes): chunk costs + quotes + two "…" add up
    while quoted_cost[cut] > max_tokens and " " in cut.strip():
        cut = cut.rstrip("…").rsplit(" ", 1)[0] + "…"
    return cut if quoted_cost[cut] <= max_tokens else _prefix_within(cut, max_tokens)


def clear_caches() -> None:
    """Empty this module's per-text and per-query caches (``text_caches.clear``)."""
    _chunked.cache_clear()
    _chunk.cache_clear()
    _query_stems.cache_clear()
