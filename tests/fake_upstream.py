"""A fake OpenAI-compatible upstream: aiohttp on 127.0.0.1, port 0, scripted by model name.

Models (anything else answers like ``fake-echo``):
- ``fake-echo``: replies ``echo: <last user message>``; streams it word by word when ``stream`` is true.
- ``fake-slow``: waits ``slow_s`` seconds before answering.
- ``fake-drip``: streams one chunk every ``drip_s`` seconds, 200 chunks (for disconnect tests).
- ``fake-error-<status>``: answers that status with an OpenAI error body.
- ``fake-midstream-fail``: sends two chunks, then drops the connection.
- ``fake-tools``: answers with a tool call to the first declared tool.
The Responses API, Anthropic's Messages API and embeddings are served too (``tests.fake_dialects``). A body whose
``metadata`` holds ``fake_reply`` is answered with that text (benchmarks replaying a dialog).
A ``json_schema`` response_format (memory-side calls) gets the smallest instance of the schema. A request without
a bearer key gets a 401 in OpenAI's shape (Anthropic's for its dialect), as from every hosted API.
It records every request (headers and JSON) in ``requests`` and counts streams cut by the client in
``disconnects``. Run as a script (``python -m tests.fake_upstream --port N --latency-ms L``) for benchmarks.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from typing import Any

import orjson
from aiohttp import web

from tests.fake_dialects import MEMORY_PART, DialectRoutes, minimal_instance, openai_key_missing, scripted_reply


def _last_user_text(body: dict[str, Any]) -> str:
    """The app's own text of the last user message (memory parts memproxy attached to it left out)."""
    for message in reversed(body.get("messages") or []):
        if message.get("role") == "user":
            content = message.get("content")
            if isinstance(content, list):
                parts = [p.get("text", "") for p in content if isinstance(p, dict)]
                return " ".join(p for p in parts if not p.startswith("<memory>"))
            return MEMORY_PART.sub("", str(content))
    return ""


def completion(
    model: str, content: str | None, *, tool_calls: list[dict[str, Any]] | None = None, finish: str = "stop"
) -> dict[str, Any]:
    """A chat.completion object."""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {
        "id": "chatcmpl-fake",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
        "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15},
    }


def chunk(model: str, delta: dict[str, Any], finish: str | None = None) -> bytes:
    """One SSE event holding a chat.completion.chunk."""
    payload = {
        "id": "chatcmpl-fake",
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }
    return b"data: " + orjson.dumps(payload) + b"\n\n"


APP_KEY = "sk-app-key-for-tests"  # what an app's OpenAI client sends (the SDKs always send a key)


class FakeUpstream:
    """The fake server; ``async with FakeUpstream() as fake`` gives ``fake.base_url``."""

    def __init__(
        self,
        *,
        latency_s: float = 0.0,
        slow_s: float = 2.0,
        drip_s: float = 0.05,
        port: int = 0,
        record: bool = True,
    ) -> None:
        self.latency_s = latency_s
        self.slow_s = slow_s
        self.drip_s = drip_s
        self.port = port
        self.record = record
        self.requests: list[dict[str, Any]] = []
        self.disconnects = 0
        self.disconnected = asyncio.Event()
        self.reply_override: str | None = None
        self.structured_calls: list[dict[str, Any]] = []
        self._runner: web.AppRunner | None = None

    @property
    def base_url(self) -> str:
        """The OpenAI-style base URL (ends with ``/v1``)."""
        return f"http://127.0.0.1:{self.port}/v1"

    def app(self) -> web.Application:
        """The aiohttp application."""
        app = web.Application(client_max_size=16 * 2**20)  # as large as any body memproxy accepts
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        DialectRoutes(self.requests, self.latency_s, record=self.record).add(app)  # Responses, Messages, embeddings
        if self.record:  # what a test in another process checks: every request received so far
            app.router.add_get("/_fake/requests", self._recorded)
        return app

    async def _recorded(self, request: web.Request) -> web.Response:
        return web.json_response(
            self.requests, dumps=lambda o: orjson.dumps(o, option=orjson.OPT_NON_STR_KEYS).decode()
        )

    async def __aenter__(self) -> FakeUpstream:
        self._runner = web.AppRunner(self.app(), access_log=None, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port)
        await site.start()
        self.port = self._runner.addresses[0][1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _models(self, request: web.Request) -> web.Response:
        data = [{"id": "fake-echo", "object": "model", "created": 0, "owned_by": "fake"}]
        return web.json_response({"object": "list", "data": data})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json(loads=orjson.loads)
        if self.record:
            self.requests.append({"path": request.path, "headers": dict(request.headers), "json": body})
        if (missing := openai_key_missing(request)) is not None:  # as any hosted API
            return missing
        model = str(body.get("model", ""))
        if self.latency_s:
            await asyncio.sleep(self.latency_s)
        if model.startswith("fake-error-"):
            status = int(model.rsplit("-", 1)[1])
            error = {
                "error": {
                    "message": f"scripted error {status}",
                    "type": "invalid_request_error",
                    "param": None,
                    "code": f"fake_{status}",
                }
            }
            return web.json_response(error, status=status)
        if model == "fake-slow":
            await asyncio.sleep(self.slow_s)
        if model == "fake-tools":
            return await self._tools(request, body)
        text = self.reply_override if self.reply_override is not None else f"echo: {_last_user_text(body)}"
        text = scripted_reply(body) or text
        response_format = body.get("response_format") or {}
        if response_format.get("type") == "json_object":
            text = orjson.dumps({"echo": _last_user_text(body)}).decode()
        elif response_format.get("type") == "json_schema":
            self.structured_calls.append(body)
            text = orjson.dumps(minimal_instance(response_format["json_schema"]["schema"])).decode()
        if body.get("stream"):
            return await self._stream(request, model, text)
        return web.json_response(completion(model, text), dumps=lambda o: orjson.dumps(o).decode())

    async def _tools(self, request: web.Request, body: dict[str, Any]) -> web.Response:
        name = body["tools"][0]["function"]["name"]
        call = {"id": "call_1", "type": "function", "function": {"name": name, "arguments": '{"city": "Paris"}'}}
        return web.json_response(completion(body["model"], None, tool_calls=[call], finish="tool_calls"))

    async def _stream(self, request: web.Request, model: str, text: str) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "x-request-id": "fake-req"})
        await response.prepare(request)
        try:
            await self._stream_body(request, response, model, text)
        except (asyncio.CancelledError, ConnectionResetError):
            self.disconnects += 1
            self.disconnected.set()
            raise
        return response

    async def _stream_body(self, request: web.Request, response: web.StreamResponse, model: str, text: str) -> None:
        await response.write(chunk(model, {"role": "assistant", "content": ""}))
        if model == "fake-drip":
            for index in range(200):
                await asyncio.sleep(self.drip_s)
                await response.write(chunk(model, {"content": f"w{index} "}))
        words = text.split(" ")
        for index, word in enumerate(words):
            await response.write(chunk(model, {"content": word if index == 0 else f" {word}"}))
            if model == "fake-midstream-fail" and index == 1:
                if request.transport is not None:
                    request.transport.abort()
                return
        await response.write(chunk(model, {}, "stop"))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()


async def _main(port: int, latency_ms: float, record: bool) -> None:
    async with FakeUpstream(latency_s=latency_ms / 1000, port=port, record=record) as fake:
        print(f"fake upstream on {fake.base_url}", flush=True)
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.Event().wait()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--latency-ms", type=float, default=0.0)
    parser.add_argument("--record", action="store_true", help="keep requests for GET /_fake/requests")
    cli = parser.parse_args()
    asyncio.run(_main(cli.port, cli.latency_ms, cli.record))
