"""The /ui/ page's dead-letter view in headless Chromium: a failed memory job is shown and requeued."""

from __future__ import annotations

import contextlib
import sqlite3
import time
from collections.abc import Iterator
from typing import Any

import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support import expected_conditions as ec

from tests.support.live_app import admin_settings, live_app
from tests.test_web_ui import KEY, browser, call, shot, wait  # noqa: F401 - browser is a fixture

pytestmark = pytest.mark.e2e


def _dead(base: str) -> list[dict[str, Any]]:
    status, page = call(base, "GET", "/v1/memory/dead-letters")
    assert status == 200
    return list(page["data"])


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The app with memory on and, in its queue, an exchange of "vic" whose payload is corrupt (as after a bad
    manual edit of the job database), so the writer gives up on it at once."""
    data = tmp_path_factory.mktemp("ui-dead")
    settings = admin_settings(
        admin={"api_key": KEY}, upstream={"base_url": "http://127.0.0.1:9/v1"}, storage={"path": str(data)}
    )
    with live_app(settings) as url:
        with contextlib.closing(sqlite3.connect(data / "jobs.sqlite3" / "jobs.sqlite3", timeout=30)) as db, db:
            now = time.time()
            db.execute(
                "INSERT INTO jobs (id, kind, user_id, payload, state, run_after, first_trigger, created_at,"
                " updated_at) VALUES ('corrupt-1', 'exchange', 'vic', '{\"corrupt\": true}', 'pending',"
                " ?, ?, ?, ?)",
                (now, now, now, now),
            )
        deadline = time.monotonic() + 30
        while not _dead(url):
            assert time.monotonic() < deadline, "the corrupt job did not give up"
            time.sleep(0.1)
        yield url


def test_dead_letter_is_shown_and_requeued(browser: WebDriver, base: str) -> None:  # noqa: F811 - the fixture
    """The page lists the dead job with its error; Requeue runs it again (it gives up again, later)."""
    [job] = _dead(base)
    browser.get(base + "/ui/")
    wait(browser).until(ec.visibility_of_element_located((By.ID, "key"))).send_keys(KEY)
    browser.find_element(By.ID, "unlock").click()
    wait(browser).until(ec.element_to_be_clickable((By.ID, "open-dead"))).click()
    row = wait(browser).until(ec.visibility_of_element_located((By.CSS_SELECTOR, f'tr[data-job="{job["id"]}"]')))
    assert "exchange" in row.text
    assert "vic" in row.text
    assert "invalid job payload" in row.text
    shot(browser, "web_ui_dead_letters")
    row.find_element(By.CSS_SELECTOR, "button.requeue").click()
    toast = wait(browser).until(ec.visibility_of_element_located((By.ID, "toast")))
    assert toast.text == "Requeued the exchange job."
    deadline = time.monotonic() + 30
    while not any(d["id"] == job["id"] and d["updated_at"] > job["updated_at"] for d in _dead(base)):
        assert time.monotonic() < deadline, "the requeued job did not run again"
        time.sleep(0.1)
