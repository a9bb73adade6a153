"""The query adapter in the LoCoMo harness: one adapter per conversation, fitted on pairs the conversation itself
yields (``proxy.memory.adapter_pairs``, as the product's job mines them: a question and the other speaker's
reply that answered it; a turn and the turn of an earlier session that the next speaker's reply drew on), never
on the QA questions or their evidence.

Both speakers of a LoCoMo conversation are people talking about their lives, and its questions ask about both,
so either speaker's turn counts as a message and the other's next turn as its reply (the product takes the
user's messages and the assistant's replies). The memories a reply may draw on are the conversation's turns
(their words without the speaker's name, which every turn of that speaker shares), each a turn of the store
with its stored vector; a turn's query vector is its text embedded as a query. The adapter is kept for the
conversation only when it beats no adapter on the newest pairs (the product's rule: ``fit``'s held-out MRR).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from proxy.memory.adapter_pairs import PairRules, Remembered, Said, answered, drawn_on
from proxy.memory.adapter_training import Bank, Fit, FitSettings, Pairs, fit
from proxy.memory.embedders.protocol import Vectors
from proxy.memory.query_adapter import QueryAdapter


@dataclass(frozen=True)
class Fitted:
    """One conversation's fit: the adapter to use (None: it did not beat no adapter), and its figures."""

    adapter: QueryAdapter | None
    pairs: int
    held_out: float
    baseline: float
    epochs: int


def said_of(turns: Sequence[object]) -> tuple[list[Said], list[Remembered]]:
    """A conversation's turns (``locomo.Turn``) as messages and as memories for pair mining."""
    said, memories = [], []
    for t in turns:
        text = f"{t.text} {t.caption}" if t.caption else t.text  # type: ignore[attr-defined]
        session = f"session_{t.session}"  # type: ignore[attr-defined]
        said.append(Said(text, t.speaker, session, t.at))  # type: ignore[attr-defined]
        memories.append(Remembered(text, session, t.at))  # type: ignore[attr-defined]
    return said, memories


def fit_conversation(
    turns: Sequence[object],
    turn_vectors: Vectors,
    query_vectors: Vectors,
    model_id: str,
    settings: FitSettings | None = None,
    min_gain: float = 0.0,
) -> Fitted:
    """Mine the conversation's pairs, fit an adapter, and keep it if it beats no adapter on the held-out pairs.

    ``turn_vectors``: the stored vectors of the turns (the bank); ``query_vectors``: each turn's text embedded
    as a query.
    """
    said, memories = said_of(turns)
    speakers = tuple(dict.fromkeys(s.side for s in said))
    found = sorted(set(answered(said)) | set(drawn_on(said, memories, PairRules(sides=speakers))))
    if len(found) < 20:
        return Fitted(None, len(found), 0.0, 0.0, 0)
    rows = np.array([m for m, _ in found], dtype=np.int64)
    pairs = Pairs(query_vectors[rows], np.array([g for _, g in found], dtype=np.int64), rows)
    result: Fit = fit(pairs, Bank(turn_vectors), model_id, settings)
    keep = result.confident and result.held_out > result.baseline + min_gain
    return Fitted(result.adapter if keep else None, len(found), result.held_out, result.baseline, result.epochs)
