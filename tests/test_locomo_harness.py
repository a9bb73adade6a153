"""The LoCoMo harness: loading LoCoMo's layout, ranking turns through the real read path, and its metrics."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bench.locomo import (
    Row,
    answer_words,
    clock,
    corpora,
    load_conversations,
    question_metrics,
    run_benchmark,
    summarise,
    variants,
)
from proxy.memory.read.retrieval_settings import InjectionSettings, RetrievalSettings
from proxy.memory.store.records import Kind
from tests.support.embedder import HashingEmbedder


def _session(speakers: tuple[str, str], lines: list[str], n: int) -> list[dict[str, Any]]:
    """LoCoMo turns ``D<n>:<i>``, speakers alternating."""
    return [{"speaker": speakers[i % 2], "dia_id": f"D{n}:{i + 1}", "text": line} for i, line in enumerate(lines)]


def _sample() -> dict[str, Any]:
    """A conversation where Ann's dog is easy to find and Ben's cello is only in an observation."""
    pair = ("Ann", "Ben")
    session_1 = _session(pair, [
        "I adopted a golden retriever puppy named Biscuit",
        "Congratulations on the new dog",
        "We hiked the Cascade trail on Saturday",
        "I started learning something new last week",
    ], 1)  # fmt: skip
    session_1[2]["blip_caption"] = "a photo of a mountain lake"
    session_2 = _session(pair, [f"The orchestra played piece number {i} and Ben loved it" for i in range(12)], 2)
    qa = [
        {"question": "What is the name of Ann's golden retriever puppy?", "answer": "Biscuit",
         "evidence": ["D1:1"], "category": 4},
        {"question": "Which orchestra does Ben play the cello in?", "answer": "?", "evidence": ["D:1:4"],
         "category": 1},
        {"question": "Where did Ann hike near a mountain lake?", "answer": "Cascade", "evidence": ["D1:3"],
         "category": 2},
        {"question": "What did Ann forget?", "adversarial_answer": "keys", "evidence": ["D1:2"], "category": 5},
        {"question": "What colour is Ben's car?", "answer": "red", "evidence": ["D7:1"], "category": 4},
    ]  # fmt: skip
    observation = {"session_1_observation": {
        "Ann": [["Ann adopted a golden retriever called Biscuit.", "D1:1"]],
        "Ben": [["Ben plays the cello in the Riverside orchestra.", ["D1:4"]]],
    }}  # fmt: skip
    conversation = {
        "speaker_a": "Ann",
        "speaker_b": "Ben",
        "session_1_date_time": "1:00 pm on 8 May, 2023",
        "session_1": session_1,
        "session_2_date_time": "2:00 pm on 20 June, 2023",
        "session_2": session_2,
    }
    return {"sample_id": "conv-a", "conversation": conversation, "qa": qa, "observation": observation}


def _other_sample() -> dict[str, Any]:
    """A second user whose single question is answered by its first turn."""
    turns = _session(("Cy", "Di"), ["My sister Eve moved to Lisbon in March", "Lisbon is beautiful"], 1)
    conversation = {
        "speaker_a": "Cy",
        "speaker_b": "Di",
        "session_1_date_time": "9:15 am on 2 March, 2024",
        "session_1": turns,
    }
    qa = [{"question": "Where did Cy's sister Eve move?", "answer": "Lisbon", "evidence": ["D1:1"], "category": 4}]
    return {"sample_id": "conv-b", "conversation": conversation, "qa": qa, "observation": {}}


@pytest.fixture
def locomo_file(tmp_path: Path) -> Path:
    """A two-conversation file in LoCoMo's layout."""
    path = tmp_path / "tiny_locomo.json"
    path.write_text(json.dumps([_sample(), _other_sample()]))
    return path


def test_loading_keeps_valid_category_1_to_4_questions_and_normalises_evidence(locomo_file: Path) -> None:
    """Category 5 and questions without an existing evidence turn are skipped; ``D:1:4`` means D1:4."""
    first, second = load_conversations(locomo_file)
    assert [q.evidence for q in first.questions] == [("D1:1",), ("D1:4",), ("D1:3",)]
    assert len(second.questions) == 1
    caption = " [shared an image: a photo of a mountain lake]"
    assert first.turns[2].memory_text == f"Ann: We hiked the Cascade trail on Saturday{caption}"
    assert first.turns[4].at.isoformat() == "2023-06-20T14:00:00+00:00"
    assert first.observations[1].dia_ids == ("D1:4",)


def test_facts_link_to_their_turns_records_as_the_writer_links_them(locomo_file: Path) -> None:
    """An observation's fact holds its turns' record ids as sources (what the block's repeat check reads) and
    counts as a hit on those turns."""
    first, _ = load_conversations(locomo_file)
    turns, facts = np.zeros((len(first.turns), 4), np.float32), np.zeros((len(first.observations), 4), np.float32)
    vectors = {"turns": turns, "context": turns, "facts": facts}
    corpus = corpora(first, vectors, None, ["observations"])["observations"]
    turn_ids = {r.text.split(": ", 1)[1]: r.id for r in corpus.records if r.kind is Kind.TURN}
    cello = next(r for r in corpus.records if r.kind is Kind.FACT and "cello" in r.text)
    assert cello.source_ids == (turn_ids["I started learning something new last week"],)
    assert corpus.turns_of[cello.id] == ("D1:4",)


def test_the_dataset_clock_asks_each_conversation_a_day_after_its_own_last_session(locomo_file: Path) -> None:
    """Dataset clock: conv-a is asked on 21 June 2023 and conv-b on 3 March 2024, memories dated as told;
    neutral clock: both on 3 March 2024, every memory last accessed then."""
    first, second = load_conversations(locomo_file)
    asked_a, accessed_a = clock([first, second], first, "dataset")
    asked_b, _ = clock([first, second], second, "dataset")
    assert (asked_a.date().isoformat(), asked_b.date().isoformat()) == ("2023-06-21", "2024-03-03")
    assert accessed_a is None
    neutral_a, accessed = clock([first, second], first, "neutral")
    assert neutral_a == accessed == asked_b


def test_variants_include_the_product_and_the_seed_scoring() -> None:
    """The product variant is the shipped settings exactly over turns and facts, ranked as the block holds them;
    ``minmax`` is the seed's scoring."""
    chosen = {v.name: v for v in variants()}
    product = chosen["product"]
    assert product.settings == RetrievalSettings()
    assert product.injection == InjectionSettings()
    assert (product.corpus, product.block) == ("context+observations", True)
    assert chosen["minmax"].settings.scoring == "minmax"
    former = chosen["product-all time"].settings  # the 14-day window that hid every older turn
    assert (former.turn_window_days, former.turns_past_window) == (14.0, "none")
    assert chosen["product+repeats dropped"].injection == InjectionSettings(drop_repeated=True)
    assert chosen["product, turns only"].corpus == "context"


def test_metrics_of_a_known_ranking() -> None:
    """Gold turns at ranks 1 and 7 of three: recall 1/3 at 5, 2/3 at 10, a hit at 1, not all in the top 10."""
    ranked = ["a", "x1", "x2", "x3", "x4", "x5", "b", "x6", "x7", "x8", "x9", "c"]
    metrics = question_metrics(ranked, ["c", "a", "b"])
    assert metrics == pytest.approx({"evidence_recall@5": 1 / 3, "evidence_recall@10": 2 / 3, "hit@1": 1.0,
                                     "hit@5": 1.0, "hit@10": 1.0, "all@10": 0.0, "mrr": 1.0})  # fmt: skip
    missed = question_metrics(["x1", "x2"], ["a"])
    assert missed["evidence_recall@10"] == 0.0
    assert missed["mrr"] == 0.0


def test_summary_splits_tune_and_test_conversations() -> None:
    """Conversations 0-4 are the tune half, 5-9 the test half; categories are averaged separately."""
    perfect = {"evidence_recall@5": 1.0, "evidence_recall@10": 1.0, "hit@1": 1.0, "hit@5": 1.0, "hit@10": 1.0,
               "all@10": 1.0, "mrr": 1.0, "answer_words": 1.0}  # fmt: skip
    rows = [Row(0, 4, perfect), Row(7, 1, dict.fromkeys(perfect, 0.0))]
    summary = summarise(rows)
    assert summary["overall"]["mrr"] == 0.5
    assert summary["tune"]["mrr"] == 1.0
    assert summary["test"]["mrr"] == 0.0
    assert summary["by_category"]["1 multi-hop"]["n"] == 1


def test_answer_words_is_the_share_of_the_answers_content_stems_the_texts_hold() -> None:
    """Stems count ("adopted" finds "adopting"), stop words do not, and an answer without content words is held."""
    assert answer_words("Adopted a beagle", ["Maya was adopting", "a small beagle"]) == 1.0
    assert answer_words("the Riverside orchestra", ["she plays in an orchestra"]) == 0.5
    assert answer_words("yes", ["anything"]) == 1.0


async def test_harness_ranks_turns_through_the_read_path(locomo_file: Path, tmp_path: Path) -> None:
    """An easy question is found first; a turn only an observation describes is missed by turns alone and
    found first once observations are stored as facts linked to it."""
    chosen = [v for v in variants() if v.name in ("bm25", "default", "+observations")]
    conversations = load_conversations(locomo_file)
    run = await run_benchmark(conversations, HashingEmbedder(dim=64), chosen, tmp_path / "work")
    default, observed = run.rows["default"], run.rows["+observations"]
    assert [len(run.rows[v.name]) for v in chosen] == [4, 4, 4]
    easy, cello = default[0].metrics, default[1].metrics
    assert (easy["hit@1"], easy["mrr"], easy["all@10"]) == (1.0, 1.0, 1.0)
    assert cello["evidence_recall@10"] == 0.0
    assert cello["mrr"] < 0.1
    assert observed[1].metrics["hit@1"] == 1.0
    assert default[3].metrics["hit@1"] == 1.0  # the second user's question, in its own store scope
    assert run.degraded == {}
