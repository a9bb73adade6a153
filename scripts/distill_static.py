"""Distil a static model from the shipped all-MiniLM-L6-v2, offline (numpy + onnxruntime, no hub, no torch).

A static model embeds a text as the mean of one learnt vector per WordPiece token: ~0.1 ms a text instead of
a transformer pass. Its vectors are trained to land in MiniLM's own space, so it serves as MiniLM's query side
(documents embedded by MiniLM: the default, ``models/minilm-static`` embeds each question for ~0.07 ms), or
as the document model itself (``model_path = "models/minilm-static"``: ~0.05 ms a stored turn).

1. Start (model2vec-style): every vocabulary token alone through the shipped ONNX model (``[CLS] tok [SEP]``,
   mean pooled), one row per token (centring them fitted the
   teacher better, cosine 0.742 vs 0.725 on held-out questions, but retrieved worse: LoCoMo dense R@10 0.436 vs 0.473).
2. Fit: token vectors ``W`` such that the mean of a text's token rows regresses onto MiniLM's sentence vector of
   the same text, on a corpus of sentences and of short word windows cut from them (query-sized), by ridge
   regression towards the start: ``min ||A W - Y||^2 + lam ||W - W0||^2`` (``A``: token counts / length),
   solved with conjugate gradients, one independent system per output dimension, all at once.
3. Centre: subtract the corpus's mean sentence vector from every row (a text's vector is the mean of its rows,
   so every text moves by the same vector). Uncentred, the static vectors crowd together: on
   twenty chat sentences of four topics unrelated texts sat at cosine 0.23 (MiniLM: 0.10) and the centroids of four
   distinct topics at 0.50 (MiniLM: 0.25), which the thresholds calibrated on MiniLM (insight clustering's
   merge and cohesion, the writer's "a stored fact is near") would misread; centred: 0.13 and 0.34, the topics'
   cohesion 0.63 (MiniLM 0.62), at equal LoCoMo retrieval (default R@10 0.725 either way).

The corpus (``--corpus generic``, the default) is generic English from Debian packages, fetched with
``apt-get download``: WordNet 3.0's glosses and usage examples and the fortune cookies, ~300k texts with their
windows. No LoCoMo text is used, so every LoCoMo conversation measures text the model never saw; the held-out
cosine is over LoCoMo's questions. ``--corpus locomo`` fits on LoCoMo's tune split (conversations 0-4) as the
first static query side did. Writes ``models/<name>/`` (``manifest.json``, ``vectors.npy`` float16,
``tokenizer.json``) and prints the held-out cosine to MiniLM::

    PYTHONPATH=. .venv/bin/python scripts/distill_static.py            # models/minilm-static
"""

from __future__ import annotations

import argparse
import json
import random
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import numpy.typing as npt
import onnxruntime as ort
import scipy.sparse as sp
from tokenizers import Tokenizer

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.locomo import DATA, load_conversations  # noqa: E402 - after the path is set

SOURCE = REPO / "models" / "all-MiniLM-L6-v2"
Floats = npt.NDArray[np.float32]


def session(model_dir: Path, threads: int) -> ort.InferenceSession:
    """The shipped ONNX model on ``threads`` CPU threads."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    return ort.InferenceSession(str(model_dir / "model.onnx"), options, providers=["CPUExecutionProvider"])


def tokenizer(model_dir: Path) -> Tokenizer:
    """The model's WordPiece tokenizer, without the fixed padding stored in its file."""
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    tok.no_padding()
    tok.enable_truncation(256)
    return tok


def pooled(onnx: ort.InferenceSession, ids: npt.NDArray[np.int64], mask: npt.NDArray[np.int64]) -> Floats:
    """Mean-pooled, unit last hidden states (sentence-transformers' pooling for this model)."""
    (hidden,) = onnx.run(None, {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)})
    summed = (hidden * mask[..., None]).sum(axis=1) / mask.sum(axis=1, keepdims=True)
    return (summed / np.linalg.norm(summed, axis=1, keepdims=True)).astype(np.float32)


def token_start(onnx: ort.InferenceSession, vocab: int, batch: int = 2048) -> Floats:
    """Each vocabulary token alone through the model: ``[CLS] t [SEP]``, mean pooled."""
    rows = []
    for start in range(0, vocab, batch):
        ids = np.arange(start, min(start + batch, vocab), dtype=np.int64)
        seq = np.stack([np.full_like(ids, 101), ids, np.full_like(ids, 102)], axis=1)
        rows.append(pooled(onnx, seq, np.ones_like(seq)))
    return np.concatenate(rows)


def sentence_targets(onnx: ort.InferenceSession, tok: Tokenizer, texts: Sequence[str], batch: int = 64) -> Floats:
    """MiniLM's sentence vectors of ``texts`` (batched by length so that batches pad little)."""
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
    out = np.empty((len(texts), 384), dtype=np.float32)
    for start in range(0, len(order), batch):
        if start % (batch * 20) == 0:
            print(f"  targets {start}/{len(texts)}", file=sys.stderr, flush=True)
        chunk = order[start : start + batch]
        encoded = [tok.encode(texts[i]) for i in chunk]
        width = max(len(e.ids) for e in encoded)
        ids = np.zeros((len(chunk), width), dtype=np.int64)
        mask = np.zeros_like(ids)
        for row, e in enumerate(encoded):
            ids[row, : len(e.ids)] = e.ids
            mask[row, : len(e.ids)] = 1
        out[chunk] = pooled(onnx, ids, mask)
    return out


def design(tok: Tokenizer, texts: Sequence[str], vocab: int) -> sp.csr_matrix:
    """Row i: the mean-pooling weights of text i's tokens (special tokens left out, as the query side does)."""
    rows, cols, vals = [], [], []
    for i, text in enumerate(texts):
        ids = tok.encode(text, add_special_tokens=False).ids or [100]
        rows += [i] * len(ids)
        cols += ids
        vals += [1.0 / len(ids)] * len(ids)
    return sp.csr_matrix((vals, (rows, cols)), shape=(len(texts), vocab), dtype=np.float32)


def ridge_cg(a: sp.csr_matrix, y: Floats, start: Floats, lam: float, iterations: int) -> Floats:
    """``argmin ||a w - y||^2 + lam ||w - start||^2`` by conjugate gradients, every column at once."""
    at = a.T.tocsr()

    def apply(w: Floats) -> Floats:
        return np.asarray(at @ (a @ w)) + lam * w

    w = start.copy()
    residual = (np.asarray(at @ y) + lam * start) - apply(w)
    direction = residual.copy()
    rr = (residual * residual).sum(axis=0)
    for _ in range(iterations):
        ad = apply(direction)
        alpha = rr / np.maximum((direction * ad).sum(axis=0), 1e-30)
        w += direction * alpha
        residual -= ad * alpha
        rr_next = (residual * residual).sum(axis=0)
        direction = residual + direction * (rr_next / np.maximum(rr, 1e-30))
        rr = rr_next
    return w


def static_vectors(tok: Tokenizer, table: Floats, texts: Sequence[str]) -> Floats:
    """The static model's unit vectors of ``texts`` (what the runtime query side computes)."""
    out = np.zeros((len(texts), table.shape[1]), dtype=np.float32)
    for i, text in enumerate(texts):
        ids = tok.encode(text, add_special_tokens=False).ids
        if ids:
            v = table[ids].mean(axis=0)
            out[i] = v / max(float(np.linalg.norm(v)), 1e-12)
    return out


_WORDS = re.compile(r"\S+")


def windows(texts: Sequence[str], per_text: int, rng: random.Random) -> list[str]:
    """Query-sized pieces: ``per_text`` random runs of 3-12 words from each text."""
    out = []
    for text in texts:
        words = _WORDS.findall(text)
        for _ in range(per_text if len(words) > 4 else 0):
            size = rng.randint(3, min(12, len(words)))
            start = rng.randint(0, len(words) - size)
            out.append(" ".join(words[start : start + size]))
    return out


def corpus(conversations: Sequence[int], rng: random.Random) -> tuple[list[str], list[str]]:
    """(training texts, held-out texts): the tune conversations' turns, observations, questions and windows;
    held out: the questions of the other conversations."""
    convs = load_conversations(DATA)
    train, held = [], []
    for conv in convs:
        texts = [t.memory_text for t in conv.turns]
        texts += [o.text for o in conv.observations] + [q.text for q in conv.questions]
        if conv.index in conversations:
            train += texts + windows(texts, 1, rng)
        else:
            held += [q.text for q in conv.questions]
    return list(dict.fromkeys(train)), list(dict.fromkeys(held))


CORPORA = {
    "generic": "WordNet 3.0 glosses and examples and fortune cookies, from Debian",
    "locomo": "LoCoMo conversations 0-4",
}
GENERIC_PACKAGES = ("wordnet-base", "fortunes-min", "fortunes")  # Debian packages of plain English text
_QUOTED = re.compile(r'"([^"]{8,})"')


def debian_texts(work: Path) -> list[str]:
    """Generic English from Debian packages (fetched with ``apt-get download`` into ``work``): WordNet 3.0's
    glosses and usage examples (every noun, verb, adjective and adverb sense) and the fortune cookies
    (quotations, dialogue, jokes). Nothing of LoCoMo."""
    root = work / "debian"
    if not (root / "usr").is_dir():
        root.mkdir(parents=True, exist_ok=True)
        subprocess.run(["apt-get", "download", *GENERIC_PACKAGES], cwd=work, check=True, capture_output=True)
        for deb in sorted(work.glob("*.deb")):
            subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
    texts: list[str] = []
    for part in ("noun", "verb", "adj", "adv"):
        for line in (root / "usr/share/wordnet" / f"data.{part}").read_text(encoding="utf-8").splitlines():
            if line.startswith(" ") or " | " not in line:
                continue
            gloss = line.split(" | ", 1)[1].strip()
            texts += _QUOTED.findall(gloss)
            texts.append(_QUOTED.sub("", gloss).strip(" ;"))
    for path in sorted((root / "usr/share/games/fortunes").iterdir()):
        if path.suffix or path.name in {"art", "ascii-art"}:
            continue
        for entry in path.read_text(encoding="utf-8", errors="replace").split("\n%\n"):
            text = " ".join(entry.split())
            if 8 <= len(text) <= 600:
                texts.append(text)
    return [t for t in dict.fromkeys(texts) if len(t) >= 8]


def generic_notice(work: Path) -> str:
    """What the generic corpus's packages ask to be kept with derived work: their copyright files."""
    parts = ["The token vectors were fitted on text from these Debian packages (their copyright files follow).\n"]
    for package in GENERIC_PACKAGES:
        copyright_file = work / "debian/usr/share/doc" / package / "copyright"
        parts.append(f"\n==== {package} ====\n{copyright_file.read_text(encoding='utf-8')}")
    return "".join(parts)


def generic_corpus(work: Path, rng: random.Random) -> tuple[list[str], list[str]]:
    """(training texts, held-out texts): Debian's English plus query-sized windows of it; held out: every
    LoCoMo question (the model sees no LoCoMo text at all)."""
    texts = debian_texts(work)
    held = [q.text for conv in load_conversations(DATA) for q in conv.questions]
    return list(dict.fromkeys(texts + windows(texts, 1, rng))), list(dict.fromkeys(held))


def cosines(a: Floats, b: Floats) -> float:
    """Mean row-wise cosine of two unit matrices."""
    return float((a * b).sum(axis=1).mean())


def write(
    target: Path,
    table: Floats,
    lam: float,
    held_cos: float,
    start_cos: float,
    train_size: int,
    corpus: str,
    centred: bool,
    notice: str | None,
) -> None:
    """The model directory: vectors (float16), the tokenizer, and a manifest naming the space it serves."""
    target.mkdir(parents=True, exist_ok=True)
    np.save(target / "vectors.npy", table.astype(np.float16))
    shutil.copy(SOURCE / "tokenizer.json", target / "tokenizer.json")
    shutil.copy(SOURCE / "LICENSE", target / "LICENSE")
    if notice is not None:  # the fitting texts' own terms, kept with what was derived from them
        target.joinpath("NOTICE").write_text(notice)
    source = json.loads((SOURCE / "manifest.json").read_text())
    manifest = {
        "model_id": f"local/{target.name}-v1",
        "kind": "static",
        "query_for": source["model_id"],
        "dim": int(table.shape[1]),
        "source": f"distilled from models/all-MiniLM-L6-v2 ({source['model_id']})",
        "built_with": f"scripts/distill_static.py --corpus {corpus} "
        f"(ridge lam={lam}, {train_size} texts: {CORPORA[corpus]})",
        "held_out_cosine_to_source": round(held_cos, 4),
        "held_out_cosine_to_source_before_fit": round(start_cos, 4),
        "centred": centred,
        "licence": "Apache-2.0 (derived from sentence-transformers/all-MiniLM-L6-v2)",
    }
    (target / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")


def main() -> None:
    """Build, fit, check on held-out questions, write."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "models" / "minilm-static")
    parser.add_argument("--lam", type=float, nargs="*", default=[0.01], help="ridge strengths tried")
    parser.add_argument("--iterations", type=int, default=60)
    parser.add_argument(
        "--no-centre", dest="centre", action="store_false", help="keep the fitted rows as they are (see step 3)"
    )
    parser.add_argument(
        "--corpus",
        choices=("generic", "locomo"),
        default="generic",
        help="generic: Debian's WordNet glosses and fortunes (default); locomo: LoCoMo's tune split",
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--work",
        type=Path,
        default=Path("/tmp/distill-static"),  # noqa: S108 - scratch
        help="cache of teacher vectors",
    )
    args = parser.parse_args()
    rng = random.Random(13)
    onnx, tok = session(SOURCE, args.threads), tokenizer(SOURCE)
    vocab = tok.get_vocab_size()
    started = time.perf_counter()
    train, held = generic_corpus(args.work, rng) if args.corpus == "generic" else corpus(range(5), rng)
    cached = args.work / f"targets-{args.corpus}.npz"
    if cached.exists():  # the slow part (the teacher over every text) is kept between fits
        with np.load(cached) as saved:
            start, y_train, y_held = saved["start"], saved["train"], saved["held"]
    else:
        start = token_start(onnx, vocab)
        print(f"token vectors: {start.shape} in {time.perf_counter() - started:.0f} s", file=sys.stderr)
        y_train = sentence_targets(onnx, tok, train)
        y_held = sentence_targets(onnx, tok, held)
        args.work.mkdir(parents=True, exist_ok=True)
        np.savez(cached, start=start, train=y_train, held=y_held)
    print(f"targets: {len(train)} train, {len(held)} held out, {time.perf_counter() - started:.0f} s", file=sys.stderr)
    start_cos = cosines(static_vectors(tok, start, held), y_held)
    a = design(tok, train, vocab)
    best: tuple[float, float, Floats] | None = None
    for lam in args.lam:
        table = ridge_cg(a, y_train, start, lam, args.iterations)
        held_cos = cosines(static_vectors(tok, table, held), y_held)
        print(f"lam {lam}: held-out cosine {held_cos:.4f} (start {start_cos:.4f})", file=sys.stderr)
        if best is None or held_cos > best[1]:
            best = (lam, held_cos, table)
    assert best is not None
    table = best[2] - np.asarray(a.mean(axis=0)) @ best[2] if args.centre else best[2]
    notice = generic_notice(args.work) if args.corpus == "generic" else None
    write(args.out, table, best[0], best[1], start_cos, len(train), args.corpus, args.centre, notice)
    print(json.dumps({"lam": best[0], "held_out_cosine": round(best[1], 4), "start_cosine": round(start_cos, 4)}))


if __name__ == "__main__":
    main()
