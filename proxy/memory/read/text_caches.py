"""The read path's per-text caches (token costs, excerpts, normalised texts, written names, term pieces, word
stems): what the memories read most often cost to prepare, kept so that the same memories injected request
after request are prepared once.

They are module-level (pure functions of a text, so one process's engines may share them safely) and bounded in
bytes; the memory engine owns their lifetime: ``clear`` empties them all, and ``MemoryEngine`` calls it from
``release_idle`` once no user is cached any more (a process whose readers went idle hands their memory back; they
refill on the next reads) and when it closes. Every module-level cache of the read path is listed here.
"""

from __future__ import annotations

from proxy.memory import words
from proxy.memory.read import block, excerpts, injection, names, term_match
from proxy.memory.read.byte_cache import cached_bytes_total


def clear() -> None:
    """Empty every per-text cache of the read path."""
    block.clear_caches()
    excerpts.clear_caches()
    injection.clear_caches()
    names.written_names.cache_clear()
    term_match.text_pieces.cache_clear()
    words.stem.cache_clear()  # every distinct word seen (numbers and ids too), up to 65,536


def nbytes() -> int:
    """What the byte-bounded ones hold together (the word stems' cache is bounded in entries and not counted)."""
    return cached_bytes_total()
