"""Secrets in the configuration without writing them into it: references to the environment and to files.

Two forms, resolved by the loader before validation:

- in the TOML file, any string value may be (or contain) ``${NAME}`` (the environment variable ``NAME``) or
  ``${file:/run/secrets/key}`` (the file's content, one trailing newline removed). Route keys use this:
  ``api_key = "${ANTHROPIC_API_KEY}"`` inside ``[[routes]]``. ``$${`` writes a literal ``${``.
- in the environment, ``MEMPROXY_<SECTION>__<KEY>_FILE=/path`` sets ``<section>.<key>`` from the file
  (the Docker/Kubernetes secrets convention), e.g. ``MEMPROXY_UPSTREAM__API_KEY_FILE``.

A reference that cannot be resolved is a ``ConfigError`` naming the key, never an empty secret. The values
themselves are never put in an error message.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

_REFERENCE = re.compile(r"\$\$\{|\$\{(file:)?([^}]*)\}")
FILE_SUFFIX = "_FILE"


class SecretReferenceError(Exception):
    """A ``${...}`` reference or a ``_FILE`` variable could not be resolved (the message names the key)."""


def read_secret_file(path: str, key: str) -> str:
    """The content of a secret file, one trailing newline removed."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise SecretReferenceError(f"config error: {key}: cannot read secret file {path}: {exc.strerror}") from None
    return text.removesuffix("\n").removesuffix("\r")


def _resolve(value: str, key: str, environ: Mapping[str, str]) -> str:
    def replace(match: re.Match[str]) -> str:
        if match.group(0) == "$${":
            return "${"
        is_file, name = match.group(1), match.group(2)
        if is_file:
            return read_secret_file(name, key)
        if not name or name not in environ:
            raise SecretReferenceError(f"config error: {key}: environment variable {name or '(empty)'} is not set")
        return environ[name]

    return _REFERENCE.sub(replace, value)


def expand_references(tree: Any, environ: Mapping[str, str], key: str = "") -> Any:
    """``tree`` (parsed TOML) with every ``${NAME}`` and ``${file:PATH}`` in its strings resolved."""
    if isinstance(tree, str):
        return _resolve(tree, key or "(root)", environ)
    if isinstance(tree, dict):
        return {
            name: expand_references(value, environ, f"{key}.{name}" if key else name) for name, value in tree.items()
        }
    if isinstance(tree, list):
        return [expand_references(value, environ, f"{key}.{i}") for i, value in enumerate(tree)]
    return tree


def file_variables(environ: Mapping[str, str], prefix: str) -> dict[str, str]:
    """``environ`` with every ``<prefix>..._FILE`` variable replaced by the variable it names, set to the file's
    content (an explicit value of the same variable wins over the file)."""
    out = dict(environ)
    for name, path in environ.items():
        if not (name.startswith(prefix) and name.endswith(FILE_SUFFIX)) or name == f"{prefix}CONFIG":
            continue
        target = name.removesuffix(FILE_SUFFIX)
        del out[name]
        if target not in environ:
            out[target] = read_secret_file(path, name)
    return out
