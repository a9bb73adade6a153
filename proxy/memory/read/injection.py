"""The memory block's place in the request (pure functions): which items go in, and the merge.

The block (``block``) is appended to the app's first system (or developer) message after a blank line, so the
app's own instructions come first and stay byte-for-byte the prefix they were (good for upstream prompt
caching); list-shaped content gets the block as one more text part. With no system message, the block becomes a
new first message with role ``system``.

Budget: items already present in the conversation are left out, and so are facts drawn only from turns above
them (``drop_repeated``); the rest are cut to ``max_item_tokens`` (``excerpts.excerpt``: the excerpt holding most
query terms), then the lowest-scored items are dropped until the whole block (preamble included) fits
``budget_tokens``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from proxy.memory.read.block import MemoryItem, Section, block_cost, fitting_prefix, render_block
from proxy.memory.read.byte_cache import MIB, byte_cache, text_bytes
from proxy.memory.read.excerpts import excerpt
from proxy.memory.read.query import message_text
from proxy.memory.read.retrieval_settings import InjectionSettings
from proxy.memory.text_cap import cap_text
from proxy.memory.words import words

SYSTEM_ROLES = ("system", "developer")
DEDUPE_MESSAGE_CHARS = 16_000  # a message as dedupe sees it: as long as a stored turn (max_turn_chars' default)
DEDUPE_CHARS = 64_000  # the newest messages' characters dedupe looks at, in all


@dataclass(frozen=True, slots=True)
class Injection:
    """The request's messages with the block merged in, the block itself, and what it holds."""

    messages: list[dict[str, Any]]
    block: str
    items: list[MemoryItem]
    tokens: int

    @property
    def ids(self) -> list[str]:
        """Ids of the injected memories, in block order."""
        return [item.id for item in self.items]


# --- selection and rendering ------------------------------------------------------------------------------


# memories and the app's system prompt come back request after request; requests' messages may be megabytes
@byte_cache(16 * MIB, lambda text, normalised: text_bytes(text, normalised))
def _normalised(text: str) -> str:
    """Lowercase words joined by single spaces, for "is this already in the conversation" checks."""
    return " ".join(words(text))


def _recent_conversation(messages: Sequence[Mapping[str, Any]]) -> list[str]:
    """What of the conversation dedupe looks at, newest first: the texts of its newest messages up to
    ``DEDUPE_CHARS`` in all, each capped as a stored turn is (``cap_text`` at ``DEDUPE_MESSAGE_CHARS``, so a
    turn stored from a long message still matches it). Read from the end: normalising runs on the event loop, a
    request may carry megabytes, and a long history is not walked whole."""
    texts: list[str] = []
    total = 0
    for message in reversed(messages):
        if total >= DEDUPE_CHARS:
            break
        if isinstance(message, Mapping):
            texts.append(cap_text(message_text(message), DEDUPE_MESSAGE_CHARS))
            total += len(texts[-1])
    return texts


def drop_present(items: Sequence[MemoryItem], conversation: Sequence[str]) -> list[MemoryItem]:
    """Items whose text is not already in ``conversation`` (``_recent_conversation``'s texts) nor repeated by a
    higher-scored item."""
    haystack = "\n".join(_normalised[t] for t in conversation)
    kept: dict[str, MemoryItem] = {}
    for item in sorted(items, key=lambda i: -i.score):
        key = _normalised[item.text]
        if key and key not in kept and key not in haystack:
            kept[key] = item
    return list(kept.values())


def drop_repeated(ranked: Sequence[MemoryItem]) -> list[MemoryItem]:
    """``ranked`` (best first) without the facts drawn only from turns above them: those turns already say what
    the fact was drawn from, and its tokens go to a memory the block would leave out. (A turn below a fact drawn
    from it stays: a turn holds more than the fact taken from it.)"""
    kept: list[MemoryItem] = []
    kept_ids: set[str] = set()
    for item in ranked:
        if item.sources and kept_ids.issuperset(item.sources):
            continue
        kept.append(item)
        kept_ids.add(item.id)
    return kept


def select_items(
    items: Sequence[MemoryItem],
    query_terms: Sequence[str],
    conversation: Sequence[str],
    settings: InjectionSettings,
) -> list[MemoryItem]:
    """The items that go in the block: not already present, excerpted, within the budget.

    Items are excerpted best first and only until the budget is full (an excerpt costs a scan of the text).
    """
    fresh = drop_present(items, conversation) if settings.dedupe_against_conversation else list(items)
    ranked = sorted(fresh, key=lambda i: -i.score)
    if settings.drop_repeated:
        ranked = drop_repeated(ranked)
    cut = (_with_text(i, excerpt(i.text, query_terms, settings.max_item_tokens)) for i in ranked)
    return fitting_prefix(cut, settings.budget_tokens)


def _with_text(item: MemoryItem, text: str) -> MemoryItem:
    """``item`` with another text (an excerpt)."""
    if text == item.text:
        return item
    return MemoryItem(item.id, item.section, text, item.date, item.score, item.label, item.expires_at, item.sources)


# --- merging into the request -----------------------------------------------------------------------------


def merge_block(messages: Sequence[Mapping[str, Any]], block: str) -> list[dict[str, Any]]:
    """The messages with ``block`` appended to the leading system message, or as a new first message.

    The input is not modified; only the system message is copied, and its original content stays the
    exact prefix of the new one.
    """
    out = [m if isinstance(m, dict) else dict(m) for m in messages]
    if not block:
        return out
    if out and out[0].get("role") in SYSTEM_ROLES:
        out[0] = {**out[0], "content": appended(out[0].get("content"), block)}
        return out
    return [{"role": "system", "content": block}, *out]


def appended(content: Any, block: str, part: str = "text") -> Any:
    """Message content with the block after it: a string gets a blank line and the block, a list one more part
    of type ``part`` (the app's own parts, ``cache_control`` marks included, stay as they were)."""
    if isinstance(content, str):
        return f"{content}\n\n{block}" if content else block
    if isinstance(content, list):
        return [*content, {"type": part, "text": block}]
    return block


def choose(
    messages: Sequence[Mapping[str, Any]],
    items: Sequence[MemoryItem],
    query_terms: Sequence[str],
    settings: InjectionSettings,
) -> list[MemoryItem]:
    """The items a whole block would hold for a request with ``messages`` (best first)."""
    return select_items(items, query_terms, _recent_conversation(messages), settings)


def inject(
    messages: Sequence[Mapping[str, Any]],
    items: Sequence[MemoryItem],
    query_terms: Sequence[str],
    settings: InjectionSettings,
) -> Injection:
    """Choose, render and merge the memory block into a chat request's messages."""
    chosen = choose(messages, items, query_terms, settings)
    block = render_block(chosen)
    ordered = [i for s in Section for i in sorted(chosen, key=lambda i: -i.score) if i.section is s]
    return Injection(
        messages=merge_block(messages, block),
        block=block,
        items=ordered,
        tokens=block_cost(chosen),
    )


def clear_caches() -> None:
    """Empty this module's per-text cache (``text_caches.clear``)."""
    _normalised.cache_clear()
