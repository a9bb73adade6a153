"""Stated facts: a fact an agent hands over directly (MCP ``add_memory``), taken in like an extracted one.

No model reads a chat here: the text is the fact. It still goes the way an extracted fact goes (``facts``):
the screens of ``fact_screens`` (poisoning always; sensitive content and identifiers unless the text itself asks
to remember them), reconciliation with the user's nearest valid facts (a duplicate is not stored twice; a close
one is superseded or kept beside it by the memory-side model, when a model is known for the user, else added),
and the subject records of the names it carries (``fact_apply``). The names are the text's capitalised words
after the first: the extraction model's entities are not at hand.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from datetime import datetime

import structlog

from proxy.memory.events import MemoryEvents
from proxy.memory.store.memory_store import MemoryStore
from proxy.memory.store.records import Kind, MemoryRecord
from proxy.memory.words import STOPWORDS, cased_words
from proxy.memory.write.extraction import (
    ExtractedFact,
    ExtractionFailed,
    Extractor,
    Neighbour,
    Plan,
    shortcut_plan,
)
from proxy.memory.write.fact_apply import apply_plan
from proxy.memory.write.fact_screens import screen_fact
from proxy.memory.write.llm import LLMUnavailable
from proxy.memory.write.prompts import ExchangeText
from proxy.memory.write.settings import WriterSettings
from proxy.memory.write.subjects import SubjectLinker

log = structlog.get_logger("memproxy.writer")


@dataclasses.dataclass(frozen=True, slots=True)
class Stated:
    """What became of a stated fact: ``added``, ``updated`` (superseded a close one), ``duplicate`` (the record
    is the one already stored) or ``rejected`` (``reason`` names the screen)."""

    outcome: str
    record: MemoryRecord | None = None
    reason: str | None = None


def stated_names(text: str) -> tuple[str, ...]:
    """Capitalised words of ``text`` after its first (which may be capitalised only as the sentence's start)."""
    names = [t for t in cased_words(text)[1:] if t[0].isupper() and len(t) > 1 and t.lower() not in STOPWORDS]
    return tuple(dict.fromkeys(names))


class StatedFacts:
    """Takes in facts stated directly, over one store, with the write path's screens and reconciliation."""

    def __init__(
        self,
        settings: WriterSettings,
        store: MemoryStore,
        extractor: Extractor,
        events: MemoryEvents,
        model_of: Callable[[str], str | None],
    ) -> None:
        self.settings = settings
        self._store = store
        self._extractor = extractor
        self._events = events
        self._model_of = model_of
        self._subjects = SubjectLinker(store)

    async def add(self, user_id: str, text: str, expires_at: datetime | None = None) -> Stated:
        """Screen, reconcile and store ``text`` as one of the user's facts."""
        fact = ExtractedFact(
            text=text, category="other", importance=7, entities=stated_names(text), sensitive=False,
            sensitive_category="none", explicit_request=True,
        )  # fmt: skip
        screened = screen_fact(fact, ExchangeText((text,), ""), self._extractor.settings)
        if isinstance(screened, str):
            log.info("memory.rejected", reason=screened, step="stated")
            return Stated("rejected", reason=screened)
        [vector] = await self._store.embedder.embed_documents([screened.fact.text])
        hits = await self._store.vector_search(user_id, vector, self.settings.reconcile_neighbours, kinds=[Kind.FACT])
        near = [Neighbour(hit.record.id, hit.record.text, hit.score) for hit in hits]
        plan = await self._plan(user_id, screened.fact.text, near)
        if plan.action == "skip":
            same = next((hit.record for hit in hits if hit.score >= self.settings.reconcile_min_similarity), None)
            return Stated("duplicate", same)
        record = MemoryRecord(
            user_id=user_id, kind=Kind.FACT, text=plan.text, category=fact.category, importance=fact.importance,
            entities=fact.entities, meta=json.dumps({"source": "stated", "explicit": screened.explicit}),
            expires_at=expires_at,
        )  # fmt: skip
        if plan.text == screened.fact.text:
            record = record.replace(embedding=[float(x) for x in vector], model_id=self._store.embedder.model_id)
        stored = await apply_plan(self._store, self._subjects, self._events, user_id, plan, record)
        return Stated("updated" if plan.action == "supersede" else "added", stored)

    async def _plan(self, user_id: str, text: str, near: Sequence[Neighbour]) -> Plan:
        """Add when nothing stored is close, skip the same words; else the memory-side model decides (add when no
        model is known for the user or it fails). A merged text is screened again."""
        floor = self.settings.reconcile_min_similarity
        plan = shortcut_plan(text, near, floor)
        model = self.settings.model or self._model_of(user_id)
        if plan is not None or model is None:
            return plan or Plan("add", text)
        try:
            plan = await self._extractor.decide(model, text, [n for n in near if n.score >= floor])
        except (LLMUnavailable, ExtractionFailed) as error:
            log.warning("memory.step_failed", step="reconcile", reason=str(error)[:300])
            return Plan("add", text)
        if plan.action == "invalidate":  # the stated fact is what holds now: it takes the retired one's place
            return Plan("supersede", text, plan.target_id)
        if plan.action == "supersede" and plan.text != text:
            merged = ExtractedFact(text=plan.text, category="other", importance=7, sensitive=False,
                                   sensitive_category="none", explicit_request=True)  # fmt: skip
            if isinstance(screen_fact(merged, ExchangeText((text,), ""), self._extractor.settings), str):
                return Plan("add", text)
        return plan
