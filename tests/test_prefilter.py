"""The extraction pre-filter on real sentences: what it lets through and what it spares the model."""

from __future__ import annotations

import pytest

from bench.locomo import DATA, load_conversations
from proxy.memory.write.prefilter import any_worth_extracting, worth_extracting


@pytest.mark.parametrize(
    "text",
    [
        "My daughter Maya lives in London",
        "I'm allergic to peanuts, so no satay please",
        "We moved to Paris last spring",
        "Remember that the wifi password for the cabin is on the fridge",
        "Don't forget: dentist appointment on the 12th",
        "Sister's wedding is in June at the old mill by the river, and the whole family is flying in for it",
        "I\u2019ve been learning the cello for two years",
    ],
)
def test_messages_about_the_user_pass(text: str) -> None:
    """Statements about the user's life, explicit remember requests and long statements reach extraction."""
    assert worth_extracting(text)


@pytest.mark.parametrize(
    "text",
    [
        "Thanks!",
        "ok",
        "Write a haiku about autumn leaves",
        "What is the capital of Australia?",
        "Explain quicksort in simple terms",
        "Wow, that's amazing! Keep it up!",
    ],
)
def test_messages_with_nothing_to_learn_are_dropped(text: str) -> None:
    """Tasks, questions about the world and acknowledgements cost no extraction call."""
    assert not worth_extracting(text)


def test_an_exchange_passes_when_any_user_message_does() -> None:
    """One message about the user among several is enough to send the exchange to extraction."""
    assert any_worth_extracting(["Thanks!", "By the way, my son starts school on Monday"])
    assert not any_worth_extracting(["Thanks!", "ok"])


@pytest.mark.skipif(not DATA.exists(), reason=f"LoCoMo not at {DATA} (set LOCOMO_DATA to run this check)")
def test_locomo_observation_turns_reach_extraction() -> None:
    """At least 95% of the LoCoMo turns the dataset's observations cite pass, and some chatter is spared."""
    conversations = load_conversations(DATA)
    cited = {(c.index, d) for c in conversations for o in c.observations for d in o.dia_ids}
    passed = {(c.index, t.dia_id) for c in conversations for t in c.turns if worth_extracting(t.text)}
    every = sum(len(c.turns) for c in conversations)
    assert len(cited & passed) / len(cited) >= 0.95
    assert len(passed) < 0.9 * every
