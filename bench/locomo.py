"""LoCoMo retrieval benchmark (``make bench-locomo``): the proxy's own read path, scored at turn level.

Each conversation of a file in LoCoMo's layout becomes one user's memories: every turn is a ``turn``
record ``"Speaker: text"`` (an image caption appended), dated by its session's date (turns 30 s apart, each
session its own conversation id), stored through the real ``MemoryStore`` (LanceDB + Tantivy in a temporary
directory) with the real embedder (batched). Every category 1-4 question with valid evidence (1,536 in
``locomo10.json``) goes through ``proxy.memory.read.retrieval.retrieve`` exactly as a chat request would (one
user message holding the question); its ranked list is ``result.candidates`` mapped to turn ids.

Variants run over the same stores in one pass: the arms alone, the fusion ablation chain, the default
configuration (``RetrievalSettings()``), the default with one of its parts switched off (``-entity``,
``-terms``, ``-neighbours``, ``-conversation``, ``-dates``, ``-days``, ``-recency``: each part's gain on tune
and on test), the seed's ``minmax`` scoring, and the default over richer memories of the same conversation:
``+turns`` (each turn embedded alone, as the writer did before it stored context vectors), ``+context`` when
the writer's layout is another (``WRITER_CORPUS``), ``+observations`` (the dataset's ``observation`` facts,
LLM-extracted per session and linked to their turns, also stored as facts: a hit on a fact counts as a hit on its linked
turns; this measures what write-time fact extraction adds without an LLM here), and both. ``product``
is the shipped configuration exactly (``RetrievalSettings()`` and ``InjectionSettings()``: turns of all time,
the recent messages, the 600-token budget) over turns with context vectors and observations standing in for
extracted facts; its ranking is what the memory block would hold, best first (so at most a few items: its @10
figures are "in the block"). ``product-<part>`` undoes one part of the block and ``product+<part>`` adds an
option (``PRODUCT_ABLATIONS``: the former 14-day turn window, the repeat check, ``max_past`` 12); ``product,
turns only`` is the block of a user without facts (the held-out chats' shape). Named explicitly
(``default_variants``), ``product+summaries`` adds the dataset's session summaries as the summariser's, of all
time or standing in for their turns past a 14-day window.

``answer_words`` is the share of the reference answer's content words (stems) found in the texts a variant
returns: the block's items as injected (excerpts included), else the first 10 memories. The turn-level
metrics cannot see what an item kept (a fact counts as a hit on its turns, an excerpt as its whole memory), so
a change that makes items shorter or swaps a turn for a fact must not lower it. Dates live in the items' heads,
so temporal answers ("7 May 2023") score low on it everywhere.

The clock (``--clock``): ``dataset`` (the default) is the product as it runs: every memory is created and last
accessed at its own session's date, and each question is asked one day after its own conversation's last
session, so recency and the turn window see the dataset's real spread of weeks and months. ``neutral`` is the
earlier measurement: every memory last accessed at the retrieval clock (one day after the last session of
all conversations), so the ``minmax`` recency term is constant across candidates; the default scoring ages
memories from their creation, so for it the two clocks differ only by the retrieval time. Importance is the
store's default 5 for every memory (the dataset has no ratings), so ``importance_bonus`` cannot be measured
here. Subjects: the memories with facts also hold the subject records the write path would create for them
(``proxy.memory.write.subjects``); LoCoMo's observations name only their speaker, so a conversation has two
subjects, each linked to all of one speaker's facts: subject fusion can only favour the facts of the speaker
a question names (``+context+observations+subject fusion`` measures that at its former weight 0.4; it is off
by default), and the chain's ``+subjects`` step, over turns alone, has no subjects to use.

``dense+adapter`` and ``default+adapter`` pass the dense arm's query through a per-user query adapter (seed 001),
fitted per conversation on pairs the conversation itself yields (``locomo_adapter``; never the questions or their
evidence) and used only when it beats no adapter on that conversation's newest pairs, as the product ships it.

Neutralised for every variant but ``product``: any window of past turns (``turn_window_days=None``, also the
default: the dataset spans months, and the questions ask about all of it), and the parts that never change the
ranking (``recent_messages=0``, ``max_insights=0``, arm timeouts of 60 s so that a busy machine does not
degrade an arm).

Numbers are tuned on conversations 0-4 ("tune") and reported on 5-9 ("test") and all ten. Each question's
embedding is computed once and reused by every variant; embeddings are cached on disk by text (``--cache``).
Prints a table and writes ``bench/results/locomo.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hashlib
import json
import os
import platform
import re
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.locomo_adapter import Fitted, fit_conversation, said_of
from proxy.evaluation import dia_ids, question_metrics, session_date
from proxy.memory.embedders.factory import build_embedder
from proxy.memory.embedders.protocol import Embedder, Vectors
from proxy.memory.embedders.settings import EmbedderSettings
from proxy.memory.pieces import TermVectors, term_vectors_of
from proxy.memory.query_adapter import QueryAdapter
from proxy.memory.read.injection import inject
from proxy.memory.read.read_cache import ReadCache
from proxy.memory.read.retrieval import retrieve
from proxy.memory.read.retrieval_settings import InjectionSettings, RetrievalSettings
from proxy.memory.store.memory_store import MemoryStore, StoreSettings
from proxy.memory.store.records import Kind, MemoryRecord
from proxy.memory.words import stems, terms
from proxy.memory.write.settings import WriterSettings
from proxy.memory.write.subjects import new_subject, relinked, subject_names
from proxy.memory.write.turns import context_vector

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get("LOCOMO_DATA", ROOT.parent / "shared" / "data" / "locomo" / "locomo10.json"))
RESULTS = ROOT / "bench" / "results" / "locomo.json"
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "memproxy" / "locomo-embeddings"
CATEGORIES = {1: "multi-hop", 2: "temporal", 3: "open-domain", 4: "single-hop"}
TUNE, TEST = range(5), range(5, 10)
CLOCKS = ("dataset", "neutral")
TURN_SPACING = timedelta(seconds=30)
ID_NAMESPACE = uuid.UUID("1b4e28ba-2fa1-11d2-883f-0016d3cca427")
CONTEXT_WEIGHT = WriterSettings().context_weight
# The product's model; two threads and small batches (sorted by length, so they pad little) embed the corpus
# fastest here. Only bulk embedding uses them: the store gets vectors, and questions are embedded up front.
EMBEDDER = EmbedderSettings(threads=os.cpu_count() or 1, batch_size=16)
HARNESS = {"turn_window_days": None, "recent_messages": 0, "max_insights": 0, "arm_timeout_ms": 60_000.0}
METRICS = ("evidence_recall@5", "evidence_recall@10", "hit@1", "hit@5", "hit@10", "all@10", "mrr", "answer_words")


# --- the dataset ------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Turn:
    """One dialog turn: its id (``D<session>:<turn>``), speaker, text, image caption and time."""

    dia_id: str
    speaker: str
    text: str
    caption: str | None
    at: datetime
    session: int

    @property
    def memory_text(self) -> str:
        """What the user's memory holds: ``"Speaker: text"``, the image caption appended."""
        shared = f" [shared an image: {self.caption}]" if self.caption else ""
        return f"{self.speaker}: {self.text}{shared}"


@dataclass(frozen=True, slots=True)
class Observation:
    """An LLM-extracted fact of one session, about one speaker, linked to the turns it came from."""

    text: str
    speaker: str
    dia_ids: tuple[str, ...]
    at: datetime
    session: int


@dataclass(frozen=True, slots=True)
class SessionSummary:
    """The dataset's summary of one session (``session_<n>_summary``)."""

    session: int
    text: str


@dataclass(frozen=True, slots=True)
class Question:
    """A category 1-4 question, its (normalised, non-empty) evidence turns and its reference answer."""

    text: str
    category: int
    evidence: tuple[str, ...]
    answer: str = ""


@dataclass(frozen=True, slots=True)
class Conversation:
    """One LoCoMo sample (``index``: its position in the file): its turns, observations and questions."""

    index: int
    sample_id: str
    turns: tuple[Turn, ...]
    observations: tuple[Observation, ...]
    questions: tuple[Question, ...]
    summaries: tuple[SessionSummary, ...] = ()


_SESSION = re.compile(r"^session_(\d+)$")


def _sessions(conversation: Mapping[str, Any]) -> list[int]:
    """Session numbers that have turns, in numeric order."""
    return sorted(int(m.group(1)) for key in conversation if (m := _SESSION.match(key)))


def _turns(conversation: Mapping[str, Any]) -> list[Turn]:
    """Every turn, in order, timed from its session's date."""
    out = []
    for n in _sessions(conversation):
        start = session_date(conversation[f"session_{n}_date_time"])
        for i, raw in enumerate(conversation[f"session_{n}"]):
            caption = raw.get("blip_caption") or None
            out.append(Turn(raw["dia_id"], raw["speaker"], raw["text"], caption, start + i * TURN_SPACING, n))
    return out


def _observations(sample: Mapping[str, Any], turns: Sequence[Turn]) -> list[Observation]:
    """The sample's observation facts that link to at least one existing turn."""
    starts = {t.session: t.at for t in turns if t.dia_id.endswith(":1")}
    existing = [t.dia_id for t in turns]
    out = []
    for key, by_speaker in sample.get("observation", {}).items():
        session = int(re.findall(r"\d+", key)[0])
        for speaker, facts in by_speaker.items():
            for text, raw_ids in facts:
                linked = dia_ids(raw_ids, existing)
                if linked and session in starts:
                    out.append(Observation(text, speaker, linked, starts[session], session))
    return out


def _questions(sample: Mapping[str, Any], turns: Sequence[Turn]) -> list[Question]:
    """Category 1-4 questions with at least one valid evidence turn."""
    existing = [t.dia_id for t in turns]
    out = []
    for qa in sample["qa"]:
        if qa["category"] in CATEGORIES:
            evidence = dia_ids(qa.get("evidence", []), existing)
            if evidence:
                out.append(Question(qa["question"], int(qa["category"]), evidence, str(qa.get("answer", ""))))
    return out


def load_conversations(path: Path) -> list[Conversation]:
    """Every sample of a file in LoCoMo's layout."""
    samples = json.loads(path.read_text())
    out = []
    for index, sample in enumerate(samples):
        turns = _turns(sample["conversation"])
        obs, questions = _observations(sample, turns), _questions(sample, turns)
        summaries = _summaries(sample, turns)
        out.append(Conversation(index, sample["sample_id"], tuple(turns), tuple(obs), tuple(questions), summaries))
    return out


def _summaries(sample: Mapping[str, Any], turns: Sequence[Turn]) -> tuple[SessionSummary, ...]:
    """The sample's session summaries of sessions that have turns, in session order."""
    sessions = {t.session for t in turns}
    found = ((int(re.findall(r"\d+", key)[0]), text) for key, text in sample.get("session_summary", {}).items())
    return tuple(SessionSummary(n, str(text)) for n, text in sorted(found) if n in sessions and text)


# --- metrics (pure) ---------------------------------------------------------------------------------------


def answer_words(answer: str, texts: Iterable[str]) -> float:
    """The share of the answer's content words (stems) that ``texts`` hold (1 for an answer without any).

    A check the turn-level metrics cannot make: a fact counts as a hit on its turns and an excerpt as a hit on
    its memory whatever they kept, so a block that cuts its items shorter scores higher on R@10 while holding
    less of what answers the question."""
    wanted = stems(" ".join(terms(answer)))
    if not wanted:
        return 1.0
    return len(wanted & stems(" ".join(terms(" ".join(texts))))) / len(wanted)


def ranked_turns(ids: Sequence[str], turns_of: Mapping[str, Sequence[str]]) -> list[str]:
    """A question's ranking as turn ids: each memory's turns (a fact's linked turns), first occurrence kept."""
    ranked: dict[str, None] = {}
    for rid in ids:
        ranked.update(dict.fromkeys(d for d in turns_of.get(rid, ()) if d not in ranked))
    return list(ranked)


@dataclass(frozen=True, slots=True)
class Row:
    """One question's metrics under one variant, with where it came from."""

    conversation: int
    category: int
    metrics: Mapping[str, float]


def mean_metrics(rows: Sequence[Row]) -> dict[str, float]:
    """Per-question averages of every metric (4 decimals) and the number of questions ``n``."""
    out: dict[str, float] = {
        m: round(statistics.fmean(r.metrics[m] for r in rows), 4) if rows else 0.0 for m in METRICS
    }
    out["n"] = len(rows)
    return out


def summarise(rows: Sequence[Row]) -> dict[str, Any]:
    """Overall, by category, tune (conversations 0-4) and test (5-9) averages of one variant's rows."""
    by_category = {
        f"{c} {name}": mean_metrics([r for r in rows if r.category == c])
        for c, name in CATEGORIES.items()
        if any(r.category == c for r in rows)
    }
    return {
        "overall": mean_metrics(rows),
        "by_category": by_category,
        "tune": mean_metrics([r for r in rows if r.conversation in TUNE]),
        "test": mean_metrics([r for r in rows if r.conversation in TEST]),
    }


# --- variants ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Variant:
    """A named read-path configuration and the memories it searches (turns only, or turns and facts).

    ``block``: rank what the memory block would hold (``inject`` under ``injection``), not every candidate.
    ``adapter``: the dense arm's query goes through the conversation's query adapter (``locomo_adapter``), when
    one was kept.
    """

    name: str
    settings: RetrievalSettings
    corpus: str = "turns"
    block: bool = False
    injection: InjectionSettings = field(default_factory=InjectionSettings)
    adapter: bool = False


_OFF = {
    "entity_k": 0,
    "gating": False,
    "subject_weight": 0.0,
    "term_match_weight": 0.0,
    "neighbour_weight": 0.0,
    "conversation_weight": 0.0,
    "date_weight": 0.0,
    "day_weight": 0.0,
}


def harness_settings(**changes: Any) -> RetrievalSettings:
    """``RetrievalSettings()`` with the harness's neutralisations (``HARNESS``) and ``changes``."""
    return RetrievalSettings().model_copy(update={**HARNESS, **changes})


def variants() -> list[Variant]:
    """Every variant of one run: arms alone, the ablation chain to the default, and the default over richer memories.

    The chain adds one step at a time to the default fusion weights: the entity arm, subject fusion, term
    matching, neighbour smoothing, the conversation lift, then the date boosts (= the default). ``+gating`` is a
    branch (the entity step with keyword gating on), since the default leaves gating off. ``+context``,
    ``+observations`` and ``+context+observations`` run the default over other memories of the same conversation
    (see ``corpora``).
    """
    base = RetrievalSettings()
    entity = {**_OFF, "entity_k": base.entity_k}
    subjects = {**entity, "subject_weight": SUBJECT_WEIGHT}
    terms = {**subjects, "term_match_weight": base.term_match_weight}
    steps: list[tuple[str, dict[str, Any]]] = [
        ("bm25", {**_OFF, "dense_weight": 0.0, "bm25_weight": 1.0}),
        ("dense", {**_OFF, "dense_weight": 1.0, "bm25_weight": 0.0}),
        ("rrf", {**_OFF, "fusion": "rrf"}),
        ("weighted 0.8/0.1", {**_OFF, "dense_weight": 0.8, "bm25_weight": 0.1}),
        ("weighted", _OFF),
        ("weighted+entity", entity),
        ("+gating", {**entity, "gating": True}),
        ("+subjects", subjects),
        ("+terms", terms),
        ("+neighbours", {**terms, "neighbour_weight": base.neighbour_weight}),
        (
            "+conversation",
            {**terms, "neighbour_weight": base.neighbour_weight, "conversation_weight": base.conversation_weight},
        ),
        ("default", {}),
    ]
    out = [Variant(name, harness_settings(**changes), corpus=WRITER_CORPUS) for name, changes in steps]
    out += [Variant(name, harness_settings(**changes), corpus=WRITER_CORPUS) for name, changes in ABLATIONS.items()]
    out += [Variant(f"+{corpus}", harness_settings(), corpus=corpus) for corpus in CORPORA if corpus != WRITER_CORPUS]
    # Parts that act on facts only (recency) or on names that facts carry (entity): measured where facts exist.
    out += [Variant(f"+context+observations{name}", harness_settings(**ABLATIONS[name]), corpus="context+observations")
            for name in ("-recency", "-entity")]  # fmt: skip
    out.append(
        Variant(
            "+context+observations+subject fusion",
            harness_settings(subject_weight=SUBJECT_WEIGHT),
            corpus="context+observations",
        )
    )
    out.append(Variant("product", RetrievalSettings(), corpus="context+observations", block=True))
    out += [Variant(f"product{name}", RetrievalSettings(**changes), corpus="context+observations", block=True,
                    injection=InjectionSettings(**injection))
            for name, (changes, injection) in PRODUCT_ABLATIONS.items()]  # fmt: skip
    out.append(Variant("product, turns only", RetrievalSettings(), corpus=WRITER_CORPUS, block=True))
    window = RetrievalSettings(turn_window_days=14.0, turns_past_window="none")  # the former 14-day window
    out.append(Variant("product, turns only-all time", window, corpus=WRITER_CORPUS, block=True))
    out.append(Variant("product, turns only-past 12", RetrievalSettings(max_past=6), corpus=WRITER_CORPUS, block=True))
    tighter = InjectionSettings(max_item_tokens=45)  # more items, less of each (tried, not kept)
    out.append(Variant("product, turns only, 45-token items", RetrievalSettings(), WRITER_CORPUS, True, tighter))
    # The dataset's session summaries as the summariser's: all time (the default), and standing in for the turns
    # they tell past a 14-day window (a summary counts as a hit on no turn; see ``answer_words``). Run only when
    # named (``default_variants``).
    summarised = "context+observations+summaries"
    out.append(Variant("product+summaries", RetrievalSettings(), corpus=summarised, block=True))
    stand_in = RetrievalSettings(turn_window_days=14.0)
    out.append(Variant("product+summaries, 14-day window", stand_in, corpus=summarised, block=True))
    # The per-user query adapter (seed 001), fitted per conversation on pairs the conversation yields.
    out.append(Variant("dense+adapter", harness_settings(**dict(steps)["dense"]), corpus=WRITER_CORPUS, adapter=True))
    out.append(Variant("default+adapter", harness_settings(), corpus=WRITER_CORPUS, adapter=True))
    return out


# The shipped block with one of its parts undone: each part's gain (product minus this) on tune and on test.
PRODUCT_ABLATIONS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "-all time": ({"turn_window_days": 14.0, "turns_past_window": "none"}, {}),  # the former 14-day turn window
    "+repeats dropped": ({}, {"drop_repeated": True}),  # an option, off: see docs/tuning.md
    "-past 12": ({"max_past": 6}, {}),
}


def default_variants() -> list[Variant]:
    """The variants of a run that names none: all but those over the summaries corpus, whose summaries would
    change the keyword index's word statistics (shared by every harness user) and so every other figure."""
    return [v for v in variants() if "summaries" not in v.corpus]


SUBJECT_WEIGHT = 0.4  # subject fusion's weight before it was measured with subjects present (now off by default)
# The default with one part off: each part's gain (default minus this) on tune and on test.
ABLATIONS: dict[str, dict[str, Any]] = {
    "-entity": {"entity_k": 0, "entity_weight": 0.0},
    "-terms": {"term_match_weight": 0.0},
    "-neighbours": {"neighbour_weight": 0.0},
    "-conversation": {"conversation_weight": 0.0},
    "-dates": {"date_weight": 0.0},
    "-days": {"day_weight": 0.0},
    "-recency": {"recency_bonus": 0.0},
    "minmax": {"scoring": "minmax"},
}


# --- memories ---------------------------------------------------------------------------------------------


def record_id(user_id: str, key: str) -> str:
    """A stable record id for one turn or fact of one harness user."""
    return uuid.uuid5(ID_NAMESPACE, f"{user_id}/{key}").hex


@dataclass(frozen=True, slots=True)
class Corpus:
    """One harness user's records (vectors set) and the turns each record stands for."""

    user_id: str
    records: list[MemoryRecord]
    turns_of: dict[str, tuple[str, ...]]


def turn_records(user_id: str, conv: Conversation, vectors: Vectors, accessed: datetime | None) -> list[MemoryRecord]:
    """The conversation's turns as one user's turn records (speaker A as ``user``, B as ``assistant``), last
    accessed at ``accessed`` (None: when created)."""
    first = conv.turns[0].speaker if conv.turns else ""
    return [
        MemoryRecord(user_id=user_id, kind=Kind.TURN, text=t.memory_text, id=record_id(user_id, t.dia_id),
                     created_at=t.at, last_accessed_at=accessed or t.at, embedding=vectors[i],
                     conversation_id=f"{conv.sample_id}:session_{t.session}",
                     role="user" if t.speaker == first else "assistant")
        for i, t in enumerate(conv.turns)
    ]  # fmt: skip


def fact_records(user_id: str, conv: Conversation, vectors: Vectors, accessed: datetime | None) -> list[MemoryRecord]:
    """The conversation's observations as facts: the speaker as entity, the linked turns' record ids as sources (as the
    writer links a fact to the turns it was drawn from)."""
    return [
        MemoryRecord(user_id=user_id, kind=Kind.FACT, text=o.text, id=record_id(user_id, f"fact{i}"),
                     created_at=o.at + timedelta(microseconds=i),
                     last_accessed_at=accessed or o.at + timedelta(microseconds=i),
                     embedding=vectors[i], conversation_id=f"{conv.sample_id}:session_{o.session}",
                     entities=(o.speaker,), source_ids=tuple(record_id(user_id, d) for d in o.dia_ids))
        for i, o in enumerate(conv.observations)
    ]  # fmt: skip


CORPORA = ("turns", "context", "observations", "context+observations", "context+observations+summaries")
# The memories as the product's writer stores them: turns with context vectors (``WriterSettings.context_weight``),
# so that the default and the chain measure the product.
WRITER_CORPUS = "context"


def corpora(
    conv: Conversation, vectors: Mapping[str, Vectors], accessed: datetime | None, names: Iterable[str] = CORPORA
) -> dict[str, Corpus]:
    """The harness users of one conversation, one per memory layout (``CORPORA``).

    ``turns``: the turns, each embedded alone. ``context``: the same turns' vectors mixed with their session's
    previous turn's (``context_vectors``, what the writer stores). ``observations``: the turns and the
    dataset's observation facts. ``context+observations``: both. ``+summaries``: and the dataset's session
    summaries as the summariser's (``summary_records``), which count as a hit on no turn.
    """
    out = {}
    for name in names:
        user_id = f"{conv.sample_id}-{name.replace('+', '-')}"
        turn_vectors = vectors["context" if name.startswith("context") else "turns"]
        turns = turn_records(user_id, conv, turn_vectors, accessed)
        turns_of = {r.id: (t.dia_id,) for r, t in zip(turns, conv.turns, strict=True)}
        facts = fact_records(user_id, conv, vectors["facts"], accessed) if "observations" in name else []
        turns_of.update({r.id: o.dia_ids for r, o in zip(facts, conv.observations[: len(facts)], strict=True)})
        summaries = summary_records(user_id, conv, vectors["summaries"]) if "summaries" in name else []
        out[name] = Corpus(user_id, turns + facts + subject_records(facts) + summaries, turns_of)
    return out


def summary_records(user_id: str, conv: Conversation, vectors: Vectors) -> list[MemoryRecord]:
    """The session summaries as the summariser stores a conversation's summary: spanning the session's turns,
    created at its last, linked to them."""
    out = []
    for i, summary in enumerate(conv.summaries):
        told = [t for t in conv.turns if t.session == summary.session]
        out.append(MemoryRecord(user_id=user_id, kind=Kind.SUMMARY, text=summary.text,
                                id=record_id(user_id, f"summary{summary.session}"), created_at=told[-1].at,
                                start_at=told[0].at, end_at=told[-1].at, embedding=vectors[i],
                                conversation_id=f"{conv.sample_id}:session_{summary.session}",
                                source_ids=tuple(record_id(user_id, t.dia_id) for t in told)))  # fmt: skip
    return out


def subject_records(facts: Sequence[MemoryRecord]) -> list[MemoryRecord]:
    """The subjects the write path would keep for these facts (``proxy.memory.write.subjects``), embedded."""
    by_name: dict[str, MemoryRecord] = {}
    for fact in facts:
        for name in subject_names(fact).values():
            known = by_name.get(name)
            by_name[name] = (
                new_subject(fact, name) if known is None else known.replace(source_ids=relinked(known, add=fact.id))
            )
    return list(by_name.values())


def context_vectors(turns: Sequence[Turn], own: Vectors, weight: float = CONTEXT_WEIGHT) -> Vectors:
    """Turn vectors that carry the previous turn of their session, as the writer stores them
    (``writer.context_vector``; a session's first turn: the turn alone)."""
    previous = np.zeros_like(own)
    for i in range(1, len(turns)):
        if turns[i - 1].session == turns[i].session:
            previous[i] = own[i - 1]
    return context_vector(own, previous, weight)


# --- embeddings -------------------------------------------------------------------------------------------


class VectorCache:
    """Embeddings by text, persisted per model under ``directory`` (None: memory only)."""

    def __init__(self, embedder: Embedder, directory: Path | None) -> None:
        self._embedder = embedder
        weights = getattr(embedder, "weights_id", embedder.model_id)  # int8 and fp32 share a space, not vectors
        slug = re.sub(r"[^A-Za-z0-9._-]+", "_", weights)
        self._path = directory / f"{slug}.npz" if directory else None
        self._vectors: dict[str, npt.NDArray[np.float32]] = {}
        if self._path is not None and self._path.exists():
            with np.load(self._path) as saved:
                self._vectors = dict(zip(saved["keys"].tolist(), saved["vectors"], strict=True))
        self.computed = 0

    @staticmethod
    def _key(text: str) -> str:
        return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()

    async def embed(self, texts: Sequence[str], progress: str) -> Vectors:
        """One unit row per text: cached ones as stored, the rest embedded in batches (with a progress bar)."""
        missing = list(dict.fromkeys(t for t in texts if self._key(t) not in self._vectors))
        with tqdm(total=len(missing), desc=progress, unit="text", file=sys.stderr, disable=not missing) as bar:
            for start in range(0, len(missing), 256):
                chunk = missing[start : start + 256]
                rows = await self._embedder.embed_documents(chunk)
                self._vectors.update((self._key(t), row) for t, row in zip(chunk, rows, strict=True))
                bar.update(len(chunk))
        self.computed += len(missing)
        if not texts:
            return np.zeros((0, self._embedder.dim), dtype=np.float32)
        return np.stack([self._vectors[self._key(t)] for t in texts])

    async def embed_queries(self, texts: Sequence[str]) -> Vectors:
        """Questions as the read path embeds them: on the embedder's own query side when it has one (uncached)."""
        if getattr(self._embedder, "query_model_id", None) is None:
            return await self.embed(texts, "embed questions")
        return await self._embedder.embed_queries(texts)  # type: ignore[attr-defined, no-any-return]

    def save(self) -> None:
        """Write the cache (when it has a directory and something new was computed)."""
        if self._path is None or not self.computed:
            return
        self._path.parent.mkdir(parents=True, exist_ok=True)
        keys = np.array(list(self._vectors), dtype=str)
        tmp = self._path.with_suffix(".tmp.npz")
        np.savez(tmp, keys=keys, vectors=np.stack(list(self._vectors.values())))
        os.replace(tmp, self._path)


class PrecomputedQueries:
    """An ``Embedder`` whose ``embed_query`` answers from precomputed vectors (else asks the real one)."""

    def __init__(self, embedder: Embedder, queries: Mapping[str, npt.NDArray[np.float32]]) -> None:
        self._embedder = embedder
        self._queries = dict(queries)

    @property
    def model_id(self) -> str:
        return self._embedder.model_id

    @property
    def dim(self) -> int:
        return self._embedder.dim

    async def embed_documents(self, texts: Sequence[str]) -> Vectors:
        return await self._embedder.embed_documents(texts)

    async def embed_query(self, text: str) -> Vectors:
        found = self._queries.get(text)
        return found if found is not None else await self._embedder.embed_query(text)

    def term_vectors(self) -> TermVectors | None:
        return term_vectors_of(self._embedder)


# --- the run ----------------------------------------------------------------------------------------------


@dataclass
class Run:
    """Per-variant rows, degraded-arm counts and timings of one benchmark run."""

    rows: dict[str, list[Row]] = field(default_factory=dict)
    degraded: dict[str, int] = field(default_factory=dict)
    retrieve_ms: dict[str, list[float]] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    adapters: dict[str, dict[str, Any]] = field(default_factory=dict)  # per conversation: its fit's figures


async def _embed_all(
    conversations: Sequence[Conversation], cache: VectorCache, corpora_needed: set[str], adapter: bool = False
) -> tuple[list[dict[str, Vectors]], dict[str, npt.NDArray[np.float32]]]:
    """Vectors of every turn (alone and with context, if needed), observation (if needed) and question, and
    (``adapter``) every turn's words embedded as a query."""
    turns = [t.memory_text for c in conversations for t in c.turns]
    want_context = any(name.startswith("context") for name in corpora_needed)
    want_facts = any("observations" in name for name in corpora_needed)
    want_summaries = any("summaries" in name for name in corpora_needed)
    facts = [o.text for c in conversations for o in c.observations] if want_facts else []
    summaries = [s.text for c in conversations for s in c.summaries] if want_summaries else []
    questions = list(dict.fromkeys(q.text for c in conversations for q in c.questions))
    turn_vectors = await cache.embed(turns, "embed turns")
    fact_vectors = await cache.embed(facts, "embed observations")
    summary_vectors = await cache.embed(summaries, "embed summaries")
    question_vectors = await cache.embed_queries(questions)
    said = [s.text for c in conversations for s in said_of(c.turns)[0]] if adapter else []
    said_vectors = await cache.embed_queries(said) if said else np.zeros((0, 1), dtype=np.float32)
    out, t0, f0, s0 = [], 0, 0, 0
    for c in conversations:
        t1, f1 = t0 + len(c.turns), f0 + (len(c.observations) if want_facts else 0)
        s1 = s0 + (len(c.summaries) if want_summaries else 0)
        own = turn_vectors[t0:t1]
        context = context_vectors(c.turns, own) if want_context else own
        out.append({"turns": own, "context": context, "facts": fact_vectors[f0:f1],
                    "summaries": summary_vectors[s0:s1], "said": said_vectors[t0:t1]})  # fmt: skip
        t0, f0, s0 = t1, f1, s1
    return out, dict(zip(questions, question_vectors, strict=True))


async def _ask(
    store: MemoryStore,
    embedder: Embedder,
    corpus: Corpus,
    question: Question,
    variant: Variant,
    now: datetime,
    cache: ReadCache,
    run: Run,
    adapter: QueryAdapter | None = None,
) -> tuple[list[str], float]:
    """One question through the proxy's read path under one variant: its ranked turn ids, and the share of the
    answer's words its texts hold (the block's items as injected; else the first 10 memories)."""
    messages = [{"role": "user", "content": question.text}]
    started = time.perf_counter()
    adapter = adapter if variant.adapter else None
    result = await retrieve(
        store, embedder, messages, corpus.user_id, variant.settings, now, names=cache, adapter=adapter
    )
    run.retrieve_ms.setdefault(variant.name, []).append((time.perf_counter() - started) * 1000)
    if result.degraded:
        run.degraded[variant.name] = run.degraded.get(variant.name, 0) + 1
    if variant.block:
        query_terms = result.query.terms if result.query else ()
        block = sorted(inject(messages, result.items, query_terms, variant.injection).items, key=lambda i: -i.score)
        words = answer_words(question.answer, (i.text for i in block))
        return ranked_turns([i.id for i in block], corpus.turns_of), words
    words = answer_words(question.answer, (c.record.text for c in result.candidates[:10]))
    return ranked_turns([c.id for c in result.candidates], corpus.turns_of), words


async def _conversation(
    store: MemoryStore,
    embedder: Embedder,
    conv: Conversation,
    users: Mapping[str, Corpus],
    chosen: Sequence[Variant],
    now: datetime,
    run: Run,
    bar: tqdm,
    adapter: QueryAdapter | None = None,
) -> None:
    """Ingest one conversation's users, then ask every question under every variant (``adapter``: the
    conversation's query adapter, for the variants that use one)."""
    needed = {v.corpus for v in chosen}
    for name in needed:
        await store.add(users[name].records)
    cache = ReadCache(ttl_s=1e9, recent_ttl_s=1e9)
    for question in conv.questions:
        for variant in chosen:
            ranked, words = await _ask(
                store, embedder, users[variant.corpus], question, variant, now, cache, run, adapter
            )
            metrics = {**question_metrics(ranked, question.evidence), "answer_words": words}
            row = Row(conv.index, question.category, metrics)
            run.rows.setdefault(variant.name, []).append(row)
        bar.update(1)


def clock(conversations: Sequence[Conversation], conv: Conversation, name: str) -> tuple[datetime, datetime | None]:
    """When ``conv``'s questions are asked, and when its memories were last accessed (None: when created).

    ``dataset``: one day after the conversation's own last session, memories accessed when created.
    ``neutral``: one day after the last session of all ``conversations``, every memory accessed then.
    """
    fallback = datetime(2024, 1, 1, tzinfo=UTC)
    if name == "dataset":
        return max((t.at for t in conv.turns), default=fallback) + timedelta(days=1), None
    now = max((t.at for c in conversations for t in c.turns), default=fallback) + timedelta(days=1)
    return now, now


async def run_benchmark(
    conversations: Sequence[Conversation],
    embedder: Embedder,
    chosen: Sequence[Variant],
    workdir: Path,
    cache_dir: Path | None = None,
    clock_name: str = "dataset",
) -> Run:
    """Embed, ingest and ask everything under one clock (``CLOCKS``); the per-variant rows of every question."""
    run = Run()
    started = time.perf_counter()
    vectors = VectorCache(embedder, cache_dir)
    wants_adapter = any(v.adapter for v in chosen)
    per_conversation, queries = await _embed_all(conversations, vectors, {v.corpus for v in chosen}, wants_adapter)
    vectors.save()
    run.seconds["embed"] = round(time.perf_counter() - started, 1)
    run.seconds["texts_embedded"] = vectors.computed
    asking = PrecomputedQueries(embedder, queries)
    total = sum(len(c.questions) for c in conversations)
    started = time.perf_counter()
    async with MemoryStore(StoreSettings(path=workdir / "store"), embedder) as store:
        with tqdm(total=total, desc="questions", unit="q", file=sys.stderr) as bar:
            for i, conv in enumerate(conversations):
                now, accessed = clock(conversations, conv, clock_name)
                users = corpora(conv, per_conversation[i], accessed, {v.corpus for v in chosen})
                adapter = _fit_adapter(conv, per_conversation[i], embedder.model_id, run) if wants_adapter else None
                await _conversation(store, asking, conv, users, chosen, now, run, bar, adapter)
    run.seconds["ingest_and_retrieve"] = round(time.perf_counter() - started, 1)
    return run


def _fit_adapter(conv: Conversation, vectors: Mapping[str, Vectors], model_id: str, run: Run) -> QueryAdapter | None:
    """The conversation's query adapter (None: none beat no adapter), its figures noted in ``run``."""
    started = time.perf_counter()
    bank = vectors["context" if WRITER_CORPUS.startswith("context") else "turns"]
    fitted: Fitted = fit_conversation(conv.turns, bank, vectors["said"], model_id)
    run.adapters[conv.sample_id] = {
        "pairs": fitted.pairs,
        "held_out_mrr": round(fitted.held_out, 4),
        "baseline_mrr": round(fitted.baseline, 4),
        "epochs": fitted.epochs,
        "kept": fitted.adapter is not None,
        "fit_s": round(time.perf_counter() - started, 2),
    }
    return fitted.adapter


# --- report -----------------------------------------------------------------------------------------------


def report(run: Run, chosen: Sequence[Variant], meta: Mapping[str, Any]) -> dict[str, Any]:
    """The ``locomo.json`` document."""
    out: dict[str, Any] = {"default_variant": "default", "variants": {}, "meta": dict(meta)}
    if run.adapters:
        out["meta"]["adapters"] = run.adapters
    for variant in chosen:
        summary = summarise(run.rows.get(variant.name, []))
        timings = run.retrieve_ms.get(variant.name, [0.0])
        summary["retrieve_ms_p50"] = round(statistics.median(timings), 2)
        summary["degraded_questions"] = run.degraded.get(variant.name, 0)
        summary["corpus"] = variant.corpus
        summary["settings"] = variant.settings.model_dump(mode="json")
        out["variants"][variant.name] = summary
    return out


def table(document: Mapping[str, Any]) -> str:
    """The printed table: per variant, all ten conversations, then R@10 / MRR on tune and test."""
    head = (
        f"{'variant':<32}{'R@5':>7}{'R@10':>7}{'hit@1':>7}{'hit@5':>7}{'hit@10':>7}{'all@10':>7}{'MRR':>7}{'words':>7}"
        f"{'tune R@10':>10}{'tune MRR':>9}{'test R@10':>10}{'test MRR':>9}"
    )
    lines = [head, "-" * len(head)]
    for name, v in document["variants"].items():
        o, tu, te = v["overall"], v["tune"], v["test"]
        cells = "".join(f"{o[m]:>7.3f}" for m in METRICS)
        lines.append(
            f"{name:<32}{cells}{tu['evidence_recall@10']:>10.3f}{tu['mrr']:>9.3f}"
            f"{te['evidence_recall@10']:>10.3f}{te['mrr']:>9.3f}"
        )
    default = document["variants"].get(document["default_variant"])
    if default:
        lines += ["", f"default by category ({', '.join(METRICS)}):"]
        for name, c in default["by_category"].items():
            lines.append(f"  {name:<14} n={c['n']:<4} " + " ".join(f"{c[m]:.3f}" for m in METRICS))
    return "\n".join(lines)


CLOCK_NOTES = {
    "dataset": "the dataset's own clock: every record created and last accessed at its session's date; each "
    "question asked one day after its own conversation's last session; importance 5 for all",
    "neutral": "neutralised: every record's last_accessed_at equals the retrieval clock (one day after the last "
    "session of all conversations), so the minmax recency term is constant; importance 5 for all",
}


def _meta(
    args: argparse.Namespace, conversations: Sequence[Conversation], run: Run, embedder: Embedder
) -> dict[str, Any]:
    return {
        "data": str(args.data),
        "conversations": [c.sample_id for c in conversations],
        "questions": sum(len(c.questions) for c in conversations),
        "turns": sum(len(c.turns) for c in conversations),
        "observations": sum(len(c.observations) for c in conversations),
        "embedder": getattr(embedder, "weights_id", embedder.model_id),
        "embedder_space": embedder.model_id,
        "embedder_runtime": {"threads": EMBEDDER.threads, "batch_size": EMBEDDER.batch_size},
        "embedder_query": getattr(embedder, "query_model_id", None) or embedder.model_id,
        "context_weight": CONTEXT_WEIGHT,
        "split": {"tune": list(TUNE), "test": list(TEST)},
        "harness_overrides": HARNESS,
        "retrieval_overrides": dict(pair.split("=", 1) for pair in args.retrieval),
        "clock": args.clock,
        "recency": CLOCK_NOTES[args.clock],
        "ranking": "result.candidates of proxy.memory.read.retrieval.retrieve, mapped to turn ids (a fact to its "
        "linked turns), first occurrence kept; MRR over that whole list (0 when no gold turn is in it)",
        "seconds": run.seconds,
        "python": platform.python_version(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cpus, load {os.getloadavg()[0]:.1f}",
    }


async def _main(args: argparse.Namespace) -> dict[str, Any]:
    conversations = load_conversations(args.data)
    if args.conversations:
        conversations = [conversations[i] for i in args.conversations]
    chosen = [v for v in variants() if v.name in args.variants] if args.variants else default_variants()
    if args.retrieval:  # the same [retrieval] overrides on every chosen variant (e.g. candidate depth)
        overrides = dict(pair.split("=", 1) for pair in args.retrieval)
        chosen = [
            dataclasses.replace(v, settings=RetrievalSettings.model_validate({**v.settings.model_dump(), **overrides}))
            for v in chosen
        ]
    started = time.perf_counter()
    embedder_settings = EmbedderSettings.model_validate({**EMBEDDER.model_dump(), **dict(args.embedder)})
    async with build_embedder(embedder_settings) as embedder:
        with tempfile.TemporaryDirectory(prefix="locomo-") as tmp:
            cache = None if args.no_cache else args.cache
            run = await run_benchmark(conversations, embedder, chosen, Path(tmp), cache, args.clock)
        run.seconds["total"] = round(time.perf_counter() - started, 1)
        return report(run, chosen, _meta(args, conversations, run, embedder))


def main() -> None:
    """Run the benchmark, print the table, write the results."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=DATA, help="a JSON file in LoCoMo's layout")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where to write the results")
    parser.add_argument("--cache", type=Path, default=CACHE, help="directory of the embedding cache")
    parser.add_argument("--no-cache", action="store_true", help="embed everything afresh, store nothing")
    parser.add_argument(
        "--clock",
        choices=CLOCKS,
        default="dataset",
        help="dataset: each memory dated by its session, asked a day after its conversation's last "
        "session (default); neutral: every memory last accessed at the retrieval clock",
    )
    parser.add_argument("--conversations", type=int, nargs="*", help="only these conversation indexes")
    parser.add_argument("--variants", nargs="*", help="only these variants (default: all but over summaries)")
    parser.add_argument(
        "--retrieval",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="override [retrieval] settings in every variant, e.g. dense_k=50 bm25_k=50",
    )
    parser.add_argument(
        "--embedder",
        nargs="*",
        default=[],
        type=lambda p: p.split("=", 1),
        metavar="KEY=VALUE",
        help="override [embedder] settings, e.g. query_model=minilm-static-query (empty: none)",
    )
    args = parser.parse_args()
    document = asyncio.run(_main(args))
    print(table(document))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(document, indent=2) + "\n")
    print(f"\nwrote {args.out} in {document['meta']['seconds']['total']:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
