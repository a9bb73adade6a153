"""Configuration: defaults, the commented default file, env overrides and clear errors.

That every key is documented (in the default file or docs/tuning.md) is tests/test_docs_config.py's.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from proxy.config import ConfigError, Settings, load_settings

ROOT = Path(__file__).resolve().parents[1]


def test_default_file_is_exactly_the_defaults() -> None:
    """config/memproxy.toml loads to the same settings as no file at all."""
    assert load_settings(ROOT / "config" / "memproxy.toml", environ={}) == Settings()


@pytest.mark.parametrize("example", sorted((ROOT / "config" / "examples").glob("*.toml")))
def test_examples_load(example: Path) -> None:
    """Every example config is valid."""
    load_settings(example, environ={})


def _fields(model: type[BaseModel]) -> dict[str, tuple[Any, Any, list[Any]]]:
    return {name: (info.annotation, info.default, info.metadata) for name, info in model.model_fields.items()}


@pytest.mark.parametrize("section", ["store", "jobs"])
def test_tuning_sections_are_their_component_settings_without_path(section: str) -> None:
    """[store] and [jobs] accept exactly their component's settings but ``path``, with the same defaults and bounds."""
    settings = Settings()
    component = {"store": settings.store_settings, "jobs": settings.jobs_settings}[section]()
    component_fields = _fields(type(component))
    component_fields.pop("path")
    assert _fields(type(getattr(settings, section))) == component_fields


def test_env_overrides() -> None:
    """MEMPROXY_<SECTION>__<KEY> variables override the file, typed."""
    env = {
        "MEMPROXY_UPSTREAM__BASE_URL": "http://127.0.0.1:1234/v1",
        "MEMPROXY_UPSTREAM__API_KEY": "sk-test",
        "MEMPROXY_STORAGE__PATH": "/srv/memproxy-data",
        "MEMPROXY_SERVER__HOST": "0.0.0.0",
        "MEMPROXY_SERVER__PORT": "9001",
        "MEMPROXY_ADMIN__API_KEY": "admin",
    }
    settings = load_settings(None, environ=env)
    assert settings.upstream.base_url == "http://127.0.0.1:1234/v1"
    assert settings.upstream.api_key.get_secret_value() == "sk-test"
    assert str(settings.storage.path) == "/srv/memproxy-data"
    assert (settings.server.host, settings.server.port) == ("0.0.0.0", 9001)
    assert settings.admin.api_key.get_secret_value() == "admin"


def test_unknown_key_is_named() -> None:
    """A misspelt key is an error that names it."""
    with pytest.raises(ConfigError, match=r"server\.prot"):
        load_settings(None, environ={"MEMPROXY_SERVER__PROT": "1"})


def test_secrets_do_not_print() -> None:
    """Keys never appear in the settings' repr."""
    settings = load_settings(None, environ={"MEMPROXY_UPSTREAM__API_KEY": "sk-very-secret"})
    assert "sk-very-secret" not in repr(settings)


def test_cli_exits_2_naming_the_key(tmp_path: Path) -> None:
    """memproxy serve with an invalid value prints one line naming the key and exits with 2."""
    bad = tmp_path / "bad.toml"
    bad.write_text('[upstream]\nbase_url = "ftp://nope"\n')
    result = subprocess.run(
        [sys.executable, "-m", "proxy.cli", "serve", "--config", str(bad)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    assert result.stderr.strip().startswith("config error: upstream.base_url:")
    assert "Traceback" not in result.stderr


def test_a_kind_concurrency_table_keeps_the_other_kinds_defaults() -> None:
    """Setting one kind's concurrency leaves the others' defaults (insights two at a time) in place."""
    settings = load_settings(None, environ={"MEMPROXY_JOBS__KIND_CONCURRENCY__EXCHANGE": "64"})
    assert settings.jobs.kind_concurrency == {"exchange": 64, "insights": 2}
    assert settings.jobs.concurrency_of("insights") == 2
    assert settings.jobs.concurrency_of("facts") == settings.jobs.concurrency
    assert Settings().jobs.kind_concurrency == {"exchange": 128, "insights": 2}
