"""Which memory features are live, and why: retrieval, turns, facts, summaries, insights.

``FeatureBoard`` holds one ``FeatureState`` (live or off, and the reason in words) per feature. The app seeds
it at start-up from the configuration (``proxy.feature_report``), logs one ``memory.feature`` line per feature,
and serves it in ``/readyz`` and ``/metrics``. Afterwards the memory-side calls keep it true:

- ``ReportingLLM`` wraps the memory LLM client: a call that answers puts its feature back to live; a call that
  fails for want of a usable key (``LLMConfigError``) turns it off with the reason.
- ``guard_handlers`` wraps the job handlers: it tells the LLM client whose job runs (``CURRENT_USER``), and
  turns a configuration error into ``WaitForConfig`` (the job waits, visibly, never dead-lettered for it).

Every change of state is logged once (``memory.feature``), so the log says when a feature went off and back.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import structlog

from proxy.memory.write.job_types import WaitForConfig
from proxy.memory.write.latest_chat import CURRENT_USER
from proxy.memory.write.llm import LLMClient, LLMConfigError
from proxy.memory.write.queue import Handler, Job

log = structlog.get_logger("memproxy.memory")

FEATURES = ("retrieval", "turns", "facts", "summaries", "insights")
KIND_FEATURE = {"exchange": "turns", "facts": "facts", "summary": "summaries", "insights": "insights"}
SCHEMA_FEATURE = {
    "memory_facts": "facts",
    "memory_reconcile": "facts",
    "memory_summary": "summaries",
    "memory_insight": "insights",
}
_WHY = {
    "no_key": "no key for memory-side calls (the upstream wants one)",
    "key_rejected": "the upstream rejects the key of the memory-side calls (401/403)",
    "no_model": "no model known for memory-side calls yet",
}


@dataclasses.dataclass(frozen=True, slots=True)
class FeatureState:
    """One feature: live or off, and why."""

    live: bool
    reason: str


class FeatureBoard:
    """The state of every memory feature; the configured (start-up) state is what a success restores."""

    def __init__(self) -> None:
        off = FeatureState(live=False, reason="memory is starting")
        self._configured: dict[str, FeatureState] = dict.fromkeys(FEATURES, off)
        self._states: dict[str, FeatureState] = dict(self._configured)

    def configure(self, states: Mapping[str, FeatureState]) -> None:
        """Set the start-up state of each feature (what the configuration allows)."""
        self._configured.update(states)
        self._states.update(states)

    def log_all(self) -> None:
        """One log line per feature (at start-up)."""
        for name in FEATURES:
            state = self._states[name]
            (log.info if state.live else log.warning)(
                "memory.feature", feature=name, live=state.live, reason=state.reason
            )

    def succeeded(self, feature: str) -> None:
        """A memory-side call of ``feature`` worked: live (with its configured reason, if that was live)."""
        configured = self._configured[feature]
        self._set(feature, configured if configured.live else FeatureState(True, "memory-side calls answer"))

    def waiting(self, feature: str, reason: str, detail: str) -> None:
        """Jobs of ``feature`` wait for a key or configuration: it is off until one works."""
        self._set(feature, FeatureState(live=False, reason=f"{_WHY.get(reason, reason)}: {detail}; jobs wait"))

    def _set(self, feature: str, state: FeatureState) -> None:
        if self._states.get(feature) != state:
            self._states[feature] = state
            (log.info if state.live else log.warning)(
                "memory.feature", feature=feature, live=state.live, reason=state.reason
            )

    def report(self) -> dict[str, dict[str, Any]]:
        """``{feature: {"live": bool, "reason": str}}`` in the fixed order."""
        return {name: {"live": self._states[name].live, "reason": self._states[name].reason} for name in FEATURES}

    def gauges(self) -> dict[str, float]:
        """1 per live feature, 0 per feature off."""
        return {name: float(self._states[name].live) for name in FEATURES}


class ReportingLLM:
    """``LLMClient`` that reports each call's outcome to the board (by the call's schema name)."""

    def __init__(self, inner: LLMClient, board: FeatureBoard) -> None:
        self._inner = inner
        self._board = board

    async def complete_json(
        self, model: str, messages: list[dict[str, Any]], schema: dict[str, Any], schema_name: str
    ) -> dict[str, Any]:
        """Delegate, then report."""
        feature = SCHEMA_FEATURE.get(schema_name)
        try:
            result = await self._inner.complete_json(model, messages, schema, schema_name)
        except LLMConfigError as error:
            if feature is not None:
                self._board.waiting(feature, error.reason, str(error))
            raise
        if feature is not None:
            self._board.succeeded(feature)
        return result


def guard_handlers(handlers: Mapping[str, Handler], board: FeatureBoard) -> dict[str, Handler]:
    """The handlers, each run as its job's user, with configuration errors turned into waiting jobs."""
    return {kind: _guarded(kind, handler, board) for kind, handler in handlers.items()}


def _guarded(kind: str, handler: Handler, board: FeatureBoard) -> Handler:
    async def run(job: Job) -> None:
        token = CURRENT_USER.set(job.user_id)
        try:
            await handler(job)
        except LLMConfigError as error:
            raise WaitForConfig(error.reason, str(error)) from None
        except WaitForConfig as error:
            board.waiting(KIND_FEATURE.get(kind, kind), error.reason, str(error))
            raise
        finally:
            CURRENT_USER.reset(token)

    return run
