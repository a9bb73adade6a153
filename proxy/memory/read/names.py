"""The entity arm's name index: names on a user's memories, found in the query and scored (pure functions).

The index holds the names of the user's memories (entities of facts, names of subjects, linked to their facts).
A query names some of them (``names_in_query``); a memory's score is the sum of the damped weights of the names
it carries (``entity_scores``), a name on many memories counting for less (``name_damping``), capped at 1.
Names written with a capital in the found memories' own text count too (``written_names``, ``text_name_scores``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from proxy.memory.read.byte_cache import MIB, byte_cache, text_bytes
from proxy.memory.store.records import Kind, MemoryRecord
from proxy.memory.words import STOPWORDS, cased_words, has_cjk, normalise_name, words


@dataclass(frozen=True, slots=True)
class NameIndex:
    """Names found on one user's memories (entities, subjects) and the memories that carry each name."""

    names: Mapping[str, tuple[str, ...]]
    max_words: int = 1
    cjk_names: tuple[str, ...] = ()  # matched as substrings: CJK text has no spaces between words
    subjects: int = 0  # subject records seen (none: the subject search can be skipped)

    @classmethod
    def build(cls, records: Iterable[MemoryRecord]) -> NameIndex:
        """Index entity names of memories, and subject names linked to their memories' ids."""
        names: dict[str, dict[str, None]] = {}
        subjects = 0
        for record in records:
            subjects += record.kind is Kind.SUBJECT
            if record.kind is Kind.SUBJECT:
                pairs = [(record.text, rid) for rid in record.source_ids]
            else:
                pairs = [(entity, record.id) for entity in record.entities]
            for name, rid in pairs:
                key = normalise_name(name)
                if _usable_name(key):
                    names.setdefault(key, {})[rid] = None
        frozen = {key: tuple(ids) for key, ids in names.items()}
        longest = max((len(key.split()) for key in frozen), default=1)
        cjk = tuple(k for k in frozen if has_cjk(k))
        return cls(names=frozen, max_words=longest, cjk_names=cjk, subjects=subjects)


def _usable_name(key: str) -> bool:
    """Names worth matching: not empty, not a lone stop word, not a single Latin letter or digit."""
    if not key:
        return False
    single_word = " " not in key
    return not (single_word and ((len(key) < 2 and key.isascii()) or key in _NAME_STOPWORDS))


_NAME_STOPWORDS = frozenset({"i", "me", "my", "we", "us", "you", "he", "she", "it", "they", "the", "a", "an"})


def names_in_query(text: str, index: NameIndex) -> list[str]:
    """Index names the query mentions, as whole words (case-insensitive); CJK names as substrings."""
    tokens = words(text)
    found: dict[str, None] = {}
    for size in range(1, index.max_words + 1):
        for start in range(len(tokens) - size + 1):
            key = " ".join(tokens[start : start + size])
            if key in index.names:
                found[key] = None
    lowered = text.lower()
    found.update(dict.fromkeys(key for key in index.cjk_names if key in lowered))
    return list(found)


# the same memories come back request after request
@byte_cache(16 * MIB, lambda text, names: text_bytes(text, *names))
def written_names(text: str) -> frozenset[str]:
    """Names written in a memory's text: its capitalised words (lowercased), stop words and single letters left out.

    Crude on purpose, and cheap enough to run over every candidate of a request: a sentence-initial word
    ("Yesterday") counts too, which costs little, since only words the query also holds are ever used.
    """
    tokens = (t.lower() for t in cased_words(text) if t[0].isupper())
    return frozenset(t for t in tokens if _usable_name(t) and t not in STOPWORDS)


def text_name_scores(query_text: str, records: Iterable[MemoryRecord]) -> dict[str, float]:
    """Memory id -> damped score of the query's words written as names in the memory (among ``records``).

    Matched case-insensitively as whole words; a name written in many of ``records`` counts for less
    (``name_damping`` of how many carry it), and several names add up to at most 1.
    """
    wanted = {w for w in words(query_text) if w not in STOPWORDS}
    carried: dict[str, list[str]] = {}
    for record in {r.id: r for r in records}.values():
        for name in wanted & written_names[record.text]:
            carried.setdefault(name, []).append(record.id)
    scores: dict[str, float] = {}
    for ids in carried.values():
        for rid in ids:
            scores[rid] = min(1.0, scores.get(rid, 0.0) + name_damping(len(ids)))
    return scores


def name_damping(memories_with_name: int) -> float:
    """How much one name says: 1 for a name on one memory, ~0.2 for a name on 60 (1 / (1 + ln n))."""
    return 1.0 / (1.0 + math.log(max(1, memories_with_name)))


def entity_scores(names: Iterable[str], index: NameIndex) -> dict[str, float]:
    """Memory id -> sum of the damped weights of the query names it carries, capped at 1 (in the order the
    names bring them: a common name brings hundreds, so the caller orders only what it needs)."""
    scores: dict[str, float] = {}
    for name in names:
        ids = index.names.get(name, ())
        weight = name_damping(len(ids))
        for rid in ids:
            scores[rid] = min(1.0, scores.get(rid, 0.0) + weight)
    return scores
