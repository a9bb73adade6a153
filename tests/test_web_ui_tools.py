"""The /ui/ page shows a tool-using conversation: the tool call and the tool's result are listed as turns."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator

import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support import expected_conditions as ec

from tests.support.hosted_upstream import HostedUpstream, hosted_upstream
from tests.support.live_app import admin_settings, live_app
from tests.test_e2e_quickstart import eventually
from tests.test_web_ui import browser, shot, wait

pytestmark = pytest.mark.e2e

__all__ = ["browser"]  # the module-scoped headless Chromium fixture, shared with test_web_ui

KEY = "ui-tools-admin-key"
USER = "tess"
CALL_TEXT = 'tool call get_weather({"city": "Paris"})'
RESULT_TEXT = 'tool result get_weather: {"sky": "sunny", "temp_c": 18}'


def post(url: str, path: str, body: object, key: str) -> object:
    """POST JSON with a bearer key; the decoded answer."""
    request = urllib.request.Request(  # noqa: S310
        url + path,
        data=json.dumps(body).encode(),
        method="POST",
        headers={
            "Authorization": f"Bearer {key}",
            "Content-Type": "application/json",
            "X-Memory-User": USER,
            "X-Memory-Conversation": "trip",
        },
    )
    with urllib.request.urlopen(request, timeout=60) as response:  # noqa: S310 - 127.0.0.1 only
        return json.loads(response.read())


def turns(url: str) -> set[tuple[str, str]]:
    """(role, text) of the user's stored turns."""
    request = urllib.request.Request(  # noqa: S310
        f"{url}/v1/memory/users/{USER}/memories?kind=turn&limit=50",
        headers={"Authorization": f"Bearer {KEY}"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:  # noqa: S310
        return {(r["role"], r["text"]) for r in json.loads(response.read())["data"]}


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The app with memory on, after one tool-using exchange of ``USER``."""
    with hosted_upstream() as fake:
        settings = admin_settings(
            admin={"api_key": KEY},
            upstream={"base_url": fake.base_url},
            storage={"path": str(tmp_path_factory.mktemp("ui-tools"))},
            retrieval={"arm_timeout_ms": 10_000},
        )
        with live_app(settings) as url:
            _tool_exchange(url, fake)
            eventually(lambda: {("assistant", CALL_TEXT), ("tool", RESULT_TEXT)} <= turns(url))
            yield url


def _tool_exchange(url: str, fake: HostedUpstream) -> None:
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    asked = [{"role": "user", "content": "What's the weather in Paris today?"}]
    first = post(url, "/v1/chat/completions", {"model": "fake-tools", "messages": asked, "tools": tools}, "sk-t")
    assert isinstance(first, dict)
    message = first["choices"][0]["message"]
    answered = [
        *asked,
        message,
        {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": '{"sky": "sunny", "temp_c": 18}'},
    ]
    post(url, "/v1/chat/completions", {"model": "gpt-4o-mini", "messages": answered, "tools": tools}, "sk-t")


def test_turns_tab_lists_the_tool_call_and_its_result(browser: WebDriver, base: str) -> None:
    """Opening the user's Turns tab shows the tool call as an assistant turn and the result as a tool turn."""
    browser.get(base + "/ui/")
    wait(browser).until(ec.visibility_of_element_located((By.ID, "key"))).send_keys(KEY)
    browser.find_element(By.ID, "unlock").click()
    wait(browser).until(ec.element_to_be_clickable((By.CSS_SELECTOR, f'#user-list [data-user="{USER}"]'))).click()
    wait(browser).until(ec.element_to_be_clickable((By.CSS_SELECTOR, 'button[data-tab="turn"]'))).click()
    script = (
        "return [...document.querySelectorAll('#tab-body tbody tr[data-id]')]"
        ".map(r => [r.querySelector('td.text').firstChild.textContent, r.children[1].textContent]);"
    )
    wait(browser).until(lambda d: len(d.execute_script(script)) >= 4)
    shown = {text: role for text, role in browser.execute_script(script)}
    assert shown[CALL_TEXT] == "assistant"
    assert shown[RESULT_TEXT] == "tool"
    shot(browser, "web_ui_tool_turns")
