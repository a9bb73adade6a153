"""`memproxy --version`, `memproxy config check|schema`, and secrets given by reference (environment, files)."""

from __future__ import annotations

import json
import subprocess
import tomllib
from pathlib import Path

import jsonschema
import pytest

from proxy.config import ConfigError, load_settings
from tests.support.processes import MEMPROXY, ROOT, child_env


def _memproxy(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(MEMPROXY), *args], capture_output=True, text=True, env=child_env(**env), timeout=120, check=False
    )


def test_version_prints_the_package_version() -> None:
    """`memproxy --version` prints the name and a version and exits 0."""
    result = _memproxy("--version")
    assert result.returncode == 0
    assert result.stdout.startswith("memproxy ")
    assert result.stdout.split()[1][0].isdigit()


def test_config_check_accepts_the_default_file() -> None:
    """The shipped default configuration checks clean."""
    result = _memproxy("config", "check", str(ROOT / "config" / "memproxy.toml"))
    assert result.returncode == 0, result.stderr
    assert "ok" in result.stdout


def test_config_check_names_the_bad_key(tmp_path: Path) -> None:
    """A misspelt key and a wrong type exit 2 with messages naming each key."""
    bad = tmp_path / "bad.toml"
    bad.write_text('[server]\nportt = 1\n[retrieval]\ndense_weight = "heavy"\n')
    result = _memproxy("config", "check", str(bad))
    assert result.returncode == 2
    assert "server.portt" in result.stderr
    assert "retrieval.dense_weight" in result.stderr


def test_config_schema_describes_the_toml() -> None:
    """`memproxy config schema` is a JSON Schema that the default file satisfies and a typo violates."""
    result = _memproxy("config", "schema")
    assert result.returncode == 0
    schema = json.loads(result.stdout)
    default = tomllib.loads((ROOT / "config" / "memproxy.toml").read_text())
    jsonschema.validate(default, schema)
    assert "server" in schema["properties"]
    assert "routes" in schema["properties"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"server": {"portt": 1}}, schema)


def test_route_key_comes_from_an_environment_reference(tmp_path: Path) -> None:
    """`api_key = "${NAME}"` in a route takes the variable's value; the file never holds the key."""
    config = tmp_path / "routes.toml"
    config.write_text(
        '[admin]\napi_key = "$${KEPT}"\n[[routes]]\nprefix = "claude-"\n'
        'litellm_provider = "anthropic"\napi_key = "${ANTHROPIC_KEY}"\n'
    )
    settings = load_settings(config, environ={"ANTHROPIC_KEY": "sk-ant-secret"})
    assert settings.routes[0].api_key is not None
    assert settings.routes[0].api_key.get_secret_value() == "sk-ant-secret"
    assert settings.admin.api_key.get_secret_value() == "${KEPT}"  # $${ writes a literal ${


def test_keys_come_from_secret_files(tmp_path: Path) -> None:
    """`${file:PATH}` in the file and `MEMPROXY_..._FILE` in the environment read the secret from a file."""
    (tmp_path / "admin").write_text("admin-from-file\n")
    (tmp_path / "upstream").write_text("sk-upstream-from-file\n")
    config = tmp_path / "c.toml"
    config.write_text(f'[admin]\napi_key = "${{file:{tmp_path / "admin"}}}"\n')
    settings = load_settings(config, environ={"MEMPROXY_UPSTREAM__API_KEY_FILE": str(tmp_path / "upstream")})
    assert settings.admin.api_key.get_secret_value() == "admin-from-file"
    assert settings.upstream.api_key.get_secret_value() == "sk-upstream-from-file"


def test_missing_secret_is_an_error_naming_the_key(tmp_path: Path) -> None:
    """An unset variable or an unreadable file is a config error naming the key, not an empty key."""
    config = tmp_path / "c.toml"
    config.write_text('[upstream]\napi_key = "${NOT_SET_ANYWHERE}"\n')
    with pytest.raises(ConfigError, match=r"upstream\.api_key: environment variable NOT_SET_ANYWHERE"):
        load_settings(config, environ={})
    with pytest.raises(ConfigError, match="MEMPROXY_ADMIN__API_KEY_FILE"):
        load_settings(None, environ={"MEMPROXY_ADMIN__API_KEY_FILE": str(tmp_path / "absent")})
    result = _memproxy("config", "check", str(config))
    assert result.returncode == 2
    assert "upstream.api_key" in result.stderr
