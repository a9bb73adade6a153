"""The one routing rule, shared by the chat and the memory-side calls: the longest matching prefix wins.

A ``[[routes]]`` entry takes the models whose name starts with its ``prefix``. When several prefixes match
(``openai/`` and ``openai/gpt-4o``), the longest, i.e. the most specific, wins, whatever their order in the
file; models no prefix matches go to the default upstream. The chat (``proxy.upstream.Router``) and the
memory-side calls (``proxy.memory.write.llm.PrefixRouter``) both call ``route_index``, so a user's chat and the
extraction about it always go to the same provider.
"""

from __future__ import annotations

from collections.abc import Sequence


def route_index(prefixes: Sequence[str], model: str) -> int | None:
    """The index of the longest prefix that ``model`` starts with (the first of equals), or None."""
    best: int | None = None
    for index, prefix in enumerate(prefixes):
        if model.startswith(prefix) and (best is None or len(prefix) > len(prefixes[best])):
            best = index
    return best
