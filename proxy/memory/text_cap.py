"""Capping long texts: the head and the tail kept around a marker that says how much was cut.

Used for stored turns (``memory.max_turn_chars``) and for the read path's query, so that one huge message
costs a bounded amount of memory and CPU however large the request body is. Truncation, not chunking: see
``proxy/bounds.py`` for why.
"""

from __future__ import annotations

from collections.abc import Sequence

TAIL_SHARE = 0.25  # a long paste usually ends with the actual question: keep some of the end
MAX_QUERY_CHARS = 4_000  # what the read path searches with (the embedding model reads ~256 tokens anyway)


def cap_text(text: str, max_chars: int, tail_share: float = TAIL_SHARE) -> str:
    """``text`` if it fits in ``max_chars``; else head and tail around ``[... N characters not stored ...]``.

    The result is exactly ``max_chars`` long, so capping twice changes nothing.
    """
    if len(text) <= max_chars:
        return text
    marker = f"\n[... {len(text) - max_chars:,} characters not stored ...]\n"
    budget = max(0, max_chars - len(marker))
    tail = int(budget * tail_share)
    head = budget - tail
    return text[:head] + marker + (text[-tail:] if tail else "")


def query_texts(user_messages: Sequence[str]) -> list[str]:
    """The texts the read path may embed as queries for these user messages (one each, unexpanded)."""
    return [cap_text(text, MAX_QUERY_CHARS).strip() for text in user_messages if text.strip()]
