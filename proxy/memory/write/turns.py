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


def context_vector(own: Vectors, with_previous: Vectors, weight: float) -> Vectors:
    """Unit ``(1 - weight) * own + weight * with_previous`` (row-wise for matrices): a turn's vector that also
    carries the turn it answers, so that a question about either finds it."""
    mixed = ((1.0 - weight) * own + weight * with_previous).astype(np.float32)
    norms = np.linalg.norm(mixed, axis=-1, keepdims=True)
    return (mixed / np.where(norms == 0.0, 1.0, norms)).astype(np.float32, copy=False)
