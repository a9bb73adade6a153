"""Training pairs for a user's query adapter, from what the product already stores: a message, and the earlier
memory that the reply to it then drew on.

When an assistant's reply picks up something from an earlier chat ("how did the Lisbon trip go?"), the
message it answered was, in effect, a query whose answer is that earlier memory. For each message followed by a
reply from the other side in the same conversation, the memories of *other* conversations, stored before the
message, are scored by how much of the reply's vocabulary they share, each shared word weighted by its rarity
among the user's memories (IDF; a cosine over binary IDF-weighted word sets). The best one becomes the
message's answer when it shares at least ``min_shared`` content words and scores at least ``min_score``, and
stands out from the runner-up by ``min_lead``. No label, no model: any chat yields them, and none comes from
a benchmark's questions.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from proxy.memory.words import STOPWORDS, stem, terms


@dataclass(frozen=True, slots=True)
class Said:
    """One message of the user's chats, as pair mining sees it (``side``: who said it, e.g. the role)."""

    text: str
    side: str
    conversation: str
    at: datetime


@dataclass(frozen=True, slots=True)
class Remembered:
    """One memory a reply may draw on: its text, conversation (None: none, e.g. a fact) and creation time."""

    text: str
    conversation: str | None
    at: datetime


@dataclass(frozen=True)
class PairRules:
    """When a reply counts as drawing on a memory."""

    min_shared: int = 2  # content words the reply and the memory share
    min_score: float = 0.2  # IDF-weighted cosine of their word sets
    min_lead: float = 1.2  # the best memory's score over the runner-up's
    sides: tuple[str, ...] = ("user",)  # messages from these sides are queries (their replies: any other side)
    max_messages: int = 5_000  # the newest this many messages are looked at


def content_stems(text: str) -> frozenset[str]:
    """The stemmed content words of ``text`` (no stop words, no one-letter tokens, no numbers alone)."""
    return frozenset(stem(t) for t in terms(text) if len(t) > 1 and not t.isdigit() and t not in STOPWORDS)


class _Index:
    """The memories' content words: an inverted index and IDF weights."""

    def __init__(self, memories: Sequence[Remembered]) -> None:
        self.words = [content_stems(m.text) for m in memories]
        df = Counter(w for ws in self.words for w in ws)
        n = max(len(memories), 1)
        self.idf = {w: math.log(1 + n / c) for w, c in df.items()}
        self.postings: dict[str, list[int]] = defaultdict(list)
        for i, ws in enumerate(self.words):
            for w in ws:
                self.postings[w].append(i)
        self.mass = [math.sqrt(sum(self.idf[w] ** 2 for w in ws)) for ws in self.words]

    def scores(self, reply: frozenset[str]) -> tuple[dict[int, float], dict[int, int]]:
        """Per memory sharing a word with ``reply``: the IDF-weighted cosine and the count of shared words."""
        weight = {w: self.idf[w] for w in reply if w in self.idf}
        norm = math.sqrt(sum(v * v for v in weight.values())) or 1.0
        dot: dict[int, float] = defaultdict(float)
        shared: dict[int, int] = defaultdict(int)
        for w, v in weight.items():
            for i in self.postings[w]:
                dot[i] += v * v
                shared[i] += 1
        return {i: d / (norm * (self.mass[i] or 1.0)) for i, d in dot.items()}, shared


def answered(said: Sequence[Said], min_words: int = 3) -> list[tuple[int, int]]:
    """(question index, answer index) pairs: a message that asks something ("?") and the next message of the
    conversation, from the other side, when it says something (``min_words`` content words or more)."""
    out: list[tuple[int, int]] = []
    for i in range(len(said) - 1):
        question, reply = said[i], said[i + 1]
        if "?" not in question.text or reply.side == question.side or reply.conversation != question.conversation:
            continue
        if len(content_stems(reply.text)) >= min_words:
            out.append((i, i + 1))
    return out


def drawn_on(
    said: Sequence[Said], memories: Sequence[Remembered], rules: PairRules | None = None
) -> list[tuple[int, int]]:
    """(message index, memory index) pairs: each message whose reply drew on an earlier memory (module
    docstring), in the messages' order."""
    rules = rules or PairRules()
    index = _Index(memories)
    out: list[tuple[int, int]] = []
    start = max(0, len(said) - rules.max_messages)
    for i in range(start, len(said) - 1):
        message, reply = said[i], said[i + 1]
        if message.side not in rules.sides or reply.side == message.side:
            continue
        if reply.conversation != message.conversation:
            continue
        best = _best(index, memories, message, content_stems(reply.text), rules)
        if best is not None:
            out.append((i, best))
    return out


def _best(
    index: _Index, memories: Sequence[Remembered], message: Said, reply: frozenset[str], rules: PairRules
) -> int | None:
    """The memory the reply drew on, if one stands out (see ``drawn_on``)."""
    scores, shared = index.scores(reply)
    earlier = [
        (s, i)
        for i, s in scores.items()
        if memories[i].conversation != message.conversation and memories[i].at < message.at
    ]
    if not earlier:
        return None
    earlier.sort(reverse=True)
    score, best = earlier[0]
    runner_up = earlier[1][0] if len(earlier) > 1 else 0.0
    if shared[best] < rules.min_shared or score < rules.min_score or score < rules.min_lead * runner_up:
        return None
    return best
