"""What the keyword index holds: its fields, its analyzers, one record's document, the id encoding and filters.

Fields: ``id`` (raw, stored), ``user_id`` (raw, indexed only), ``kind`` (raw), ``text`` (words: Tantivy's
default pipeline of simple tokenizer, long-token removal and lowercasing), ``text_stem`` (the same words
without English stop words, Snowball-stemmed; word queries match this field, so "hiking" finds "hikes";
a query made only of stop words matches ``text`` instead),
``text_cjk`` (character bigrams of the CJK runs of the text, so Korean, Japanese and Chinese queries match
inside words), ``created_us`` (microseconds, exact range filters), ``valid`` and ``sig`` (a digest of the
indexed fields, stored, which lets the store's startup repair find documents that disagree with LanceDB), and
``hex_id``, ``id_hi``, ``id_lo`` (fast columns: a generated id's two 64-bit halves, which a search reads
instead of each hit's stored document).

``user_stem`` and ``user_cjk`` hold the tokens of ``text_stem`` and ``text_cjk`` again, each prefixed with its
user's key and its pool (``doc_scope``: valid facts, valid turns and summaries, the rest): a term of them
lists one user's documents of one pool. The read path's searches (a user's valid facts, a user's valid turns and
summaries, ``filter_scope``) are plain disjunctions of such terms, which Tantivy answers by block-max WAND,
skipping documents that cannot reach the top k, instead of walking every document of the user (a filter on
``user_id`` intersected with the words): with 600 turns of a user that all share the query's common words,
0.3 against 4.6 ms a search of both pools. Each term is boosted so that it scores as its word does in
``text_stem`` / ``text_cjk`` (BM25's IDF of the whole index: ``boost``), so both ways rank alike.
An index written before these fields existed no longer matches the schema and is rebuilt from LanceDB.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

import numpy as np
import orjson
import tantivy
from tantivy import Filter, SchemaBuilder, TextAnalyzerBuilder, Tokenizer

from proxy.memory.store.records import Kind, MemoryRecord

WORDS = "memproxy_words"
STEMS = "memproxy_stems"
CJK = "memproxy_cjk"
MAX_TOKEN_CHARS = 40
_CJK_RUN = re.compile(
    "[\u1100-\u11ff\u3040-\u30ff\u3130-\u318f\u3400-\u4dbf\u4e00-\u9fff\ua960-\ua97f"
    "\uac00-\ud7af\uf900-\ufaff\uff66-\uff9f\U00020000-\U0002fa1f]+"
)


def word_analyzer() -> tantivy.TextAnalyzer:
    """The words pipeline, identical to Tantivy's ``default`` tokenizer."""
    builder = TextAnalyzerBuilder(Tokenizer.simple()).filter(Filter.remove_long(MAX_TOKEN_CHARS))
    return builder.filter(Filter.lowercase()).build()


def stem_analyzer() -> tantivy.TextAnalyzer:
    """The words pipeline without English stop words, then the English Snowball stemmer."""
    builder = TextAnalyzerBuilder(Tokenizer.simple()).filter(Filter.remove_long(MAX_TOKEN_CHARS))
    builder = builder.filter(Filter.lowercase()).filter(Filter.stopword("english"))
    return builder.filter(Filter.stemmer("english")).build()


_STEMS = stem_analyzer()  # documents' scoped tokens (the index's own analyzer makes text_stem's from the text)


def cjk_analyzer() -> tantivy.TextAnalyzer:
    """Character bigrams, applied to each CJK run separately."""
    return TextAnalyzerBuilder(Tokenizer.ngram(2, 2)).build()


def cjk_runs(text: str) -> list[str]:
    """Maximal runs of Hangul, kana and CJK ideographs of two characters or more."""
    return [run for run in _CJK_RUN.findall(text) if len(run) >= 2]


def cjk_bigrams(text: str) -> list[str]:
    """The bigrams the ``text_cjk`` field holds for ``text`` (what ``Tokenizer.ngram(2, 2)`` yields)."""
    return [run[i : i + 2] for run in cjk_runs(text) for i in range(len(run) - 1)]


@dataclass(frozen=True, slots=True)
class KeywordDoc:
    """What the keyword index holds of one record."""

    id: str
    user_id: str
    kind: str
    text: str
    created_us: int
    valid: bool

    @classmethod
    def of(cls, record: MemoryRecord) -> KeywordDoc:
        """The document for a record."""
        created_us = int(record.created_at.timestamp() * 1_000_000)
        return cls(record.id, record.user_id, str(record.kind), record.text, created_us, record.valid)

    @property
    def sig(self) -> str:
        """A digest of every indexed field; equal signatures mean the document is up to date."""
        parts = (self.user_id, self.kind, str(self.created_us), "1" if self.valid else "0", self.text)
        return hashlib.blake2b("\x1f".join(parts).encode(), digest_size=12).hexdigest()


# --- user- and pool-scoped terms --------------------------------------------------------------------------

STEM_FIELD, CJK_FIELD = "text_stem", "text_cjk"
SCOPED = {STEM_FIELD: "user_stem", CJK_FIELD: "user_cjk"}  # a word field -> its user- and pool-scoped copy
SCOPE_FACTS, SCOPE_PAST, SCOPE_OTHER = "f", "p", "o"  # valid facts; valid turns and summaries; the rest
_PAST = frozenset({str(Kind.TURN), str(Kind.SUMMARY)})


def user_key(user_id: str) -> str:
    """The user's prefix of scoped terms: a 128-bit digest of the id (fixed length, whatever the id's)."""
    return hashlib.blake2b(user_id.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


def doc_scope(doc: KeywordDoc) -> str:
    """The pool a document's scoped terms name."""
    if not doc.valid:
        return SCOPE_OTHER
    if doc.kind == str(Kind.FACT):
        return SCOPE_FACTS
    return SCOPE_PAST if doc.kind in _PAST else SCOPE_OTHER


def filter_scope(where: KeywordFilter) -> str | None:
    """The pool whose scoped terms find exactly the documents ``where`` admits (None: no pool does)."""
    if where.include_invalid or where.since_us is not None or where.until_us is not None:
        return None
    kinds = frozenset(where.kinds)
    if kinds == {str(Kind.FACT)}:
        return SCOPE_FACTS
    return SCOPE_PAST if kinds == _PAST else None


def boost(docs: int, word_docs: int, scoped_docs: int) -> float:
    """What makes a scoped term score as its word does: the ratio of their BM25 IDFs among ``docs`` documents
    (Tantivy's formula), the word held by ``word_docs`` of them, the scoped term by ``scoped_docs``."""
    return _idf(docs, word_docs) / _idf(docs, scoped_docs)


def _idf(docs: int, holding: int) -> float:
    return math.log(1.0 + (docs - holding + 0.5) / (holding + 0.5))


def index_schema() -> tantivy.Schema:
    builder = SchemaBuilder()
    builder.add_text_field("id", stored=True, tokenizer_name="raw", index_option="basic")
    builder.add_text_field("user_id", tokenizer_name="raw", index_option="basic")
    builder.add_text_field("kind", tokenizer_name="raw", index_option="basic")
    builder.add_text_field("text", tokenizer_name=WORDS, index_option="freq")
    builder.add_text_field("text_stem", tokenizer_name=STEMS, index_option="freq")
    builder.add_text_field("text_cjk", tokenizer_name=CJK, index_option="freq")
    builder.add_text_field(SCOPED[STEM_FIELD], tokenizer_name="raw", index_option="freq")
    builder.add_text_field(SCOPED[CJK_FIELD], tokenizer_name="raw", index_option="freq")
    builder.add_integer_field("created_us", indexed=True, fast=True)
    builder.add_boolean_field("valid", indexed=True)
    builder.add_text_field("sig", stored=True, tokenizer_name="raw", index_option="basic")
    # A generated id (32 lowercase hex digits) as two fast 64-bit halves: a search reads a hit's id from these
    # columns instead of loading its stored document (far cheaper, for every hit of a request). Other ids: doc().
    builder.add_boolean_field("hex_id", fast=True)
    builder.add_integer_field("id_hi", fast=True)
    builder.add_integer_field("id_lo", fast=True)
    return builder.build()


_HEX_ID = re.compile(r"[0-9a-f]{32}")
_I64 = 1 << 63  # the halves are unsigned 64-bit numbers stored as signed ones


def id_halves(record_id: str) -> tuple[bool, int, int]:
    """Whether the id is a generated one, and its two halves as signed 64-bit numbers (0, 0 when it is not)."""
    if _HEX_ID.fullmatch(record_id) is None:
        return False, 0, 0
    return True, int(record_id[:16], 16) - _I64, int(record_id[16:], 16) - _I64


def id_from_halves(high: int, low: int) -> str:
    """The generated id ``id_halves`` split."""
    return f"{high + _I64:016x}{low + _I64:016x}"


def document_json(doc: KeywordDoc) -> str:
    """The document as Tantivy JSON (cheaper to build and add than a ``Document`` of keywords)."""
    hex_id, high, low = id_halves(doc.id)
    prefix = user_key(doc.user_id) + doc_scope(doc)
    fields = {
        "id": doc.id,
        "hex_id": hex_id,
        "id_hi": high,
        "id_lo": low,
        "user_id": doc.user_id,
        "kind": doc.kind,
        "text": doc.text,
        "text_stem": doc.text,
        "text_cjk": cjk_runs(doc.text),
        SCOPED[STEM_FIELD]: [prefix + token for token in _STEMS.analyze(doc.text)],
        SCOPED[CJK_FIELD]: [prefix + pair for pair in cjk_bigrams(doc.text)],
        "created_us": doc.created_us,
        "valid": doc.valid,
        "sig": doc.sig,
    }
    return orjson.dumps(fields).decode()


def ids_from_halves(highs: Sequence[int], lows: Sequence[int]) -> list[str]:
    """``id_from_halves`` of many pairs at once: the halves as big-endian unsigned words, hex-encoded in one
    call and cut into ids (about half the cost of formatting each id alone, for every hit of a request)."""
    words = np.empty((len(highs), 2), dtype=">u8")
    words[:, 0] = np.asarray(highs, dtype=np.int64).view(np.uint64) ^ _SIGN
    words[:, 1] = np.asarray(lows, dtype=np.int64).view(np.uint64) ^ _SIGN
    text = words.tobytes().hex()
    return [text[start : start + 32] for start in range(0, len(text), 32)]


_SIGN = np.uint64(1 << 63)  # adding 2**63 to a signed 64-bit number's bits is flipping its top bit


@dataclass(frozen=True, slots=True)
class KeywordFilter:
    """Which documents of one user a keyword query may match."""

    kinds: tuple[str, ...] = ()
    since_us: int | None = None
    until_us: int | None = None
    include_invalid: bool = False


def keyword_filter(
    kinds: Sequence[Kind] | None, since: datetime | None, until: datetime | None, include_invalid: bool
) -> KeywordFilter:
    """The filter for a search's arguments."""
    return KeywordFilter(
        kinds=tuple(str(kind) for kind in kinds or ()),
        since_us=int(since.timestamp() * 1_000_000) if since is not None else None,
        until_us=int(until.timestamp() * 1_000_000) if until is not None else None,
        include_invalid=include_invalid,
    )
