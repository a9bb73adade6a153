"""Tests of the retrieval query: which user text the read path searches with, and when it is expanded."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from proxy.memory.read.query import build_query, is_anaphoric, user_texts


def _chat(*user_texts: str) -> list[dict[str, object]]:
    """A conversation alternating the given user texts with assistant replies."""
    messages: list[dict[str, object]] = [{"role": "system", "content": "You are helpful."}]
    for text in user_texts:
        messages += [{"role": "user", "content": text}, {"role": "assistant", "content": "Sure."}]
    return messages[:-1]


def test_query_is_the_latest_user_message() -> None:
    """A self-contained question is searched as it is, without older turns."""
    query = build_query(_chat("I moved to Paris last year", "What is a good vegetarian pasta recipe for kids?"))
    assert query is not None
    assert query.text == "What is a good vegetarian pasta recipe for kids?"
    assert not query.expanded


def test_short_anaphoric_follow_up_brings_the_previous_user_turn() -> None:
    """ "and her?" alone finds nothing; with the previous user turn it names who is meant."""
    query = build_query(_chat("What does Caroline do for work?", "and her sister?"))
    assert query is not None
    assert query.expanded
    assert query.text == "What does Caroline do for work?\nand her sister?"
    assert "caroline" in query.terms
    assert query.latest == "and her sister?"


def test_longer_message_leaning_on_a_pronoun_is_expanded() -> None:
    """A message whose only content is a pronoun and a verb leans on the previous turn."""
    assert is_anaphoric("What did she think about that?", short_words=4)
    assert not is_anaphoric("What did Melanie paint at the pottery class in July?", short_words=4)


def test_first_message_is_not_expanded_even_when_short() -> None:
    """With no earlier user turn the short message is the whole query."""
    query = build_query([{"role": "user", "content": "and her?"}])
    assert query is not None
    assert query.text == "and her?"
    assert not query.expanded


def test_expansion_can_be_switched_off() -> None:
    """With expansion off, only the latest message is searched."""
    query = build_query(_chat("Tell me about Caroline", "and her?"), expand=False)
    assert query is not None
    assert query.text == "and her?"


def test_text_parts_of_list_content_are_read() -> None:
    """Multimodal (list) content contributes its text parts; images are ignored."""
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": "data:,"}},
                {"type": "text", "text": "Where did I hike in June?"},
            ],
        }
    ]
    query = build_query(messages)
    assert query is not None
    assert query.text == "Where did I hike in June?"


def test_no_user_text_gives_no_query() -> None:
    """A request without user text (tool round-trips only, empty messages) retrieves nothing."""
    assert build_query([]) is None
    assert build_query([{"role": "system", "content": "x"}, {"role": "user", "content": "   "}]) is None
    assert build_query([{"role": "tool", "content": "42"}]) is None


_messages = st.lists(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["system", "user", "assistant", "tool"]),
            "content": st.one_of(st.text(max_size=80), st.none(), st.lists(st.just({"type": "text"}))),
        }
    ),
    max_size=8,
)


@given(_messages)
def test_build_query_never_fails_and_ends_with_the_latest_user_text(
    messages: list[dict[str, object]],
) -> None:
    """Any message list gives None or a query whose text ends with the latest non-empty user text."""
    query = build_query(messages)
    user = [m["content"] for m in messages if m["role"] == "user" and isinstance(m["content"], str)]
    user = [u for u in user if u.strip()]
    if query is None:
        assert not user
    else:
        assert query.latest == user[-1].strip()
        assert query.text.endswith(query.latest)


def test_user_texts_skips_empty_messages_and_reads_only_the_last_few_when_asked() -> None:
    """Oldest first, blank and non-user messages left out; ``last`` keeps the newest ones (read from the end)."""
    messages = [*_chat("first", "  ", "second", "third"), {"role": "tool", "content": "x"}, "not a message"]
    assert user_texts(messages) == ["first", "second", "third"]  # type: ignore[arg-type]
    assert user_texts(messages, last=2) == ["second", "third"]  # type: ignore[arg-type]
    assert user_texts(messages, last=5) == ["first", "second", "third"]  # type: ignore[arg-type]
