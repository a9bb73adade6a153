"""The retrieval query of a chat request: the latest user message, expanded when it leans on the turn before.

The query is the latest user message; when that message is short or leans on what came before
("and her?", "what about that one"), the previous user turn is put in front of it so the arms have
something to match. Its ``terms`` come from the one tokeniser every path shares (``proxy.memory.words``):
lowercase word tokens with a small English stop list, CJK runs as overlapping bigrams.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from proxy.memory.text_cap import query_texts
from proxy.memory.words import STOPWORDS, terms, words

# Words that make a message lean on the previous turn.
_ANAPHORIC = frozenset(
    "he she him her his hers they them their it its that this those these there one ones".split()  # noqa: SIM905
)
_CONTINUATIONS = ("and ", "but ", "also ", "what about", "how about", "so ", "then ", "or ")


@dataclass(frozen=True, slots=True)
class Query:
    """What the read path searches with: the text, its content terms, and whether it was expanded."""

    text: str
    latest: str
    terms: tuple[str, ...]
    expanded: bool


TEXT_PARTS = frozenset({"text"})


def content_text(content: Any, part_types: Collection[str] = TEXT_PARTS) -> str:
    """The text of a message's content, in any of the dialects: a string, or its parts whose ``type`` is one of
    ``part_types`` (chat's and Anthropic's ``text``; the Responses API's ``input_text``/``output_text``) joined by
    newlines."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [p.get("text") for p in content if isinstance(p, Mapping) and p.get("type") in part_types]
        return "\n".join(p for p in parts if isinstance(p, str))
    return ""


def message_text(message: Mapping[str, Any]) -> str:
    """The text of one chat message: a string content, or its text parts joined by newlines."""
    return content_text(message.get("content"))


def user_texts(messages: Sequence[Mapping[str, Any]], last: int | None = None) -> list[str]:
    """The non-empty texts of the user messages, oldest first; only the ``last`` few when given (read from the
    end: a long history is not walked whole)."""
    texts: list[str] = []
    for message in reversed(messages):
        if last is not None and len(texts) >= last:
            break
        if isinstance(message, Mapping) and message.get("role") == "user" and (text := message_text(message)).strip():
            texts.append(text)
    return texts[::-1]


def is_anaphoric(text: str, short_words: int) -> bool:
    """Whether a message is short or leans on an earlier turn ("and her?", "what about that one")."""
    tokens = words(text)
    lowered = text.strip().lower()
    if len(tokens) <= short_words or lowered.startswith(_CONTINUATIONS):
        return True
    content = [t for t in tokens if t not in STOPWORDS]
    return len(content) <= 2 and any(t in _ANAPHORIC for t in tokens)


def build_query(messages: Sequence[Mapping[str, Any]], *, short_words: int = 4, expand: bool = True) -> Query | None:
    """The query of a chat request, or None when it has no user text to search with."""
    texts = user_texts(messages, last=2)
    if not texts:
        return None
    latest = query_texts(texts[-1:])[0]  # a huge message costs a bounded search
    expanded = expand and len(texts) > 1 and is_anaphoric(latest, short_words)
    text = f"{query_texts(texts[-2:-1])[0]}\n{latest}" if expanded else latest
    return Query(text=text, latest=latest, terms=terms(text), expanded=expanded)
