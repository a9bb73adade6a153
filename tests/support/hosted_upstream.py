"""A fake hosted API: ``FakeUpstream`` that wants a key, like every hosted provider, and writes real memories.

- Every ``/v1/...`` request without ``Authorization: Bearer <key>``, or with a key not in ``keys`` (when
  given; an empty set rejects every key), gets 401 with an OpenAI-style ``invalid_api_key`` error.
- Memory-side calls (a ``json_schema`` response format) get content: one fact per user message that says
  something about the user ("I", "my"), a summary naming the conversation's first user turn, and an insight
  naming the topic of the quoted messages (``InsightWriter``); reconciliation adds.
- ``memory_keys`` (when given) are the keys memory-side calls are accepted with, apart from the chat's.
- ``calls`` records (path, key or None, schema name or "") of every request, so tests can check which key
  each memory-side call carried.

``hosted_upstream`` serves it from its own thread and loop, for tests that drive the real CLI with the sync
openai SDK.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
from collections.abc import Awaitable, Callable, Collection, Iterator
from contextlib import contextmanager
from typing import Any

import orjson
from aiohttp import web

from tests.fake_upstream import FakeUpstream, completion
from tests.support.fake_insight_llm import InsightWriter
from tests.support.fake_llm import fact, schema_of

_ABOUT_USER = re.compile(r"\b(i|i'm|my|me)\b", re.IGNORECASE)


def memory_answer(schema: str, body: dict[str, Any], insights: InsightWriter) -> dict[str, Any]:
    """The JSON a sensible model would give for one memory-side call."""
    data = json.loads(body["messages"][-1]["content"])
    if schema == "memory_facts" and "exchanges" in data:  # a window of exchanges: each fact names its exchange
        said = [(item["n"], text) for item in data["exchanges"] for text in item["user"] if _ABOUT_USER.search(text)]
        return {
            "facts": [
                fact(text.removeprefix("Remember that ").rstrip(".!"), importance=6, exchange=n) for n, text in said
            ]
        }
    if schema == "memory_facts":
        said = [text for text in data.get("user_messages", []) if _ABOUT_USER.search(text)]
        return {"facts": [fact(text.removeprefix("Remember that ").rstrip(".!"), importance=6) for text in said]}
    if schema == "memory_reconcile":
        return {"decision": "ADD", "target": 0, "text": ""}
    if schema == "memory_reconcile_many":
        return {
            "decisions": [
                {"fact": item["fact"], "decision": "ADD", "target": 0, "text": ""} for item in data.get("new_facts", [])
            ]
        }
    if schema == "memory_summary":
        turns = [t.split(": ", 1) for t in data.get("turns", [])]  # "role: text" lines
        first = next((t[1] for t in turns if len(t) == 2 and t[0] == "user"), "")
        return {"summary": f"The user talked about: {first[:120]}", "topics": []}
    if schema == "memory_insight":
        return insights(schema, body)
    raise AssertionError(f"unexpected memory-side call {schema}")


class HostedUpstream(FakeUpstream):
    """The fake with a hosted API's key check and sensible memory-side answers."""

    def __init__(
        self, *, keys: Collection[str] | None = None, memory_keys: Collection[str] | None = None, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self.keys = keys
        self.memory_keys_accepted = memory_keys  # None: as ``keys``; else memory-side calls need one of these
        self.calls: list[tuple[str, str | None, str]] = []
        self.insights = InsightWriter()

    def app(self) -> web.Application:
        """The fake's routes behind the key check."""
        app = super().app()
        app.middlewares.append(self._check_key)
        return app

    @web.middleware
    async def _check_key(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        scheme, _, key = request.headers.get("Authorization", "").partition(" ")
        given = key.strip() if scheme.lower() == "bearer" and key.strip() else None
        schema = schema_of(await request.json()) if request.method == "POST" else ""
        self.calls.append((request.path, given, schema))
        accepted = self.memory_keys_accepted if schema and self.memory_keys_accepted is not None else self.keys
        if given is None or (accepted is not None and given not in accepted):
            message = "You didn't provide an API key." if given is None else "Incorrect API key provided."
            error = {
                "error": {"message": message, "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}
            }
            return web.json_response(error, status=401)
        if schema:
            return self._memory(schema, await request.json())
        return await handler(request)

    def _memory(self, schema: str, body: dict[str, Any]) -> web.Response:
        self.structured_calls.append(body)
        content = json.dumps(memory_answer(schema, body, self.insights))
        message = completion(str(body.get("model")), content)
        return web.json_response(message, dumps=lambda o: orjson.dumps(o).decode())

    def memory_keys(self, schema: str) -> list[str | None]:
        """The keys memory-side calls of ``schema`` carried, in order."""
        return [key for _, key, name in self.calls if name == schema]


@contextmanager
def hosted_upstream(keys: Collection[str] | None = None) -> Iterator[HostedUpstream]:
    """A ``HostedUpstream`` served on 127.0.0.1 from its own thread; stopped on exit."""
    fake = HostedUpstream(keys=keys)
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    stop = asyncio.Event()

    async def serve() -> None:
        async with fake:
            ready.set()
            await stop.wait()

    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), name="hosted-upstream", daemon=True)
    thread.start()
    assert ready.wait(30), "the hosted fake did not start"
    try:
        yield fake
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(30)
        loop.close()
