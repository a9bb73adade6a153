"""Redaction of log values: the quick path for text without a credential marker changes nothing it decides."""

from __future__ import annotations

import logging

import orjson
import pytest
import structlog
from hypothesis import given
from hypothesis import strategies as st

from proxy.logs import _dumps, configure_logging, redact, redact_patterns, redact_text

# Pieces of credentials in any case, the characters around them, and non-ASCII look-alikes (the Kelvin sign
# and dotless i match k and i case-insensitively).
PIECES = st.sampled_from(
    [
        "sk-",
        "SK-",
        "abcdefgh1234",
        "Bearer",
        "bearer",
        "BEARER",
        " ",
        "\t",
        ":",
        "=",
        "\r",
        "\n",
        "\\r",
        "'",
        '"',
        "authorization",
        "Authorization",
        "proxy-",
        "x-api-key",
        "API-KEY",
        "api_key",
        "cookie",
        "Cookie",
        "author\u0131zation",
        "coo\u212aie",
        "\u00e9",
        "model",
        "fake-echo",
        "-",
    ]
)
TEXTS = st.lists(PIECES, max_size=12).map("".join) | st.text(max_size=40)


@given(TEXTS)
def test_quick_path_agrees_with_the_full_patterns(text: str) -> None:
    """Whatever the text, the result is what running both patterns over it gives."""
    assert redact_text(text) == redact_patterns(text)


def test_credentials_in_values_and_keys_are_blanked() -> None:
    """A bearer token, an API key, a header in free text and a key named like a credential never pass."""
    event = {
        "event": "upstream.failed",
        "detail": "sent Authorization: Bearer sk-live-0123456789abcdef\\r\\nHost: x",
        "note": "key sk-abcdefgh12345678 in text",
        "api_key": "anything",
        "model": "fake-echo",
        "status": 200,
    }
    out = redact(None, "info", dict(event))
    assert "sk-live" not in out["detail"]
    assert "0123456789" not in out["detail"]
    assert out["note"] == "key [redacted] in text"
    assert out["api_key"] == "[redacted]"
    assert out["model"] == "fake-echo"
    assert out["status"] == 200


@given(st.text(alphabet=st.characters(codec=None, min_codepoint=0, max_codepoint=0x10FFFF), max_size=20))
def test_any_text_becomes_one_json_line(text: str) -> None:
    """Any value, lone surrogates included (a header's bad byte, ``\\ud800`` from a JSON body), is written: the
    line parses back and holds the event; ASCII-and-UTF-8 values are written as they are."""
    line = _dumps({"event": "request.completed", "request_id": text, "nested": {text: [text]}})
    parsed = orjson.loads(line)
    assert parsed["event"] == "request.completed"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        assert "\\u" in parsed["request_id"] or "\\x" in parsed["request_id"]
    else:
        assert parsed["request_id"] == text


def test_stdlib_errors_are_json_lines_without_secrets(capsys: pytest.CaptureFixture[str]) -> None:
    """aiohttp's own error log (a stdlib record with a traceback) is one JSON line, its key redacted."""
    root, saved = logging.getLogger(), structlog.get_config()
    handlers, level = root.handlers[:], root.level
    configure_logging("info")
    try:
        raise ValueError("bad header Authorization: Bearer sk-canary-123456789 \udcff")
    except ValueError:
        logging.getLogger("aiohttp.server").exception("Unhandled exception")
    finally:  # the process's logging as it was (the captured stream closes after this test)
        root.handlers[:], root.level = handlers, level
        structlog.configure(**saved)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1
    record = orjson.loads(lines[0])
    assert (record["event"], record["logger"], record["level"]) == ("Unhandled exception", "aiohttp.server", "error")
    assert "ValueError" in record["exception"]
    assert "sk-canary" not in lines[0]
