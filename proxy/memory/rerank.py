"""Gated rerank: a cross-encoder reorders the best fused candidates when the dense and BM25 arms disagree.

Optional and off by default. When both arms answered and their first places differ (``disagree``), the
first ``top_n`` fused candidates go to a rerank model through litellm's rerank API (``litellm.arerank``:
Cohere, Jina, Infinity, hosted vLLM, ... any provider litellm reranks with), and its order replaces the fused
order of those candidates; the rest keep their fused order below them. The reranked candidates take the
head's fused scores in the new order (the best score to the reranker's first), so the later scoring step,
which reads ``fused`` as relevance, keeps the reranker's order among equals and sees the same score scale.

Any failure (timeout, HTTP error, a malformed answer) leaves the fused order in place: ``rerank`` never
raises, logs ``memory.rerank_failed`` with the reason (``timeout`` or the error's class name, never the
query, the documents or the error message) and reports the reason for ``X-Memory-Arms``
(``degraded=rerank:<reason>``). The API key is a ``SecretStr``: it appears in no repr and no log line.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType, TracebackType
from typing import Any, Self

import structlog
from pydantic import BaseModel, ConfigDict, Field, SecretStr

from proxy.memory.fusion import Candidate, ScoredRecord
from proxy.memory.lazy import import_litellm

log = structlog.get_logger("memproxy.rerank")

ARM = "rerank"  # the name under which a failed rerank shows in ``degraded=``


class RerankSettings(BaseModel):
    """Whether and how the gated rerank runs."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool = False
    model: str = "cohere/rerank-english-v3.0"  # a litellm rerank model name: provider/model
    api_base: str | None = None  # None: the provider's public endpoint
    api_key: SecretStr | None = None  # None: the provider's usual environment variable (COHERE_API_KEY, ...)
    top_n: int = Field(default=20, ge=1)  # the best fused candidates sent to the reranker
    timeout_ms: float = Field(default=800.0, gt=0)  # the whole call; past it the fused order stands


@dataclass(frozen=True, slots=True)
class RerankResult:
    """The reranked candidates (None: not reranked, keep the fused order) and why a rerank failed."""

    candidates: list[Candidate] | None
    reason: str | None = None  # ``timeout`` or an error class name when the rerank failed; None otherwise

    @property
    def degraded(self) -> str | None:
        """The ``degraded=`` entry of ``X-Memory-Arms`` (``rerank:<reason>``), None unless the rerank failed."""
        return f"{ARM}:{self.reason}" if self.reason is not None else None


def first_place(hits: Sequence[ScoredRecord]) -> str | None:
    """The record id of an arm's best hit (ties: the smallest id, so the answer is stable); None without hits."""
    if not hits:
        return None
    return min(hits, key=lambda hit: (-float(hit.score), hit.record.id)).record.id


def disagree(dense_hits: Sequence[ScoredRecord], bm25_hits: Sequence[ScoredRecord]) -> bool:
    """Whether both arms answered and their first places are different memories."""
    dense_first, bm25_first = first_place(dense_hits), first_place(bm25_hits)
    return dense_first is not None and bm25_first is not None and dense_first != bm25_first


def reordered(candidates: Sequence[Candidate], head: int, ranking: Sequence[int]) -> list[Candidate]:
    """The first ``head`` candidates in the reranker's order, then the rest in their given order.

    ``ranking`` lists indices into the head, best first; indices out of range or repeated are ignored, and
    head candidates it leaves out follow the ranked ones in their given order. The head's fused scores,
    best first, are handed out in the new order, so ``fused`` still sorts the list.
    """
    size = min(head, len(candidates))
    order = list(dict.fromkeys(i for i in ranking if 0 <= i < size))
    order += [i for i in range(size) if i not in set(order)]
    scores = sorted((c.fused for c in candidates[:size]), reverse=True)
    ranked = [_with_fused(candidates[i], score) for i, score in zip(order, scores, strict=True)]
    return ranked + list(candidates[size:])


def _with_fused(candidate: Candidate, fused: float) -> Candidate:
    """The candidate with its fused score replaced."""
    return Candidate(candidate.record, candidate.arm_scores, fused, candidate.final, candidate.boosts)


def _reason(error: BaseException) -> str:
    """``timeout`` for any timeout (asyncio's or litellm's), else the error's class name (never its message)."""
    timeout = isinstance(error, TimeoutError) or type(error).__name__ in {"Timeout", "APITimeoutError"}
    return "timeout" if timeout else type(error).__name__


class Reranker:
    """Reranks fused candidates with a litellm rerank model; ``async with`` imports litellm off the loop."""

    def __init__(self, settings: RerankSettings) -> None:
        self._settings = settings
        self._litellm: ModuleType | None = None

    @property
    def settings(self) -> RerankSettings:
        """The settings this reranker was built with."""
        return self._settings

    async def __aenter__(self) -> Self:
        """Import litellm in a thread when enabled, so the first rerank does not stall the event loop."""
        if self._settings.enabled:
            self._litellm = await asyncio.to_thread(import_litellm)
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        """Nothing to release: litellm owns its HTTP clients."""

    def wanted(self, dense_hits: Sequence[ScoredRecord], bm25_hits: Sequence[ScoredRecord]) -> bool:
        """Whether this request should be reranked: enabled, and the dense and BM25 arms disagree."""
        return self._settings.enabled and disagree(dense_hits, bm25_hits)

    async def rerank(self, query_text: str, candidates: Sequence[Candidate]) -> RerankResult:
        """The candidates (best first, as fused) with the first ``top_n`` in the reranker's order.

        Never raises: on a timeout or any error the result holds no candidates and the reason.
        """
        head = list(candidates[: self._settings.top_n])
        if len(head) < 2:
            return RerankResult(list(candidates))
        try:
            async with asyncio.timeout(self._settings.timeout_ms / 1000):
                ranking = await self._ranking(query_text, [c.record.text for c in head])
        # Whatever the provider or litellm raised, the fused order still serves the request.
        except Exception as error:
            reason = _reason(error)
            log.warning("memory.rerank_failed", reason=reason, model=self._settings.model, documents=len(head))
            return RerankResult(None, reason)
        return RerankResult(reordered(candidates, len(head), ranking))

    async def _ranking(self, query_text: str, documents: list[str]) -> list[int]:
        """The documents' indices, most relevant first, as the rerank model orders them."""
        litellm = self._litellm or import_litellm()
        key = self._settings.api_key
        response: Any = await litellm.arerank(
            model=self._settings.model,
            query=query_text,
            documents=documents,
            top_n=len(documents),
            api_base=self._settings.api_base,
            api_key=key.get_secret_value() if key is not None else None,
            timeout=self._settings.timeout_ms / 1000,
            num_retries=0,
        )
        results = sorted(response.results, key=lambda item: -float(item["relevance_score"]))
        return [int(item["index"]) for item in results]
