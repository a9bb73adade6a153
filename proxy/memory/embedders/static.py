"""Static models: a text's vector is the normalised mean of its tokens' rows (cheap enough for the loop, no thread).

``StaticModel`` is the table and its tokenizer; it serves as an ONNX model's query side (the default:
``models/minilm-static`` answers the questions for MiniLM int8's documents), or, as ``StaticEmbedder``, as the
document model itself (``model_path = "models/minilm-static"``: ~0.1 ms of CPU per stored text).
"""

from __future__ import annotations

import asyncio
import re
import string
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import cast

import numpy as np
import numpy.typing as npt

from proxy.memory.embedders.base import BaseEmbedder
from proxy.memory.embedders.model_files import read_query_manifest, resolve_query_model_dir
from proxy.memory.embedders.protocol import Vectors, l2_normalise
from proxy.memory.embedders.settings import AUTO_QUERY_MODEL, EmbedderSettings
from proxy.memory.errors import EmbedderError

MAX_TOKENS = 256
_BLANKS = str.maketrans("\t\n\r", "   ")  # whitespace the normaliser turns into spaces
_PLAIN_TOKENS = re.compile(r"[a-z0-9]+|[^a-z0-9 ]")  # how the pre-tokeniser cuts a lowercase printable ASCII text
_PUNCTUATION = frozenset(string.punctuation)  # a token of its own for the pre-tokeniser
MAX_CACHED_WORDS = 100_000  # word -> token ids kept for ``pieces`` (~100 bytes each); emptied when full


class StaticModel:
    """A static model: a text's vector is the normalised mean of its WordPiece tokens' rows (no thread needed).

    Built by ``scripts/distill_static.py`` from MiniLM, so that its vectors land near MiniLM's own (it can serve
    as MiniLM's query side) and, centred, spread like MiniLM's (the default document model).
    """

    def __init__(self, model_dir: Path, dim: int) -> None:
        from tokenizers import Tokenizer  # fastembed's own dependency; loaded only with a static query side

        try:
            self._table = np.load(model_dir / "vectors.npy")
            self._tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        except Exception as exc:  # numpy raises OSError/ValueError, tokenizers a bare Exception
            raise EmbedderError(f"cannot load the static query model from {model_dir}: {exc}") from exc
        if self._table.ndim != 2 or self._table.shape[1] != dim:
            raise EmbedderError(f"{model_dir}/vectors.npy has shape {self._table.shape}, its manifest says dim {dim}")
        self._tokenizer.no_padding()
        self._tokenizer.enable_truncation(MAX_TOKENS)
        self._terms, self._scales = unit_int8(self._table)
        self._widen_lock = threading.Lock()
        self._gather_buffer = np.empty((1024, dim), dtype=np.int8)
        self._widen_buffer = np.empty((1024, dim), dtype=np.float32)
        self._word_ids: dict[str, tuple[int, ...]] = {}
        self._words_lock = threading.Lock()  # the word cache may be emptied (``_know``) while another thread reads
        self._wordpiece = self._tokenizer.model

    def embed(self, texts: Sequence[str]) -> Vectors:
        """One unit row per text (a text without tokens gets a zero row)."""
        out = np.zeros((len(texts), self._table.shape[1]), dtype=np.float32)
        # Plain ASCII texts from the word cache (``_plain_ids``), the others through the whole pipeline: the
        # pipeline's batch call was ~28% of the memory writer's main thread under sustained chat (py-spy,
        # ``make bench-writes``), the turns being plain ASCII most often.
        found = [self._plain_ids(text) for text in texts]
        if others := [i for i, ids in enumerate(found) if ids is None]:
            batch = self._tokenizer.encode_batch([texts[i] for i in others], add_special_tokens=False)
            for i, encoding in zip(others, batch, strict=True):
                found[i] = encoding.ids
        encoded = cast("list[list[int]]", found)
        for row, ids in enumerate(encoded):
            if ids:
                out[row] = self._table[ids].mean(axis=0, dtype=np.float32)
        return l2_normalise(out)

    def _plain_ids(self, text: str) -> list[int] | None:
        """The token ids of a printable ASCII text (tabs and line breaks allowed), as the tokenizer gives them,
        from the word cache; None for any other text (the tokenizer's own rules then apply).

        For such a text the BERT normaliser only lowercases, and the pre-tokeniser cuts it into runs of letters
        and digits and single punctuation characters, which the WordPiece model then splits (``_learn``): a
        query's ids without a pass through the whole pipeline, which was most of a warm query's cost."""
        if not text.isascii():
            return None
        folded = text.translate(_BLANKS).lower()
        if not folded.isprintable():
            return None
        tokens = _PLAIN_TOKENS.findall(folded)
        with self._words_lock:  # a batch may be embedded in a worker thread while the loop embeds a query
            self._know(tokens)
            word_ids = self._word_ids
            ids = [i for token in tokens for i in word_ids[token]]
        return ids[:MAX_TOKENS]

    def pieces(self, words: Sequence[str]) -> npt.NDArray[np.int64]:
        """The distinct token ids of ``words``, sorted (each word is tokenised once, then cached)."""
        with self._words_lock:
            self._know(words)
            word_ids = self._word_ids
            ids = sorted({i for w in words for i in word_ids[w]})  # cheaper than np.unique for a query's few ids
        return np.fromiter(ids, dtype=np.int64, count=len(ids))

    def _know(self, words: Sequence[str]) -> None:
        """Make sure the word cache holds every one of ``words`` (emptied first when it would grow past
        ``MAX_CACHED_WORDS``, and then refilled with all of them)."""
        word_ids = self._word_ids
        if missing := [w for w in dict.fromkeys(words) if w not in word_ids]:
            if len(word_ids) + len(missing) > MAX_CACHED_WORDS:
                word_ids.clear()
                missing = list(dict.fromkeys(words))
            self._learn(missing)

    def _learn(self, words: Sequence[str]) -> None:
        """Tokenise and cache ``words``. An ASCII word of letters and digits goes straight to the WordPiece
        model, lowercased: the BERT normaliser would only lowercase it and the pre-tokeniser would leave it
        whole, and the model alone costs a fraction of a whole pipeline call (in a memory's first term
        matching, a new word, a number say, is most of the cost)."""
        others = []
        for word in words:
            if word.isascii() and (word.isalnum() or (len(word) == 1 and word in _PUNCTUATION)):
                self._word_ids[word] = tuple(token.id for token in self._wordpiece.tokenize(word.lower()))
            else:
                others.append(word)
        if others:
            encoded = self._tokenizer.encode_batch(others, add_special_tokens=False)
            self._word_ids.update((w, tuple(e.ids)) for w, e in zip(others, encoded, strict=True))

    def cosines(self, first: npt.NDArray[np.int64], second: npt.NDArray[np.int64]) -> Vectors:
        """The cosine of every token of ``first`` with every token of ``second`` (their rows of the table), to
        within ~0.003: from unit rows stored as int8 with a scale per row (``unit_int8``).

        Gathering int8 rows and widening them is far cheaper than doing it from the float16 table (numpy's
        float16 -> float32 conversion is scalar); the long side goes first in the product, which OpenBLAS runs
        faster with a short second side.
        """
        short = self._terms[first].astype(np.float32) * self._scales[first, None]
        with self._widen_lock:  # the widened rows go to one reused buffer (see ``_widened``)
            products = self._widened(second) @ short.T
        products *= self._scales[second, None]
        cosines: Vectors = products.T
        return cosines

    def _widened(self, ids: npt.NDArray[np.int64]) -> Vectors:
        """The int8 rows of ``ids`` as float32, gathered and widened in buffers kept between calls (grown as
        needed; the caller holds ``_widen_lock``): fresh arrays of ~0.5 and ~1.5 MB a request would each be a
        mapping of their own (the server maps every allocation past 128 KiB, ``proxy.heap``), page faults
        included, a cost term matching would pay on every request."""
        if self._widen_buffer.shape[0] < len(ids):
            rows = max(len(ids), 2 * self._widen_buffer.shape[0])
            self._gather_buffer = np.empty((rows, self._terms.shape[1]), dtype=np.int8)
            self._widen_buffer = np.empty((rows, self._terms.shape[1]), dtype=np.float32)
        # mode "clip": with the default "raise", numpy gathers into a temporary copy of ``out`` first
        gathered = np.take(self._terms, ids, axis=0, out=self._gather_buffer[: len(ids)], mode="clip")
        out = self._widen_buffer[: len(ids)]
        np.copyto(out, gathered, casting="unsafe")
        return out


def unit_int8(table: npt.NDArray[np.floating], chunk: int = 256) -> tuple[npt.NDArray[np.int8], Vectors]:
    """The table's rows normalised to unit length, as int8 (each row scaled so its largest value is 127) and
    the per-row scale that turns them back (a row of zeros stays zeros), built a chunk at a time so the
    float32 copy never exists whole."""
    codes = np.zeros(table.shape, dtype=np.int8)
    scales = np.zeros(table.shape[0], dtype=np.float32)
    for start in range(0, table.shape[0], chunk):
        rows = table[start : start + chunk].astype(np.float32)
        norms = np.sqrt(np.einsum("ij,ij->i", rows, rows))
        rows /= np.where(norms == 0.0, np.float32(1.0), norms)[:, None]
        peak = np.abs(rows).max(axis=1) / 127.0
        peak = np.where(peak == 0.0, np.float32(1.0), peak).astype(np.float32)
        codes[start : start + chunk] = np.rint(rows / peak[:, None]).astype(np.int8)
        scales[start : start + chunk] = np.where(norms == 0.0, np.float32(0.0), peak)
    return codes, scales


class StaticEmbedder(BaseEmbedder):
    """A static model as the document model: documents and queries both embedded by ``StaticModel``.

    Cheap enough per text to need no thread of its own; texts are embedded on the caller's thread (a batch of
    documents off the loop, in the default executor, when it is big enough to be felt).
    """

    INLINE_TEXTS = 16  # up to this many texts are embedded on the loop (too little work to be worth a hop)

    def __init__(self, settings: EmbedderSettings, model_dir: Path) -> None:
        super().__init__(settings)
        self.model_dir = model_dir
        self._manifest = read_query_manifest(model_dir)
        if settings.query_model not in (None, AUTO_QUERY_MODEL):
            query_dir = resolve_query_model_dir(settings.query_model)
            if query_dir.resolve() != model_dir.resolve():
                raise EmbedderError(
                    f"embedder.query_model: {model_dir} is a static model and answers its own queries; "
                    "unset query_model"
                )
        self._model: StaticModel | None = None
        self._closed = False

    @property
    def model_id(self) -> str:
        return self._manifest.model_id

    @property
    def weights_id(self) -> str:
        return self._manifest.model_id

    @property
    def dim(self) -> int:
        return self._manifest.dim

    @property
    def _gathers_queries(self) -> bool:
        return False  # each query is embedded at once: gathering would only make it wait

    @property
    def queries_inline(self) -> bool:
        """A query is embedded on the event loop, at once (a table lookup and a mean): a read waits on nothing."""
        return True

    async def _load(self) -> None:
        if self._closed:
            raise EmbedderError("the embedder is closed")
        self._model = await asyncio.to_thread(StaticModel, self.model_dir, self.dim)

    async def _embed_batch(self, texts: list[str], *, urgent: bool = False) -> Vectors:
        model = self._model
        if model is None:
            raise EmbedderError("the embedder is closed")
        if urgent or len(texts) <= self.INLINE_TEXTS:
            return model.embed(texts)
        return await asyncio.to_thread(model.embed, texts)

    def term_vectors(self) -> StaticModel | None:
        """The model's word piece vectors for the read path's term matching (None until it is loaded)."""
        return self._model

    async def aclose(self) -> None:
        self._closed = True
        self._model = None
