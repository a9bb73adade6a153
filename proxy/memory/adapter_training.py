"""Fitting a user's query adapter (``query_adapter``) on (query, memory) pairs: numpy only, deterministic.

The loss is the seed's (001): InfoNCE (temperature ``tau``) towards the memory that answered the query, plus
``subject_weight`` x InfoNCE towards that memory's subject (when it has one), plus ``anchor_weight`` x a
reconstruction anchor (the squared distance between the adapted and the original query). The negatives of a
pair are the other pairs' memories in its batch and its hard negatives: the memories that share a subject with
the answer (the subject graph) and the query's nearest memories, hardest first. Any negative whose similarity to
the query is above ``margin`` x the answer's is dropped (it is likely a second answer, not a wrong one).

Pairs are taken in time order: the oldest train the adapter, the next ones stop it early (dropout and decoupled
weight decay regularise it too), and the newest ``held_out`` share score it: an adapter ships only when it ranks
the held-out answers better than the current one does, by more than the noise of so few pairs (``beats``: a
paired test of the per-pair reciprocal ranks).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import numpy.typing as npt

from proxy.memory.query_adapter import ALPHA, HIDDEN, Matrix, QueryAdapter, residual

Ints = npt.NDArray[np.int64]
_CHUNK = 256  # queries scored against the bank at once


@dataclass(frozen=True)
class FitSettings:
    """How an adapter is fitted (the seed's values where it gives them)."""

    hidden: int = HIDDEN
    alpha: float = ALPHA
    tau: float = 0.05
    subject_weight: float = 0.2
    anchor_weight: float = 0.5
    margin: float = 0.95  # negatives above margin x the answer's similarity are dropped
    hard_k: int = 16  # hard negatives per pair
    dropout: float = 0.1
    weight_decay: float = 0.01
    learning_rate: float = 1e-3
    batch: int = 64
    max_epochs: int = 40
    patience: int = 4  # epochs without a better early-stopping MRR before training stops
    validation: float = 0.15  # share of the training pairs (the newest) that stop training early
    held_out: float = 0.2  # share of all pairs (the newest) that decide whether the adapter ships
    ship_z: float = 1.64  # ...when its gain there is this many standard errors above zero (``beats``)
    seed: int = 0


@dataclass(frozen=True)
class Bank:
    """A user's memories (unit rows), their subjects' vectors, and which subjects each memory is linked to."""

    vectors: Matrix
    subjects: Matrix = field(default_factory=lambda: np.zeros((0, 1), dtype=np.float32))
    subjects_of: Sequence[Sequence[int]] = ()  # per memory: indexes into ``subjects`` (empty: none)

    def siblings(self) -> list[list[int]]:
        """Per memory, the other memories that share a subject with it (the subject graph's neighbours)."""
        members: dict[int, list[int]] = {}
        for memory, subjects in enumerate(self.subjects_of):
            for s in subjects:
                members.setdefault(s, []).append(memory)
        out: list[list[int]] = []
        for memory in range(len(self.vectors)):
            linked = self.subjects_of[memory] if memory < len(self.subjects_of) else ()
            out.append(sorted({m for s in linked for m in members[s] if m != memory}))
        return out


@dataclass(frozen=True)
class Pairs:
    """Training pairs in time order: a query vector, the memory (index into the bank) that answered it, and the
    query it belongs to (``group``: one query may have several answers, never each other's negatives)."""

    queries: Matrix
    gold: Ints
    group: Ints

    def __len__(self) -> int:
        return len(self.gold)

    def take(self, rows: Ints) -> Pairs:
        """The pairs at ``rows``."""
        return Pairs(self.queries[rows], self.gold[rows], self.group[rows])


@dataclass(frozen=True)
class Fit:
    """A fitted adapter and how it scored: MRR on the held-out pairs with it and without any adapter, and
    whether it beats no adapter there with confidence (``beats``)."""

    adapter: QueryAdapter
    held_out: float
    baseline: float
    epochs: int
    held_out_pairs: int
    confident: bool


def split(pairs: Pairs, settings: FitSettings) -> tuple[Pairs, Pairs, Pairs]:
    """Train, early-stopping and held-out pairs, in time order (no query's pairs straddle two parts)."""
    n = len(pairs)
    cut_held = _group_start(pairs.group, round(n * (1 - settings.held_out)))
    cut_val = _group_start(pairs.group, round(cut_held * (1 - settings.validation)))
    rows = np.arange(n)
    return pairs.take(rows[:cut_val]), pairs.take(rows[cut_val:cut_held]), pairs.take(rows[cut_held:])


def _group_start(group: Ints, cut: int) -> int:
    """``cut`` moved back to the first pair of its query."""
    while 0 < cut < len(group) and group[cut] == group[cut - 1]:
        cut -= 1
    return cut


def mrr(queries: Matrix, pairs: Pairs, bank: Bank) -> float:
    """Mean reciprocal rank of each pair's answer among all the bank's memories (the query's other answers
    left out), for these (already adapted) query vectors."""
    return float(reciprocal_ranks(queries, pairs, bank).mean()) if len(pairs) else 0.0


def beats(new: Matrix, old: Matrix, z: float) -> bool:
    """Whether per-pair reciprocal ranks ``new`` are better than ``old`` on the same pairs, with confidence: the
    mean gain is more than ``z`` standard errors above zero (a paired one-sided test; z 1.64 ~ 95%)."""
    gain = new - old
    if len(gain) < 2:
        return False
    return bool(float(gain.mean()) > z * float(gain.std(ddof=1)) / np.sqrt(len(gain)))


def reciprocal_ranks(queries: Matrix, pairs: Pairs, bank: Bank) -> Matrix:
    """Per pair, 1 / the rank of its answer (see ``mrr``)."""
    out = np.zeros(len(pairs), dtype=np.float32)
    others = _other_answers(pairs)
    for start in range(0, len(pairs), _CHUNK):
        rows = slice(start, start + _CHUNK)
        sims = queries[rows] @ bank.vectors.T
        gold = pairs.gold[rows]
        gold_sims = sims[np.arange(len(gold)), gold]
        above = (sims > gold_sims[:, None]).sum(axis=1)
        for i, extra in enumerate(others[rows]):
            above[i] -= int((sims[i, extra] > gold_sims[i]).sum())
        out[rows] = 1.0 / (1.0 + above)
    return out


def _other_answers(pairs: Pairs) -> npt.NDArray[np.object_]:
    """Per pair, the other answers of its query."""
    by_group: dict[int, list[int]] = {}
    for g, gold in zip(pairs.group.tolist(), pairs.gold.tolist(), strict=True):
        by_group.setdefault(g, []).append(gold)
    out = np.empty(len(pairs), dtype=object)
    for i, (g, gold) in enumerate(zip(pairs.group.tolist(), pairs.gold.tolist(), strict=True)):
        out[i] = np.array([x for x in by_group[g] if x != gold], dtype=np.int64)
    return out


def hard_negatives(pairs: Pairs, bank: Bank, settings: FitSettings) -> Ints:
    """Per pair, up to ``hard_k`` hard negatives (bank indexes, -1 padded): the answer's subject-graph siblings
    first, then the query's nearest memories, hardest first; none above ``margin`` x the answer's similarity."""
    siblings = bank.siblings() if len(bank.subjects_of) else [[] for _ in range(len(bank.vectors))]
    others = _other_answers(pairs)
    out = np.full((len(pairs), settings.hard_k), -1, dtype=np.int64)
    for start in range(0, len(pairs), _CHUNK):
        sims = pairs.queries[start : start + _CHUNK] @ bank.vectors.T
        for i, row in enumerate(sims):
            p = start + i
            out[p] = _negatives_of(row, int(pairs.gold[p]), siblings[pairs.gold[p]], others[p], settings)
    return out


def _negatives_of(sims: Matrix, gold: int, siblings: Sequence[int], others: Ints, settings: FitSettings) -> Ints:
    """One pair's hard negatives (see ``hard_negatives``)."""
    ceiling = settings.margin * max(float(sims[gold]), 0.0)
    excluded = {gold, *others.tolist()}
    depth = min(settings.hard_k * 4, len(sims))
    top = np.argpartition(-sims, depth - 1)[:depth]
    near = top[np.argsort(-sims[top])].tolist()
    by_subject = sorted(siblings, key=lambda m: -sims[m])[: settings.hard_k // 2]
    chosen: list[int] = []
    for m in [*by_subject, *near]:
        if m not in excluded and sims[m] <= ceiling and m not in chosen:
            chosen.append(m)
    chosen = chosen[: settings.hard_k]
    return np.array(chosen + [-1] * (settings.hard_k - len(chosen)), dtype=np.int64)


@dataclass
class _Params:
    w1: Matrix
    b1: Matrix
    w2: Matrix
    b2: Matrix

    def arrays(self) -> list[Matrix]:
        return [self.w1, self.b1, self.w2, self.b2]

    def copy(self) -> _Params:
        return _Params(*(a.copy() for a in self.arrays()))


def _initial(dim: int, settings: FitSettings, rng: np.random.Generator) -> _Params:
    """He-initialised first layer, zero output layer: the adapter starts as the identity."""
    w1 = (rng.standard_normal((dim, settings.hidden)) * np.sqrt(2.0 / dim)).astype(np.float32)
    zeros = np.zeros
    return _Params(
        w1, zeros(settings.hidden, np.float32), zeros((settings.hidden, dim), np.float32), zeros(dim, np.float32)
    )


def _adapter(params: _Params, settings: FitSettings, model_id: str) -> QueryAdapter:
    return QueryAdapter(params.w1, params.b1, params.w2, params.b2, model_id=model_id, alpha=settings.alpha)


def fit(pairs: Pairs, bank: Bank, model_id: str, settings: FitSettings | None = None) -> Fit:
    """Train an adapter on the older pairs, stop early on the next ones, score it on the newest."""
    settings = settings or FitSettings()
    train, val, held = split(pairs, settings)
    rng = np.random.default_rng(settings.seed)
    params = _initial(pairs.queries.shape[1], settings, rng)
    negatives = hard_negatives(train, bank, settings)
    best, best_score, stale, epochs = params.copy(), mrr(val.queries, val, bank), 0, 0
    optimiser = _AdamW(params, settings)
    for epochs in range(1, settings.max_epochs + 1):  # noqa: B007 - the count is reported
        for rows in _batches(len(train), settings.batch, rng):
            grads = _gradients(params, train.take(rows), negatives[rows], bank, settings, rng)
            optimiser.step(params, grads)
        score = mrr(_adapter(params, settings, model_id).apply(val.queries), val, bank)
        if score > best_score:
            best, best_score, stale = params.copy(), score, 0
        else:
            stale += 1
            if stale >= settings.patience:
                break
    adapter = _adapter(best, settings, model_id)
    adapted, plain = (
        reciprocal_ranks(adapter.apply(held.queries), held, bank),
        reciprocal_ranks(held.queries, held, bank),
    )
    held_score, baseline = float(adapted.mean()) if len(held) else 0.0, float(plain.mean()) if len(held) else 0.0
    adapter = replace(adapter, held_out=round(held_score, 4), baseline=round(baseline, 4), pairs=len(train))
    return Fit(adapter, held_score, baseline, epochs, len(held), beats(adapted, plain, settings.ship_z))


def _batches(n: int, size: int, rng: np.random.Generator) -> list[Ints]:
    order = rng.permutation(n)
    return [order[i : i + size] for i in range(0, n, size) if len(order[i : i + size]) > 1]


def _gradients(
    params: _Params, batch: Pairs, negatives: Ints, bank: Bank, settings: FitSettings, rng: np.random.Generator
) -> list[Matrix]:
    """The loss's gradient with respect to each weight, for one batch (dropout on the hidden layer)."""
    q = batch.queries
    z = q @ params.w1 + params.b1
    keep = (rng.random(z.shape) >= settings.dropout).astype(np.float32) / (1.0 - settings.dropout)
    hidden = np.maximum(z, 0.0) * keep
    moved = q + settings.alpha * (hidden @ params.w2 + params.b2)
    norm = np.linalg.norm(moved, axis=1, keepdims=True)
    adapted = moved / norm
    grad = _answer_grad(adapted, q, batch, negatives, bank, settings)
    grad += settings.subject_weight * _subject_grad(adapted, batch, bank, settings)
    grad += settings.anchor_weight * 2.0 * (adapted - q) / len(q)
    g_moved = (grad - adapted * (grad * adapted).sum(axis=1, keepdims=True)) / norm
    g_out = settings.alpha * g_moved
    g_z = (g_out @ params.w2.T) * keep * (z > 0)
    return [q.T @ g_z, g_z.sum(axis=0), hidden.T @ g_out, g_out.sum(axis=0)]


def _answer_grad(
    adapted: Matrix, q: Matrix, batch: Pairs, negatives: Ints, bank: Bank, settings: FitSettings
) -> Matrix:
    """d(InfoNCE towards the answer)/d(adapted query), over in-batch answers and hard negatives."""
    golds = bank.vectors[batch.gold]
    hard = bank.vectors[np.maximum(negatives, 0)]
    n = len(q)
    original = q @ golds.T
    own = np.diag(original)
    same = (batch.group[:, None] == batch.group[None, :]) | (batch.gold[:, None] == batch.gold[None, :])
    false = original > settings.margin * np.maximum(own, 0.0)[:, None]
    masked_batch = (same | false) & ~np.eye(n, dtype=bool)
    logits = np.concatenate([adapted @ golds.T, np.einsum("bd,bkd->bk", adapted, hard)], axis=1) / settings.tau
    mask = np.concatenate([masked_batch, negatives < 0], axis=1)
    probs = _softmax(np.where(mask, -np.inf, logits))
    probs[np.arange(n), np.arange(n)] -= 1.0
    probs /= n * settings.tau
    out: Matrix = (probs[:, :n] @ golds + np.einsum("bk,bkd->bd", probs[:, n:], hard)).astype(np.float32)
    return out


def _subject_grad(adapted: Matrix, batch: Pairs, bank: Bank, settings: FitSettings) -> Matrix:
    """d(InfoNCE towards the answer's first subject)/d(adapted query); zero for answers without one."""
    out = np.zeros_like(adapted)
    if not len(bank.subjects_of) or len(bank.subjects) == 0:
        return out
    linked = [bank.subjects_of[g] if g < len(bank.subjects_of) else () for g in batch.gold.tolist()]
    rows = np.array([i for i, s in enumerate(linked) if s], dtype=np.int64)
    if not len(rows):
        return out
    target = np.array([linked[i][0] for i in rows], dtype=np.int64)
    logits = adapted[rows] @ bank.subjects.T / settings.tau
    for r, i in enumerate(rows.tolist()):
        logits[r, [s for s in linked[i][1:]]] = -np.inf  # the answer's other subjects are not wrong either
    probs = _softmax(logits)
    probs[np.arange(len(rows)), target] -= 1.0
    out[rows] = (probs @ bank.subjects / (len(adapted) * settings.tau)).astype(np.float32)
    return out


def _softmax(logits: Matrix) -> Matrix:
    shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
    out: Matrix = (shifted / shifted.sum(axis=1, keepdims=True)).astype(np.float32)
    return out


class _AdamW:
    """Adam with decoupled weight decay on the two weight matrices."""

    def __init__(self, params: _Params, settings: FitSettings) -> None:
        self._m = [np.zeros_like(a) for a in params.arrays()]
        self._v = [np.zeros_like(a) for a in params.arrays()]
        self._t = 0
        self._lr, self._decay = settings.learning_rate, settings.weight_decay

    def step(self, params: _Params, grads: Sequence[Matrix], b1: float = 0.9, b2: float = 0.999) -> None:
        self._t += 1
        for i, (value, grad) in enumerate(zip(params.arrays(), grads, strict=True)):
            self._m[i] = b1 * self._m[i] + (1 - b1) * grad
            self._v[i] = b2 * self._v[i] + (1 - b2) * grad * grad
            m_hat, v_hat = self._m[i] / (1 - b1**self._t), self._v[i] / (1 - b2**self._t)
            if value.ndim == 2:
                value *= 1 - self._lr * self._decay
            value -= (self._lr * m_hat / (np.sqrt(v_hat) + 1e-8)).astype(np.float32)


__all__ = [
    "Bank", "Fit", "FitSettings", "Pairs", "beats", "fit", "hard_negatives", "mrr", "reciprocal_ranks", "residual",
    "split",
]  # fmt: skip
