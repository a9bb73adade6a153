"""A scripted insight writer for ``tests.support.fake_llm.FakeLLM``: names the topic the messages share.

``InsightWriter`` answers ``memory_insight`` calls: it finds the topic whose keyword most of the quoted
messages contain and returns ``{"insight": "The user keeps coming back to <topic>."}``; ``{"insight": null}``
when no topic word occurs or the topic is in ``declines``; a fixed text for topics in ``replies``.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Mapping
from typing import Any

from tests.support.fake_llm import user_payload

SCHEMA = "memory_insight"
KEYWORDS: Mapping[str, tuple[str, ...]] = {
    "sourdough": ("sourdough", "starter", "dough", "loaf", "crumb"),
    "marathon": ("marathon", "run", "running", "pace", "race"),
    "kubernetes": ("kubernetes", "pod", "pods", "kubectl", "helm", "cluster"),
    "japanese": ("japanese", "kanji", "hiragana", "katakana", "jlpt"),
    "guitar": ("guitar", "chord", "fret", "strum", "capo"),
    "garden": ("garden", "tomato", "compost", "soil", "mulch"),
}


def topic_of(messages: list[str]) -> str | None:
    """The topic most of ``messages`` mention, or None."""
    votes: Counter[str] = Counter()
    for text in messages:
        words = set(text.lower().replace("?", " ").replace(",", " ").split())
        for topic, keys in KEYWORDS.items():
            if words & set(keys):
                votes[topic] += 1
    return votes.most_common(1)[0][0] if votes else None


@dataclasses.dataclass
class InsightWriter:
    """A ``FakeLLM`` responder for the insight schema; records the topics it was asked about."""

    declines: frozenset[str] = frozenset()
    replies: Mapping[str, str] = dataclasses.field(default_factory=dict)
    asked: list[str | None] = dataclasses.field(default_factory=list)

    def __call__(self, schema_name: str, body: dict[str, Any]) -> dict[str, Any]:
        assert schema_name == SCHEMA, f"unexpected memory call {schema_name}"
        topic = topic_of(user_payload(body)["messages"])
        self.asked.append(topic)
        if topic is None or topic in self.declines:
            return {"insight": None}
        return {"insight": self.replies.get(topic, f"The user keeps coming back to {topic}.")}
