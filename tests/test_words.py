"""Tests of the shared word analysis: terms, stems and words exactly as the keyword index sees them."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from proxy.memory.store.keyword_schema import stem_analyzer, word_analyzer
from proxy.memory.words import stem, terms, words


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


@given(st.text(max_size=200))
def test_terms_are_lowercase_distinct_and_never_stop_words(text: str) -> None:
    """Terms are what BM25 gating and excerpts compare: distinct, lowercase, no stop words."""
    found = terms(text)
    assert len(set(found)) == len(found)
    assert all(t == t.lower() and t not in {"the", "and", "what"} for t in found)
