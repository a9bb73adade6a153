"""Who may use the proxy: client keys bound to namespaces, no open relay, no cross-origin browser writes,
served Host names pinned."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import openai
import pytest

from proxy.access import host_allowed, is_loopback, key_hash, open_relay_problem
from proxy.config import ConfigError, load_settings
from proxy.state import STATE
from tests.conftest import ProxyFactory
from tests.fake_upstream import FakeUpstream
from tests.support.settle import settled

CHAT = "/v1/chat/completions"
KEY_A, KEY_B = "mp-app-a-key-0123456789", "mp-app-b-key-9876543210"
CLIENTS = [{"namespace": "appA", "key_sha256": key_hash(KEY_A)}, {"namespace": "appB", "key_sha256": key_hash(KEY_B)}]
ADMIN = "admin-key-for-tests"


def _chat(text: str) -> dict[str, Any]:
    return {"model": "fake-echo", "messages": [{"role": "user", "content": text}]}


def _auth(key: str, **extra: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}", **extra}


# --- client keys ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong-key"}, {"Authorization": KEY_A}])
async def test_missing_or_wrong_client_key_is_401(headers: dict[str, str], make_proxy: ProxyFactory,
                                                  fake: FakeUpstream) -> None:  # fmt: skip
    """With client keys configured, no key, a wrong key or a malformed header is a 401 in OpenAI's shape."""
    proxy = await make_proxy(clients=CLIENTS, app_key=None)
    response = await proxy.post(CHAT, json=_chat("hi"), headers=headers)
    assert response.status == 401
    error = (await response.json())["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == "invalid_api_key"
    assert fake.requests == []
    models = await proxy.get("/v1/models", headers=headers)
    assert models.status == 401


async def test_client_key_is_never_sent_upstream(make_proxy: ProxyFactory, fake: FakeUpstream) -> None:
    """A valid client key is served, and the upstream gets the configured key, never the client's."""
    proxy = await make_proxy(clients=CLIENTS, upstream={"api_key": "sk-upstream"})
    response = await proxy.post(CHAT, json=_chat("hi"), headers=_auth(KEY_A))
    assert response.status == 200
    assert fake.requests[-1]["headers"]["Authorization"] == "Bearer sk-upstream"


async def test_apps_cannot_reach_each_others_users(make_proxy: ProxyFactory, fake: FakeUpstream) -> None:
    """App A's alice and app B's alice are different users: B's requests never see what A's alice said."""
    proxy = await make_proxy(clients=CLIENTS, admin={"api_key": ADMIN}, upstream={"api_key": "sk-upstream"})
    told = await proxy.post(
        CHAT,
        json=_chat("Remember that my sister Priya moved to Lisbon last spring."),
        headers=_auth(KEY_A, **{"X-Memory-User": "alice", "X-Memory-Conversation": "c1"}),
    )
    assert told.status == 200
    await settled(proxy)
    question = _chat("Where does my sister Priya live now?")
    as_b = await proxy.post(CHAT, json=question, headers=_auth(KEY_B, **{"X-Memory-User": "alice"}))
    assert as_b.headers["X-Memory-Injected"] == "0"
    assert "Lisbon" not in str(fake.requests[-1]["json"])
    as_b_body = await proxy.post(CHAT, json={**question, "user": "appA:alice"}, headers=_auth(KEY_B))
    assert as_b_body.headers["X-Memory-Injected"] == "0"
    as_a = await proxy.post(CHAT, json=question, headers=_auth(KEY_A, **{"X-Memory-User": "alice"}))
    assert int(as_a.headers["X-Memory-Injected"]) >= 1
    assert "Lisbon" in str(fake.requests[-1]["json"]["messages"][0]["content"])
    await settled(proxy)
    users = await (await proxy.get("/v1/memory/users", headers=_auth(ADMIN))).json()
    # Each app's alice is its own user, namespaced by the app; a body naming another app's user stays in B's space.
    listed = sorted(u["user_id"] if isinstance(u, dict) else u for u in users["data"])
    assert listed == ["appA:alice", "appB:alice", "appB:appA:alice"]


async def test_openai_sdk_sees_an_authentication_error(make_proxy: ProxyFactory) -> None:
    """The real openai SDK raises AuthenticationError for a wrong client key and answers with the right one."""
    proxy = await make_proxy(clients=CLIENTS, upstream={"api_key": "sk-upstream"})
    base = str(proxy.make_url("/v1"))
    wrong = openai.AsyncOpenAI(base_url=base, api_key="sk-not-a-client", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        await wrong.chat.completions.create(model="fake-echo", messages=[{"role": "user", "content": "hi"}])
    right = openai.AsyncOpenAI(base_url=base, api_key=KEY_A, max_retries=0)
    answer = await right.chat.completions.create(model="fake-echo", messages=[{"role": "user", "content": "hi"}])
    assert answer.choices[0].message.content == "echo: hi"
    await wrong.close()
    await right.close()


def test_client_entries_are_validated() -> None:
    """A clear-text key or a bad namespace in [[clients]] is a config error naming the key."""
    with pytest.raises(ConfigError, match=r"clients\.0\.key_sha256"):
        load_settings(None, environ={}, overrides={"clients": [{"namespace": "a", "key_sha256": "plain-key"}]})
    with pytest.raises(ConfigError, match=r"clients\.0\.namespace"):
        load_settings(None, environ={}, overrides={"clients": [{"namespace": "a:b", "key_sha256": "0" * 64}]})


# --- open relay ----------------------------------------------------------------------------------------------


def _settings(**sections: Any) -> Any:
    return load_settings(None, environ={}, overrides=sections)


def test_open_relay_rules() -> None:
    """Only a non-loopback address + an upstream key + no client keys + not server.open is refused."""
    key = {"api_key": "sk-upstream"}
    assert open_relay_problem(_settings(server={"host": "0.0.0.0"}, upstream=key)) is not None
    assert open_relay_problem(_settings(server={"host": "127.0.0.1"}, upstream=key)) is None
    assert open_relay_problem(_settings(server={"host": "::1"}, upstream=key)) is None
    assert open_relay_problem(_settings(server={"host": "0.0.0.0"})) is None
    assert open_relay_problem(_settings(server={"host": "0.0.0.0", "open": True}, upstream=key)) is None
    assert open_relay_problem(_settings(server={"host": "0.0.0.0"}, upstream=key, clients=CLIENTS)) is None
    routed = {"prefix": "anthropic/", "api_key": "sk-ant"}
    assert open_relay_problem(_settings(server={"host": "10.0.0.5"}, routes=[routed])) is not None
    assert is_loopback("localhost")
    assert not is_loopback("192.168.1.10")


def test_serve_on_all_interfaces_with_a_key_and_no_clients_exits_2(tmp_path: Path) -> None:
    """``memproxy serve`` bound to 0.0.0.0 with an upstream key and no client keys exits 2 naming the fix."""
    env = {**os.environ, "MEMPROXY_SERVER__HOST": "0.0.0.0", "MEMPROXY_UPSTREAM__API_KEY": "sk-upstream",
           "MEMPROXY_STORAGE__PATH": str(tmp_path), "MEMPROXY_SERVER__PORT": "0"}  # fmt: skip
    done = subprocess.run([sys.executable, "-m", "proxy.cli", "serve"], env=env, capture_output=True, text=True,
                          timeout=120, check=False)  # fmt: skip
    assert done.returncode == 2
    assert "server.open" in done.stderr
    assert "[[clients]]" in done.stderr
    assert "sk-upstream" not in done.stderr + done.stdout


# --- browsers and Host names ---------------------------------------------------------------------------------


async def test_cross_origin_text_plain_post_is_refused(make_proxy: ProxyFactory, fake: FakeUpstream) -> None:
    """A web page's no-preflight text/plain POST (user in the body) is refused and nothing is stored or sent."""
    proxy = await make_proxy()
    body = b'{"model": "fake-echo", "user": "alice", "messages": [{"role": "user", "content": "plant"}]}'
    cross = await proxy.post(CHAT, data=body, headers={"Content-Type": "text/plain", "Origin": "http://evil.example"})
    assert cross.status == 403
    assert (await cross.json())["error"]["code"] == "origin_not_allowed"
    plain = await proxy.post(CHAT, data=body, headers={"Content-Type": "text/plain"})
    assert plain.status == 415
    form = await proxy.post(CHAT, data=body, headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert form.status == 415
    assert fake.requests == []
    assert await proxy.app[STATE].memory.store.count("alice") == 0


async def test_allowed_origin_gets_cors(make_proxy: ProxyFactory) -> None:
    """An origin listed in server.allowed_origins gets its preflight and CORS headers on the answer."""
    origin = "https://app.example"
    proxy = await make_proxy(server={"allowed_origins": [origin]})
    preflight = await proxy.options(CHAT, headers={"Origin": origin, "Access-Control-Request-Method": "POST",
                                                   "Access-Control-Request-Headers": "content-type"})  # fmt: skip
    assert preflight.status == 204
    assert preflight.headers["Access-Control-Allow-Origin"] == origin
    response = await proxy.post(CHAT, json=_chat("hi"), headers={"Origin": origin})
    assert response.status == 200
    assert response.headers["Access-Control-Allow-Origin"] == origin
    other = await proxy.post(CHAT, json=_chat("hi"), headers={"Origin": "https://other.example"})
    assert other.status == 403


async def test_unpinned_host_is_refused(make_proxy: ProxyFactory, fake: FakeUpstream) -> None:
    """With server.allowed_hosts set, a request for another Host (DNS rebinding) is refused; probes still answer."""
    proxy = await make_proxy(server={"allowed_hosts": ["localhost", "127.0.0.1"]})
    rebound = await proxy.post(CHAT, json=_chat("hi"), headers={"Host": "evil.example:8080"})
    assert rebound.status == 421
    assert (await rebound.json())["error"]["code"] == "host_not_allowed"
    assert fake.requests == []
    served = await proxy.post(CHAT, json=_chat("hi"), headers={"Host": "localhost:8080"})
    assert served.status == 200
    probe = await proxy.get("/healthz", headers={"Host": "evil.example"})
    assert probe.status == 200


def test_host_names_match_with_or_without_port() -> None:
    """A pinned name matches with any port; a pinned name:port only with that port."""
    assert host_allowed("LocalHost:8080", ("localhost",))
    assert host_allowed("[::1]:8080", ("[::1]",))
    assert not host_allowed("localhost:9", ("localhost:8080",))
    assert not host_allowed("evil.example", ("localhost",))


def test_list_keys_from_the_environment() -> None:
    """MEMPROXY_SERVER__ALLOWED_HOSTS and __ALLOWED_ORIGINS take comma-separated lists."""
    settings = load_settings(None, environ={"MEMPROXY_SERVER__ALLOWED_HOSTS": "a.example, b.example",
                                            "MEMPROXY_SERVER__ALLOWED_ORIGINS": "https://a.example"})  # fmt: skip
    assert settings.server.allowed_hosts == ("a.example", "b.example")
    assert settings.server.allowed_origins == ("https://a.example",)


def test_clients_load_from_a_config_file(tmp_path: Path) -> None:
    """``[[clients]]`` tables in a TOML file load as documented in config/memproxy.toml."""
    path = tmp_path / "memproxy.toml"
    path.write_text(
        '[server]\nhost = "0.0.0.0"\n\n[upstream]\napi_key = "sk-upstream"\n\n'
        f'[[clients]]\nnamespace = "appA"\nkey_sha256 = "{key_hash(KEY_A)}"\nname = "billing"\n'
    )
    settings = load_settings(path, environ={})
    assert [c.namespace for c in settings.clients] == ["appA"]
    assert open_relay_problem(settings) is None
