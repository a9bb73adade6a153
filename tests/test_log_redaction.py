"""Redaction of log values: the quick path for text without a credential marker changes nothing it decides."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from proxy.logs import redact, redact_patterns, redact_text

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
