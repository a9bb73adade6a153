"""End to end: the real ``memproxy serve`` process driven by the real openai SDKs (Python and Node)."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.support.processes import ROOT, Process, fake_upstream_process, memproxy_process

pytestmark = pytest.mark.e2e

UPSTREAM_KEY = "sk-upstream-secret-4242"
CLIENT_KEY = "sk-client-secret-9191"


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Process, str]]:
    """The fake upstream and memproxy (memory off: this module tests the proxy shell) for the module."""
    data = tmp_path_factory.mktemp("data")
    with fake_upstream_process() as (_, upstream_url):
        env = {
            "MEMPROXY_UPSTREAM__BASE_URL": upstream_url,
            "MEMPROXY_UPSTREAM__API_KEY": UPSTREAM_KEY,
            "MEMPROXY_STORAGE__PATH": str(data),
            "MEMPROXY_MEMORY__ENABLED": "false",
        }
        with memproxy_process(env) as (proc, url):
            yield proc, url


@pytest.fixture
def client(servers: tuple[Process, str]) -> openai.OpenAI:
    """A sync OpenAI client pointed at memproxy."""
    return openai.OpenAI(base_url=servers[1], api_key=CLIENT_KEY, max_retries=0)


def test_sync_non_stream(client: openai.OpenAI) -> None:
    """A plain completion comes back through the proxy."""
    reply = client.chat.completions.create(model="fake-echo", messages=[{"role": "user", "content": "hi"}])
    assert reply.choices[0].message.content == "echo: hi"


def test_sync_stream(client: openai.OpenAI) -> None:
    """A streamed completion arrives chunk by chunk with the full text."""
    stream = client.chat.completions.create(
        model="fake-echo", stream=True, messages=[{"role": "user", "content": "one two three"}]
    )
    parts = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert "".join(parts) == "echo: one two three"
    assert len(parts) > 3


async def test_async_stream_and_non_stream(servers: tuple[Process, str]) -> None:
    """The async client works for both shapes."""
    client = openai.AsyncOpenAI(base_url=servers[1], api_key=CLIENT_KEY, max_retries=0)
    reply = await client.chat.completions.create(model="fake-echo", messages=[{"role": "user", "content": "x"}])
    assert reply.choices[0].message.content == "echo: x"
    stream = await client.chat.completions.create(
        model="fake-echo", stream=True, messages=[{"role": "user", "content": "y z"}]
    )
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert text == "echo: y z"
    await client.close()


def test_tools(client: openai.OpenAI) -> None:
    """Tool calls come back intact."""
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    reply = client.chat.completions.create(
        model="fake-tools",
        tools=tools,  # type: ignore[arg-type]
        messages=[{"role": "user", "content": "weather?"}],
    )
    call = reply.choices[0].message.tool_calls[0]  # type: ignore[index]
    assert call.function.name == "get_weather"  # type: ignore[union-attr]
    assert json.loads(call.function.arguments) == {"city": "Paris"}  # type: ignore[union-attr]


def test_json_mode(client: openai.OpenAI) -> None:
    """response_format json_object reaches the upstream and JSON comes back."""
    reply = client.chat.completions.create(
        model="fake-echo", response_format={"type": "json_object"}, messages=[{"role": "user", "content": "q"}]
    )
    assert json.loads(reply.choices[0].message.content or "") == {"echo": "q"}


@pytest.mark.parametrize(
    ("model", "exc"),
    [
        ("fake-error-400", openai.BadRequestError),
        ("fake-error-401", openai.AuthenticationError),
        ("fake-error-404", openai.NotFoundError),
        ("fake-error-429", openai.RateLimitError),
        ("fake-error-500", openai.InternalServerError),
    ],
)
def test_errors_raise_the_right_exception(client: openai.OpenAI, model: str, exc: type[Exception]) -> None:
    """Upstream errors surface as the SDK's own exception classes."""
    with pytest.raises(exc):
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}])


def test_missing_messages_is_bad_request(client: openai.OpenAI) -> None:
    """A request without messages is refused by the proxy itself, in a form the SDK understands."""
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="fake-echo", messages=[])
    assert info.value.status_code == 400


def test_midstream_failure_raises_in_sdk(client: openai.OpenAI) -> None:
    """An upstream dying mid-stream surfaces as an APIError from the stream."""
    stream = client.chat.completions.create(
        model="fake-midstream-fail", stream=True, messages=[{"role": "user", "content": "a b c d"}]
    )
    with pytest.raises(openai.APIError):
        for _ in stream:
            pass


def test_node_sdk(servers: tuple[Process, str]) -> None:
    """The official Node openai SDK works through the proxy, stream and non-stream."""
    node = shutil.which("node")
    script = ROOT / "tests" / "node" / "smoke.mjs"
    if node is None or not (ROOT / "tests" / "node" / "node_modules" / "openai").exists():
        pytest.fail("node and tests/node/node_modules are installed by `make test`")
    result = subprocess.run(
        [node, str(script), servers[1]],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=Path(script).parent,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"plain": "echo: from node", "streamed": "echo: node streams too"}


def test_no_keys_in_logs(servers: tuple[Process, str], client: openai.OpenAI) -> None:
    """After a full run, neither the upstream key nor the client key appears in memproxy's output."""
    client.chat.completions.create(model="fake-echo", messages=[{"role": "user", "content": "secret?"}])
    proc = servers[0]
    assert '"event":"request.completed"' in proc.output
    assert UPSTREAM_KEY not in proc.output
    assert CLIENT_KEY not in proc.output
    assert "secret?" not in proc.output  # message content is not logged at info
