"""The /ui/ page end to end in headless Chromium (Selenium + Debian's chromium and chromium-driver).

The real app (memory on, the embedded model) is served in a thread; facts are seeded through the API; the
browser unlocks the page with the admin key, opens the user, deletes a fact, previews a search, edits and
finally forgets the user, checking each step through the API too. Screenshots land in
tests/e2e/screenshots/ (gitignored).
"""

from __future__ import annotations

import json
import shutil
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.remote.webelement import WebElement
from selenium.webdriver.support import expected_conditions as ec
from selenium.webdriver.support.ui import WebDriverWait

from tests.support.live_app import admin_settings, live_app
from tests.support.processes import ROOT

pytestmark = pytest.mark.e2e

KEY = "ui-admin-key-2468"
USER = "uma"
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
SCREENSHOTS = ROOT / "tests" / "e2e" / "screenshots"
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--no-first-run",
    "--disable-component-update",
    "--disable-sync",
    "--disable-quic",
    "--window-size=1280,900",
)


def call(base: str, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    """One management API call: (status, decoded JSON)."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(  # noqa: S310 - local test server
        base + path,
        data=data,
        method=method,
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:  # noqa: S310
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The app with memory on, seeded with three facts about one user."""
    settings = admin_settings(
        admin={"api_key": KEY},
        upstream={"base_url": "http://127.0.0.1:9/v1"},
        storage={"path": str(tmp_path_factory.mktemp("ui-data"))},
        retrieval={"arm_timeout_ms": 10_000},
    )  # a loaded CI box must not degrade the arms
    with live_app(settings) as url:
        for text, importance in (
            ("Uma is a vegetarian", 8),
            ("Uma owns a red bicycle", 4),
            ("Uma works as a nurse in Leeds", 7),
        ):
            status, _ = call(
                url,
                "POST",
                f"/v1/memory/users/{USER}/memories",
                {"text": text, "importance": importance, "category": "other"},
            )
            assert status == 201
        yield url


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WebDriver]:
    """Headless Chromium with a fresh profile."""
    if not (Path(CHROMIUM).exists() and shutil.which(CHROMEDRIVER)):
        pytest.fail(
            "chromium and chromium-driver are installed by `make test` (apt-get install chromium chromium-driver)"
        )
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}")
    driver = webdriver.Chrome(options=options, service=Service(executable_path=CHROMEDRIVER))
    try:
        yield driver
    finally:
        driver.quit()


def wait(driver: WebDriver, timeout: float = 15.0) -> WebDriverWait[WebDriver]:
    """A wait on ``driver``."""
    return WebDriverWait(driver, timeout)


def facts(driver: WebDriver) -> dict[str, str]:
    """The facts table as shown: fact text -> record id (read in one script, so never half-rendered)."""
    script = (
        "return [...document.querySelectorAll('#tab-body tbody tr[data-id]:not(.editing)')]"
        ".map(r => [r.querySelector('td.text').firstChild.textContent, r.dataset.id]);"
    )
    return dict(driver.execute_script(script))


def row(driver: WebDriver, record_id: str) -> WebElement:
    """The table row of one record."""
    return driver.find_element(By.CSS_SELECTOR, f'#tab-body tr[data-id="{record_id}"]')


def shot(driver: WebDriver, name: str) -> Path:
    """Save a screenshot under tests/e2e/screenshots/."""
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    path = SCREENSHOTS / f"{name}.png"
    driver.save_screenshot(str(path))
    return path


def open_user(driver: WebDriver, base: str) -> None:
    """Load /ui/, unlock it with the admin key and open the seeded user's facts."""
    driver.get(base + "/ui/")
    key = wait(driver).until(ec.visibility_of_element_located((By.ID, "key")))
    key.send_keys(KEY)
    driver.find_element(By.ID, "unlock").click()
    user = wait(driver).until(ec.element_to_be_clickable((By.CSS_SELECTOR, f'#user-list [data-user="{USER}"]')))
    user.click()
    wait(driver).until(lambda d: len(facts(d)) == 3)


def test_list_and_delete_one(browser: WebDriver, base: str) -> None:
    """The page lists the user's facts with category, importance and source; a deleted fact is gone."""
    open_user(browser, base)
    shown = facts(browser)
    assert set(shown) == {"Uma is a vegetarian", "Uma owns a red bicycle", "Uma works as a nurse in Leeds"}
    vegetarian = row(browser, shown["Uma is a vegetarian"]).text
    assert "other" in vegetarian
    assert "8" in vegetarian
    assert "added by hand" in vegetarian
    target_id = shown["Uma owns a red bicycle"]
    row(browser, target_id).find_element(By.CSS_SELECTOR, "button.delete").click()
    dialog = wait(browser).until(ec.visibility_of_element_located((By.ID, "confirm")))
    assert "Uma owns a red bicycle" in dialog.text
    browser.find_element(By.ID, "confirm-ok").click()
    wait(browser).until(lambda d: "Uma owns a red bicycle" not in facts(d))
    assert wait(browser).until(ec.visibility_of_element_located((By.ID, "toast"))).text == "Deleted."
    shot(browser, "web_ui_after_delete")
    assert call(base, "GET", f"/v1/memory/users/{USER}/memories/{target_id}")[0] == 404
    browser.refresh()  # the key stays in this tab's sessionStorage and the user in the URL
    wait(browser).until(lambda d: len(facts(d)) == 2)
    assert "Uma owns a red bicycle" not in facts(browser)


def test_search_preview_edit_and_forget(browser: WebDriver, base: str) -> None:
    """The search box shows the injected block; an edit is saved; forgetting needs the typed user id."""
    browser.find_element(By.ID, "search-query").send_keys("what should I cook for Uma? she is vegetarian")
    browser.find_element(By.CSS_SELECTOR, "#search-form button[type=submit]").click()
    block = wait(browser).until(ec.visibility_of_element_located((By.ID, "search-block")))
    assert block.text.startswith("<memory>"), browser.find_element(By.ID, "search-arms").text
    assert '"Uma is a vegetarian"' in block.text
    shot(browser, "web_ui_search")
    nurse = facts(browser)["Uma works as a nurse in Leeds"]
    row(browser, nurse).find_element(By.CSS_SELECTOR, "button.edit").click()
    editor = wait(browser).until(ec.visibility_of_element_located((By.CSS_SELECTOR, "textarea.edit-text")))
    editor.clear()
    editor.send_keys("Uma works as a nurse in York")
    browser.find_element(By.CSS_SELECTOR, "button.save").click()
    wait(browser).until(lambda d: "Uma works as a nurse in York" in facts(d))
    assert "Uma works as a nurse in Leeds" not in facts(browser)
    browser.find_element(By.ID, "forget").click()
    wait(browser).until(ec.visibility_of_element_located((By.ID, "confirm-input")))
    assert not browser.find_element(By.ID, "confirm-ok").is_enabled()
    browser.find_element(By.ID, "confirm-input").send_keys(USER)
    browser.find_element(By.ID, "confirm-ok").click()
    wait(browser).until(lambda d: d.find_elements(By.CSS_SELECTOR, "#tab-body .empty-tab"))
    assert "records erased" in browser.find_element(By.ID, "toast").text
    shot(browser, "web_ui_after_forget")
    assert call(base, "GET", f"/v1/memory/users/{USER}/memories")[1]["data"] == []
