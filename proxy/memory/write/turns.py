"""The turn records of an exchange: each text screened, ids fixed by the job, and vectors that carry context."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import numpy as np

from proxy.memory.embedders.protocol import Vectors
from proxy.memory.store.records import Kind, MemoryRecord
from proxy.memory.write.extraction import ExtractionSettings
from proxy.memory.write.payloads import ExchangePayload, derived_id
from proxy.memory.write.screens import ScreenedText, remembered_identifiers, screen_text
from proxy.memory.write.tool_turns import tool_turn_texts


def screened_turn(text: str, p: ExchangePayload, screens: ExtractionSettings) -> ScreenedText:
    """One turn's text as stored: identifiers redacted (but those asked to remember), instructions flagged."""
    keep = remembered_identifiers(p.user_messages, screens.extra_sensitive_patterns)
    return screen_text(text, keep=keep, extra_identifiers=screens.extra_sensitive_patterns,
                       extra_instructions=screens.extra_injection_patterns)  # fmt: skip


def turn_records(
    job_id: str, user_id: str, p: ExchangePayload, screens: ExtractionSettings | None = None
) -> list[MemoryRecord]:
    """The turn records of an exchange: user messages just before the reply, the reply marked if partial;
    each text screened (``screened_turn``)."""
    end = datetime.fromtimestamp(p.finished_at, UTC)
    meta = json.dumps({"job_id": job_id, "model": p.model})
    texts = [("user", text, False) for text in p.user_messages if text.strip()]
    texts += tool_turn_texts(p.tool_results, p.reply, p.partial, p.tool_calls)
    screened = [screened_turn(text, p, screens or ExtractionSettings()) for _, text, _ in texts]
    return [
        MemoryRecord(
            user_id=user_id,
            kind=Kind.TURN,
            text=seen.text,
            id=derived_id(job_id, "turn", i),
            created_at=end - timedelta(microseconds=len(texts) - 1 - i),
            conversation_id=p.conversation_id,
            role=role,
            partial=partial,
            sensitive=seen.sensitive is not None,
            meta=meta,
            flagged=seen.flagged,
        )
        for i, ((role, _, partial), seen) in enumerate(zip(texts, screened, strict=True))
    ]


def context_vector(own: Vectors, previous: Vectors, weight: float) -> Vectors:
    """A turn's vector that also carries the turn it answers, so that a question about either finds it.

    Unit ``(1 - weight) * own + weight * unit(own + previous)``, row-wise for matrices, where ``previous`` is the
    previous turn's own vector (a zero row: none). The pair's direction is the sum of the two turns' vectors
    rather than an embedding of the two texts together: one embedding per turn instead of two (the pair's text is
    also twice as long), at the same recall (LoCoMo default R@10 0.730 vs 0.728, MRR 0.503 vs 0.507).
    """
    return _unit((1.0 - weight) * own + weight * _unit(own + previous))


def exchange_context_vectors(own: Vectors, before: Vectors | None, weight: float) -> Vectors:
    """``context_vector`` of an exchange's turns (rows of ``own``), each after its predecessor: the first after
    ``before``, the own vector of the turn before the exchange (None: the first turn alone)."""
    first = before[np.newaxis] if before is not None else np.zeros_like(own[:1])
    return context_vector(own, np.vstack([first, own[:-1]]), weight)


def _unit(rows: Vectors) -> Vectors:
    norms = np.linalg.norm(rows, axis=-1, keepdims=True)
    return (rows / np.where(norms == 0.0, 1.0, norms)).astype(np.float32, copy=False)
