"""The static model's tokenisation shortcuts: a plain ASCII query's ids and a new word's pieces from the word
cache and the WordPiece model alone, the same as the whole tokenizer pipeline's."""

from __future__ import annotations

import random
import string

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.memory.embedders import static
from proxy.memory.embedders.model_files import STATIC_MODEL_DIR_NAME, default_model_dirs
from proxy.memory.embedders.static import StaticModel


@pytest.fixture(scope="module")
def static_model() -> StaticModel:
    return StaticModel(default_model_dirs(STATIC_MODEL_DIR_NAME)[0], 384)


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet=st.sampled_from([*string.printable, "é", "\x0b", "東"]), max_size=120))
def test_a_plain_ascii_query_gets_the_tokenizers_own_ids(static_model: StaticModel, text: str) -> None:
    """A printable ASCII text (tabs and line breaks allowed) is cut and split from the word cache: the same ids
    as the whole tokenizer pipeline, truncation included; any other text is left to the pipeline."""
    ids = static_model._plain_ids(text)
    expected = static_model._tokenizer.encode(text, add_special_tokens=False).ids
    if text.isascii() and text.replace("\t", " ").replace("\n", " ").replace("\r", " ").isprintable():
        assert ids == expected
    else:
        assert ids is None
    long = "hello! " * 200  # 400 tokens: both keep the first 256
    assert static_model._plain_ids(long) == static_model._tokenizer.encode(long, add_special_tokens=False).ids


def test_the_word_cache_refills_whole_when_it_empties(
    static_model: StaticModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When the word cache is full, it is emptied and refilled with every word of the call: no word of it is
    lost on the way (its pieces would be missing)."""
    monkeypatch.setattr(static, "MAX_CACHED_WORDS", 4)
    static_model._word_ids.clear()
    first = static_model.pieces(["research", "adoption", "weather"]).tolist()
    both = static_model.pieces(["research", "adoption", "weather", "puppy", "hiking"]).tolist()
    assert set(first) < set(both)
    assert static_model.pieces(["research", "adoption", "weather"]).tolist() == first


def test_word_pieces_of_plain_ascii_words_are_the_whole_tokenisers(static_model: StaticModel) -> None:
    """A plain ASCII word goes straight to the WordPiece model (lowercased); its pieces are those the whole
    pipeline (normaliser, pre-tokeniser, model) gives, and other words still go through the pipeline."""
    rng = random.Random(7)
    alphabet = string.ascii_letters + string.digits
    words = ["".join(rng.choices(alphabet, k=rng.randint(1, 30))) for _ in range(300)]
    words += ["Research", "unaffable", "4951", "a" * 150, "café", "naïve", "東京", "ok_go", "?"]
    for word in words:
        expected = sorted(set(static_model._tokenizer.encode(word, add_special_tokens=False).ids))
        assert static_model.pieces([word]).tolist() == expected, word


def test_a_batch_embeds_as_the_whole_tokenizer_would(static_model: StaticModel) -> None:
    """A batch of documents, plain ASCII ones from the word cache and the others through the pipeline: each row
    the mean of the rows of the ids the whole tokenizer gives, in order."""
    texts = ["I moved to Lisbon in May, with the dog.", "Café au lait à Paris", "", "東京に住んでいます", "ok\tgo\n"]
    got = static_model.embed(texts)
    for row, text in zip(got, texts, strict=True):
        ids = static_model._tokenizer.encode(text, add_special_tokens=False).ids
        if not ids:
            assert not row.any()
            continue
        expected = static_model._table[ids].mean(axis=0, dtype=np.float32)
        assert np.allclose(row, expected / np.linalg.norm(expected), atol=1e-6)
