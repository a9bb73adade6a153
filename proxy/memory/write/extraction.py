"""The memory-side model calls (extract, reconcile, summarise): each answer validated, and what it means.

A wrong memory is worse than none: it is repeated in every later chat. So the model's answer is never trusted
alone: it must fit a strict schema (``prompts``), and the screens (``fact_screens``) check every fact in code
before the writer stores it. Bad model output (invalid JSON, wrong fields, a refusal) gets one retry with the
error named, then ``ExtractionFailed``. A reconciliation decision becomes a ``Plan`` (add, supersede,
invalidate or skip), without a model call when nothing stored is near (``shortcut_plan``).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from typing import Any, Literal, TypeVar

import structlog
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from proxy.memory.errors import MemoryLayerError
from proxy.memory.write.llm import LLMBadOutput, LLMClient
from proxy.memory.write.prompts import (
    CATEGORIES,
    FACTS_SCHEMA,
    RECONCILE_MANY_SCHEMA,
    RECONCILE_SCHEMA,
    SENSITIVE_CATEGORIES,
    SUMMARY_SCHEMA,
    WINDOW_FACTS_SCHEMA,
    ExchangeText,
    extraction_messages,
    reconcile_many_messages,
    reconcile_messages,
    summary_messages,
    window_messages,
)

log = structlog.get_logger("memproxy.extraction")

T = TypeVar("T")

DEFAULT_BLOCKED = frozenset(
    {"health", "religion", "politics", "sexual_orientation", "ethnicity", "criminal_record",
     "union_membership", "identifier", "unspecified", "pattern"}
)  # fmt: skip


class ExtractionFailed(MemoryLayerError):
    """The model gave no usable answer twice; the step is abandoned (the reason is in the message)."""


class ExtractionSettings(BaseModel):
    """What the screens block and how much text the memory-side calls see."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    blocked_sensitive: frozenset[str] = DEFAULT_BLOCKED
    extra_sensitive_patterns: tuple[str, ...] = ()
    extra_injection_patterns: tuple[str, ...] = ()
    max_facts: int = Field(default=10, ge=1)
    max_fact_chars: int = Field(default=300, ge=20)
    max_input_chars: int = Field(default=12_000, ge=500)


class ExtractedFact(BaseModel):
    """One fact as the model returned it (validated; unknown categories become "other")."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    text: str = Field(min_length=1)
    category: str
    importance: int
    entities: tuple[str, ...] = ()
    sensitive: bool
    sensitive_category: str
    explicit_request: bool = False

    @field_validator("text")
    @classmethod
    def _strip(cls, value: str) -> str:
        value = " ".join(value.split())
        if not value:
            raise ValueError("empty fact text")
        return value

    @field_validator("category")
    @classmethod
    def _known_category(cls, value: str) -> str:
        return value if value in CATEGORIES else "other"

    @field_validator("importance")
    @classmethod
    def _clamp(cls, value: int) -> int:
        return min(10, max(1, value))

    @field_validator("sensitive_category")
    @classmethod
    def _known_sensitive(cls, value: str) -> str:
        return value if value in SENSITIVE_CATEGORIES else "unspecified"


class ExtractedFacts(BaseModel):
    """The extraction answer."""

    model_config = ConfigDict(frozen=True, extra="ignore")
    facts: tuple[ExtractedFact, ...]


class Decision(BaseModel):
    """The reconciliation answer for one new fact."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    decision: Literal["ADD", "UPDATE", "DELETE", "NONE"]
    target: int = 0
    text: str = ""


class Summary(BaseModel):
    """The summariser's answer."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    summary: str = Field(min_length=1)
    topics: tuple[str, ...] = ()


class WindowFact(ExtractedFact):
    """One fact found in a window of exchanges, with the number (from 1) of the exchange it came from."""

    exchange: int = 0


class WindowFacts(BaseModel):
    """The window extraction answer."""

    model_config = ConfigDict(frozen=True, extra="ignore")
    facts: tuple[WindowFact, ...]


class NumberedDecision(Decision):
    """One decision of a batched reconciliation, for new fact number ``fact`` (from 1)."""

    fact: int


class Decisions(BaseModel):
    """The batched reconciliation answer."""

    model_config = ConfigDict(frozen=True, extra="ignore")
    decisions: tuple[NumberedDecision, ...]


def normalise(text: str) -> str:
    """Text folded for duplicate detection: lower case, words only."""
    return " ".join(re.findall(r"\w+", text.lower()))


@dataclasses.dataclass(frozen=True)
class Neighbour:
    """An existing valid fact near a new one."""

    id: str
    text: str
    score: float


@dataclasses.dataclass(frozen=True)
class Plan:
    """What to do with one new fact: add it, supersede ``target_id`` with ``text``, invalidate it, or skip."""

    action: Literal["add", "supersede", "invalidate", "skip"]
    text: str
    target_id: str | None = None


def shortcut_plan(candidate: str, neighbours: Sequence[Neighbour], min_similarity: float) -> Plan | None:
    """A plan needing no model call: nothing close enough means add, the same text means skip."""
    close = [n for n in neighbours if n.score >= min_similarity]
    if not close:
        return Plan("add", candidate)
    if any(normalise(n.text) == normalise(candidate) for n in close):
        return Plan("skip", candidate)
    return None


def plan_from_decision(candidate: str, neighbours: Sequence[Neighbour], decision: Decision) -> Plan:
    """The plan a reconciliation decision stands for; ``ValueError`` if it names no existing fact."""
    if decision.decision == "ADD":
        return Plan("add", candidate)
    if decision.decision == "NONE":
        return Plan("skip", candidate)
    if not 1 <= decision.target <= len(neighbours):
        raise ValueError(f"{decision.decision} names fact {decision.target}, but there are {len(neighbours)}")
    target = neighbours[decision.target - 1].id
    if decision.decision == "DELETE":
        return Plan("invalidate", candidate, target)
    text = " ".join(decision.text.split()) or candidate
    return Plan("supersede", text, target)


class Extractor:
    """The memory-side LLM calls (extract, reconcile, summarise), each retried once on bad output."""

    def __init__(self, settings: ExtractionSettings, llm: LLMClient) -> None:
        self.settings = settings
        self._llm = llm

    async def extract(self, model: str, exchange: ExchangeText) -> list[ExtractedFact]:
        """The facts the model finds in the exchange (not yet screened)."""
        messages = extraction_messages(exchange, self.settings.max_input_chars)
        answer = await self._ask(model, messages, FACTS_SCHEMA, "memory_facts", ExtractedFacts.model_validate)
        return list(answer.facts)

    async def decide(self, model: str, candidate: str, neighbours: Sequence[Neighbour]) -> Plan:
        """The reconciliation plan for one new fact against its nearest existing facts."""
        messages = reconcile_messages(candidate, [n.text for n in neighbours])

        def parse(raw: dict[str, Any]) -> Plan:
            return plan_from_decision(candidate, neighbours, Decision.model_validate(raw))

        return await self._ask(model, messages, RECONCILE_SCHEMA, "memory_reconcile", parse)

    async def extract_window(
        self, model: str, exchanges: Sequence[ExchangeText], reply_chars: int = 300
    ) -> list[WindowFact]:
        """The facts the model finds in a window of exchanges, each naming its exchange (not yet screened)."""
        messages = window_messages(exchanges, self.settings.max_input_chars, reply_chars)
        answer = await self._ask(model, messages, WINDOW_FACTS_SCHEMA, "memory_facts", WindowFacts.model_validate)
        return list(answer.facts)

    async def decide_many(self, model: str, items: Sequence[tuple[str, Sequence[Neighbour]]]) -> list[Plan]:
        """One reconciliation plan per new fact, in one call; a fact the model leaves out is added."""
        messages = reconcile_many_messages([(text, [n.text for n in near]) for text, near in items])

        def parse(raw: dict[str, Any]) -> list[Plan]:
            by_fact = {d.fact: d for d in Decisions.model_validate(raw).decisions}
            default = Decision(decision="ADD")
            decisions = [by_fact.get(n, default) for n in range(1, len(items) + 1)]
            return [plan_from_decision(t, near, d) for (t, near), d in zip(items, decisions, strict=True)]

        return await self._ask(model, messages, RECONCILE_MANY_SCHEMA, "memory_reconcile_many", parse)

    async def summarise(self, model: str, previous: str | None, turns: Sequence[tuple[str, str]]) -> Summary:
        """A summary of ``turns`` (updating ``previous`` when given)."""
        messages = summary_messages(previous, turns, self.settings.max_input_chars)
        return await self._ask(model, messages, SUMMARY_SCHEMA, "memory_summary", Summary.model_validate)

    async def _ask(
        self, model: str, messages: list[dict[str, Any]], schema: dict[str, Any], name: str,
        parse: Callable[[dict[str, Any]], T],
    ) -> T:  # fmt: skip
        reason = ""
        for attempt in (1, 2):
            try:
                return parse(await self._llm.complete_json(model, messages, schema, name))
            except (LLMBadOutput, ValidationError, ValueError) as error:
                reason = _reason(error)
                log.warning("memory.bad_output", call=name, attempt=attempt, reason=reason)
                messages = [*messages, _retry_note(reason)]
        raise ExtractionFailed(f"{name}: {reason}")


def _reason(error: Exception) -> str:
    if isinstance(error, ValidationError):
        first = error.errors()[0]
        return f"wrong fields: {'.'.join(str(p) for p in first['loc'])}: {first['msg']}"
    return str(error)[:300]


def _retry_note(reason: str) -> dict[str, Any]:
    return {
        "role": "user",
        "content": f"Your previous answer was unusable ({reason}). Answer again with exactly one JSON object "
        "that follows the schema.",
    }
