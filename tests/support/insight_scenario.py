"""A synthetic user for insight tests: four topics of realistic messages, a few outliers, known dates.

Each topic has its own date span so that a test can check that an insight carries its cluster's range.
``NOW`` with the default 8-week window starts the window on 2026-02-03; ``OLD_MESSAGES`` lie before it.
"""

from __future__ import annotations

import dataclasses
import random
from datetime import UTC, datetime, timedelta

NOW = datetime(2026, 3, 31, 12, 0, tzinfo=UTC)


@dataclasses.dataclass(frozen=True)
class Topic:
    """Messages on one theme, sent evenly between ``start`` and ``end``."""

    name: str
    start: datetime
    end: datetime
    messages: tuple[str, ...]

    def times(self) -> list[datetime]:
        """When each message was sent."""
        last = max(len(self.messages) - 1, 1)
        return [self.start + (self.end - self.start) * i // last for i in range(len(self.messages))]


SOURDOUGH = Topic(
    "sourdough",
    datetime(2026, 2, 4, 8, tzinfo=UTC),
    datetime(2026, 3, 2, 8, tzinfo=UTC),
    (
        "My sourdough starter smells like nail polish remover, is it dead?",
        "How often should I feed a sourdough starter kept in the fridge?",
        "My sourdough loaf came out dense and gummy inside again",
        "What hydration should I use for an open crumb sourdough bread?",
        "Can I do the bulk fermentation of my sourdough dough overnight on the counter?",
        "Why does my sourdough bread spread flat when I turn it out of the banneton?",
        "Best flour for sourdough: bread flour or a bit of whole wheat?",
        "How do I get a better ear when scoring my sourdough loaf?",
        "Is a Dutch oven really necessary for baking sourdough bread?",
        "My sourdough starter doubles in 4 hours, is it ready to bake with?",
        "How long should the sourdough dough cold proof in the fridge?",
        "Sourdough crust too thick and hard, how do I make it thinner?",
        "Stretch and folds versus kneading for sourdough bread dough?",
        "Can I add rye flour to my sourdough starter to make it more active?",
        "My sourdough bread tastes too sour, how do I make it milder?",
    ),
)

RUNNING = Topic(
    "marathon",
    datetime(2026, 2, 10, 18, tzinfo=UTC),
    datetime(2026, 3, 28, 18, tzinfo=UTC),
    (
        "I'm training for my first marathon in May, how many long runs do I need?",
        "What pace should my easy runs be if my 10k race time is 50 minutes?",
        "My knee hurts after long runs, should I stop marathon training for a week?",
        "How many kilometres per week should I run during marathon training?",
        "What should I eat before a 30 km long run?",
        "Are energy gels necessary during a marathon race?",
        "How do I taper in the last three weeks before the marathon?",
        "Is it fine to run every day when training for a marathon?",
        "My running shoes have 700 km on them, time to replace them?",
        "How do interval sessions improve marathon race pace?",
        "What's a realistic marathon finish time for a first-time runner?",
        "Should I do strength training on my rest days from running?",
        "How do I avoid hitting the wall at kilometre 30 of the marathon?",
        "Tempo run versus threshold run, what's the difference?",
        "How much water should I drink during a long run in warm weather?",
    ),
)

KUBERNETES = Topic(
    "kubernetes",
    datetime(2026, 2, 3, 14, tzinfo=UTC),
    datetime(2026, 3, 25, 14, tzinfo=UTC),
    (
        "Our Kubernetes pods keep getting OOMKilled, how do I set memory limits?",
        "How do I roll back a bad deployment in Kubernetes?",
        "Why is my Kubernetes service not routing traffic to the pods?",
        "Helm chart versus Kustomize for managing our cluster manifests?",
        "How should I configure liveness and readiness probes for a Java app in Kubernetes?",
        "Our Kubernetes cluster autoscaler doesn't add nodes when pods are pending",
        "How do I give a pod access to secrets without putting them in the image?",
        "What's the right way to do zero-downtime deploys on Kubernetes?",
        "kubectl logs shows CrashLoopBackOff, how do I debug the container?",
        "Should we run Postgres inside Kubernetes or use a managed database?",
        "How do I set CPU requests for pods so the scheduler packs nodes well?",
        "Ingress controller returns 502 for our Kubernetes service, where to look?",
        "How do I limit which namespaces a Kubernetes service account can access?",
        "Horizontal pod autoscaler scaling on custom metrics from Prometheus?",
        "How to drain a Kubernetes node for maintenance without downtime?",
    ),
)

JAPANESE = Topic(
    "japanese",
    datetime(2026, 3, 1, 20, tzinfo=UTC),
    datetime(2026, 3, 30, 20, tzinfo=UTC),
    (
        "What's the difference between the Japanese particles wa and ga?",
        "How many kanji do I need to read a Japanese newspaper?",
        "Is it better to learn hiragana and katakana before starting kanji?",
        "How do I conjugate Japanese verbs into the te-form?",
        "When do I use keigo, polite Japanese, at work?",
        "Good Japanese podcasts for a beginner learner?",
        "How do I remember kanji readings, on'yomi and kun'yomi?",
        "What does the Japanese word 'natsukashii' mean exactly?",
        "How long does it take to pass the JLPT N4 Japanese exam?",
        "How do Japanese counters work for people, animals and flat objects?",
        "Is Anki with spaced repetition good for learning Japanese vocabulary?",
        "How do I say 'I have been studying Japanese for a year' in Japanese?",
        "Why does Japanese have three writing systems?",
        "What's the difference between the Japanese verbs iku and kuru?",
        "Tips for practising Japanese speaking without a tutor?",
    ),
)

TOPICS = (SOURDOUGH, RUNNING, KUBERNETES, JAPANESE)

OUTLIERS: tuple[tuple[str, datetime], ...] = (
    ("What is the capital of Mongolia?", datetime(2026, 2, 20, 9, tzinfo=UTC)),
    ("Convert 72 degrees Fahrenheit to Celsius", datetime(2026, 3, 5, 9, tzinfo=UTC)),
    ("Write a limerick about a cat who loves jazz", datetime(2026, 3, 12, 9, tzinfo=UTC)),
    ("Who painted the ceiling of the Sistine Chapel?", datetime(2026, 3, 20, 9, tzinfo=UTC)),
)

OLD_MESSAGES: tuple[tuple[str, datetime], ...] = tuple(
    (text, datetime(2025, 11, 10, 9, tzinfo=UTC) + timedelta(days=i))
    for i, text in enumerate(
        (
            "Which sourdough starter should I buy for a first try at bread?",
            "Is a sourdough loaf healthier than supermarket bread?",
            "How warm should my kitchen be for the sourdough dough to rise?",
            "Can I make sourdough pizza dough with the same starter?",
            "What is the float test for a sourdough starter?",
        )
    )
)


def user_messages() -> list[tuple[str, datetime, str]]:
    """Every in-window message as (text, sent at, topic name or "outlier"), topics first."""
    rows = [(text, at, topic.name) for topic in TOPICS for text, at in zip(topic.messages, topic.times(), strict=True)]
    return rows + [(text, at, "outlier") for text, at in OUTLIERS]


VOCABULARY: dict[str, tuple[str, ...]] = {
    "sourdough": ("sourdough", "starter", "loaf", "crumb", "flour", "dough", "proof", "bake", "crust", "oven"),
    "marathon": ("marathon", "run", "pace", "km", "taper", "shoes", "interval", "tempo", "race", "knee"),
    "kubernetes": ("kubernetes", "pod", "node", "helm", "ingress", "deploy", "cluster", "kubectl", "probe", "yaml"),
    "japanese": ("japanese", "kanji", "hiragana", "particle", "verb", "jlpt", "keigo", "katakana", "anki", "reading"),
    "guitar": ("guitar", "chord", "fret", "strum", "capo", "string", "amp", "riff", "scale", "pick"),
    "garden": ("garden", "tomato", "compost", "seed", "soil", "prune", "mulch", "weed", "bed", "water"),
}
FILLER = ("how", "do", "i", "my", "the", "is", "it", "what", "should", "why", "a", "for")


def synthetic_messages(topics: int, per_topic: int, seed: int = 0) -> list[tuple[str, str]]:
    """Bag-of-words messages for the hashing embedder: (text, topic), ``per_topic`` per topic."""
    rng = random.Random(seed)
    rows = []
    for name in list(VOCABULARY)[:topics]:
        for _ in range(per_topic):
            words = rng.sample(VOCABULARY[name], 5) + rng.sample(FILLER, 2)
            rng.shuffle(words)
            rows.append((" ".join(words), name))
    return rows


def synthetic_outliers(count: int, seed: int = 1) -> list[tuple[str, str]]:
    """Messages sharing no topic vocabulary: (text, "outlier")."""
    rng = random.Random(seed)
    return [(" ".join(f"zz{rng.randrange(10**6)}" for _ in range(6)), "outlier") for _ in range(count)]
