"""The docs and the settings schema agree: every key is documented, every documented key exists, links resolve."""

from __future__ import annotations

import re
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, get_args

import pytest
from pydantic import BaseModel, SecretStr

from proxy.config import Settings

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_FILE = ROOT / "config" / "memproxy.toml"
TUNING = ROOT / "docs" / "tuning.md"
CONFIGURATION = ROOT / "docs" / "configuration.md"
KEY_ROW = re.compile(r"^\| `([a-z0-9_]+(?:\.[a-z0-9_]+)?)` \| ([^|]*?) \|", re.MULTILINE)
SHOWN_KEY = re.compile(r"^(?:# )?([a-z0-9_]+) = ", re.MULTILINE)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _settings_keys(model: BaseModel, prefix: str = "") -> dict[str, Any]:
    """Every settings key, dotted (``retrieval.dense_k``; lists of tables such as ``routes`` as one key)."""
    keys: dict[str, Any] = {}
    for name, value in model:
        if isinstance(value, BaseModel):
            keys |= _settings_keys(value, f"{prefix}{name}.")
        else:
            keys[f"{prefix}{name}"] = value
    return keys


def _file_keys() -> set[str]:
    """Keys the default file shows, set or commented out, as ``section.key`` (top-level keys bare)."""
    keys: set[str] = set()
    section = ""
    for line in DEFAULT_FILE.read_text().splitlines():
        if line.startswith("[") and not line.startswith("[["):
            section = line.strip("[]")
        match = SHOWN_KEY.match(line)
        if match and not line.startswith("# ["):
            keys.add(f"{section}.{match.group(1)}" if section else match.group(1))
    return keys


def _table_rows(page: Path) -> dict[str, str]:
    """The first two cells of a page's key tables: ``{key: default cell}``."""
    return {key: cell.strip() for key, cell in KEY_ROW.findall(page.read_text())}


def _plain(value: Any) -> Any:
    """A settings value as TOML would read it back."""
    if isinstance(value, SecretStr):
        return value.get_secret_value()
    if isinstance(value, (tuple, list)):
        return [_plain(item) for item in value]
    if isinstance(value, (set, frozenset)):
        return sorted(_plain(item) for item in value)
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, Path):
        return str(value)
    return value


def test_every_settings_key_is_documented() -> None:
    """Each key of the settings is in the shipped file, the tuning page or the configuration page."""
    documented = _file_keys() | set(_table_rows(TUNING)) | set(_table_rows(CONFIGURATION))
    missing = sorted(set(_settings_keys(Settings())) - documented)
    assert not missing, f"undocumented settings: {missing}"


@pytest.mark.parametrize("page", [TUNING, CONFIGURATION], ids=lambda page: page.name)
def test_every_documented_key_exists(page: Path) -> None:
    """Every key a docs table names is a real setting (no stale or misspelt key)."""
    unknown = sorted(set(_table_rows(page)) - set(_settings_keys(Settings())))
    assert not unknown, f"{page.name} names keys that do not exist: {unknown}"


def _entry_keys() -> set[str]:
    """Keys of the entries of the list tables (``[[routes]]``, ``[[clients]]``, ``[[webhooks]]``)."""
    keys: set[str] = set()
    for field in Settings.model_fields.values():
        for entry in get_args(field.annotation):
            if isinstance(entry, type) and issubclass(entry, BaseModel):
                keys |= set(entry.model_fields)
    return keys


def test_every_key_in_the_file_exists() -> None:
    """Every key the default file shows, commented-out examples included, is a setting or a list entry's key."""
    settings = _settings_keys(Settings())
    unknown = sorted(key for key in _file_keys() if key not in settings and key not in _entry_keys())
    assert not unknown, f"the default file shows keys that do not exist: {unknown}"


def test_tuning_defaults_are_the_real_defaults() -> None:
    """The default the tuning page gives for each key is the value the settings hold with no file."""
    settings = _settings_keys(Settings())
    for key, cell in _table_rows(TUNING).items():
        expected = _plain(settings[key])
        if cell == "unset":
            assert expected is None, key
            continue
        literal = cell.strip("`")
        assert tomllib.loads(f"v = {literal}")["v"] == expected, f"{key}: docs say {literal}, default is {expected!r}"


def test_tuning_keys_are_not_in_the_shipped_file() -> None:
    """The tuning page documents what the operator's file leaves out (one place to look for each key)."""
    assert not set(_table_rows(TUNING)) & _file_keys()


def test_shipped_file_stays_an_operators_file() -> None:
    """The default file shows at most 60 keys, counting commented-out examples."""
    shown = SHOWN_KEY.findall(DEFAULT_FILE.read_text())
    assert len(shown) <= 60, len(shown)


def _markdown_pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors for a page's headings (code blocks skipped, repeats numbered)."""
    anchors: set[str] = set()
    fenced = False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        if fenced or not line.startswith("#"):
            continue
        slug = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
        anchor, count = slug, 0
        while anchor in anchors:
            count += 1
            anchor = f"{slug}-{count}"
        anchors.add(anchor)
    return anchors


def _local_links(page: Path) -> Iterator[tuple[Path, str]]:
    for target in LINK.findall(page.read_text()):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, anchor = target.partition("#")
        yield (page.parent / path).resolve() if path else page, anchor


@pytest.mark.parametrize("page", _markdown_pages(), ids=lambda page: page.name)
def test_links_resolve(page: Path) -> None:
    """Every relative link of the README and docs/ names a file that exists, and a heading that exists in it."""
    for target, anchor in _local_links(page):
        assert target.exists(), f"{page.name}: {target} does not exist"
        if anchor:
            assert anchor in _anchors(target), f"{page.name}: no heading #{anchor} in {target.name}"


def test_readme_is_a_front_door() -> None:
    """The README stays short, keeps the two commands, and links every page of docs/."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 400
    assert "make serve" in readme
    assert "make test" in readme
    linked = {target.name for target, _ in _local_links(ROOT / "README.md")}
    assert {page.name for page in (ROOT / "docs").glob("*.md")} <= linked
