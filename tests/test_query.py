"""Tests of the retrieval query: which user text the read path searches with, and its terms."""

from __future__ import annotations

from datetime import date

from hypothesis import given
from hypothesis import strategies as st

from proxy.memory.keyword import stem_analyzer, word_analyzer
from proxy.memory.read.dates import query_dates, query_days
from proxy.memory.read.query import build_query, is_anaphoric
from proxy.memory.words import stem, terms, words


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


def test_terms_drop_stop_words_and_split_cjk_into_bigrams() -> None:
    """Content words survive, stop words go, and CJK text becomes bigrams like the store's CJK field."""
    assert terms("What did Caroline say about her hiking trip?") == ("caroline", "hiking", "trip")
    assert terms("東京タワー") == ("東京", "京タ", "タワ", "ワー")


def test_stem_makes_inflections_agree() -> None:
    """Inflected forms compare equal, so "hikes" in a memory counts for "hiking" in a question."""
    assert stem("hiking") == stem("hikes") == stem("hiked") == stem("hike")
    assert stem("stories") == stem("story")
    assert stem("glass") == "glass"


# Inflections, irregulars, Porter2 special cases, accents, apostrophes, digits: words the light stemmer
# and Tantivy's disagreed on, and words they agreed on.
WORD_LIST = (  # noqa: SIM905 - a word list reads best as text
    "running runs ran runner studied studies studying study hiking hikes hiked hike stories story glass "
    "classes generously generate generation organisation organization happily happiness cats caresses ponies "
    "ties caress dying lying skies news innings proceed exceed succeed arsenal universal universe agreed "
    "feed bled sing singing wrote written gardening gardens painted painting paintings photographs "
    "photography café naïve zürich 2023 3rd adopted adoption volunteering volunteered fitness marathon"
).split()


def test_stems_are_the_keyword_index_stems() -> None:
    """The read path stems every word of a list exactly as the keyword index's ``text_stem`` field does."""
    index = stem_analyzer()
    for word in WORD_LIST:
        assert [stem(word)] == index.analyze(word), word
    assert (stem("running"), stem("studied")) == ("run", "studi")


def test_words_are_the_keyword_index_words() -> None:
    """Query words split text exactly as the index's ``text`` field (Hindi vowel signs, underscores included)."""
    for text in ("Maya's snake_case note: hiking in Zürich!", "हिन्दी भाषा", "東京大学に行った", "x" * 50 + " ok"):
        assert words(text) == word_analyzer().analyze(text)


def test_query_dates_reads_months_and_years() -> None:
    """Named months and years are found; the verb "may" and the word "march" are not dates."""
    assert query_dates("What happened in May 2023?") == [(2023, 5)]
    assert query_dates("Where did she go last August?") == [(None, 8)]
    assert query_dates("in 2022 we moved") == [(2022, None)]
    assert query_dates("you may go, we march on") == []
    assert query_dates("May I ask something?") == []


def test_query_days_reads_whole_dates_only() -> None:
    """Days written with their month and year are found in any common order; a month and year alone is not a day."""
    assert query_days("What did Gina find on 1 February, 2023?") == [date(2023, 2, 1)]
    both = [date(2023, 5, 3), date(2023, 10, 13)]
    assert query_days("the painting shown on October 13, 2023 and on 2023-05-03") == both
    assert query_days("the 3rd of June 2023") == [date(2023, 6, 3)]
    assert query_days("in May 2023, or on 31 February 2023") == []


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


@given(st.text(max_size=200))
def test_terms_are_lowercase_distinct_and_never_stop_words(text: str) -> None:
    """Terms are what BM25 gating and excerpts compare: distinct, lowercase, no stop words."""
    found = terms(text)
    assert len(set(found)) == len(found)
    assert all(t == t.lower() and t not in {"the", "and", "what"} for t in found)
