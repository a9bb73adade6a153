"""A fake of Cohere's rerank API for the gated rerank: aiohttp on 127.0.0.1, port 0.

litellm's ``cohere/...`` rerank models POST ``{api_base}/v2/rerank`` (``/v1/rerank`` when the base ends so);
both are answered. A document's relevance is the fraction of the query's words it holds, so tests can
predict the order. Knobs: ``delay_s`` (the answer waits this long, or until the server closes), ``status``
(answer every call with this HTTP error instead). Every call is recorded with its Authorization header.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import re
from types import TracebackType
from typing import Any

from aiohttp import web

_WORD = re.compile(r"\w+")


@dataclasses.dataclass(frozen=True)
class RerankCall:
    """One request the fake received: its path, JSON body and Authorization header."""

    path: str
    body: dict[str, Any]
    authorization: str | None


def relevance(query: str, document: str) -> float:
    """The fraction of the query's distinct words found in the document (case-insensitive)."""
    wanted = set(_WORD.findall(query.lower()))
    if not wanted:
        return 0.0
    return len(wanted & set(_WORD.findall(document.lower()))) / len(wanted)


def ranked(query: str, documents: list[str], top_n: int | None) -> list[dict[str, Any]]:
    """Cohere-style results: index and relevance_score, best first (ties: lower index first)."""
    scores = [(relevance(query, doc), index) for index, doc in enumerate(documents)]
    scores.sort(key=lambda pair: (-pair[0], pair[1]))
    return [{"index": index, "relevance_score": score} for score, index in scores[:top_n]]


class FakeRerank:
    """The fake server; ``api_base`` is what the reranker's settings take."""

    def __init__(self, *, delay_s: float = 0.0, status: int | None = None) -> None:
        self.delay_s = delay_s
        self.status = status
        self.calls: list[RerankCall] = []
        self._runner: web.AppRunner | None = None
        self._closing = asyncio.Event()
        self.port = 0

    @property
    def api_base(self) -> str:
        """Where the fake listens."""
        return f"http://127.0.0.1:{self.port}"

    async def __aenter__(self) -> FakeRerank:
        app = web.Application()
        app.router.add_post("/v1/rerank", self._handle)
        app.router.add_post("/v2/rerank", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = self._runner.addresses[0][1]
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._closing.set()  # delayed answers stop waiting, so cleanup does not wait for them
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _handle(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.calls.append(RerankCall(request.path, body, request.headers.get("Authorization")))
        if self.delay_s:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._closing.wait(), self.delay_s)
        if self.status is not None:
            error = {"message": "fake rerank failure"}
            return web.json_response(error, status=self.status)
        results = ranked(body["query"], body["documents"], body.get("top_n"))
        return web.json_response({"id": "rerank-fake", "results": results, "meta": {"billed_units": {}}})
