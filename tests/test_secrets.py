"""The credential screen: secrets typed in chat are redacted before anything reaches the disk, idempotently,
and ordinary talk about passwords or keys is left alone."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench.screen_cases import INSTRUCTIONS, SECRETS
from proxy.memory.write.identifiers import redact_identifiers
from proxy.memory.write.instructions import injection_reason
from proxy.memory.write.screens import remembered_identifiers
from proxy.memory.write.secrets import bip39_words, seed_phrases
from tests.conftest import ProxyFactory
from tests.support.settle import settled

# Six shapes the probe stored in clear, as a user would type them.
TYPED = {
    "+IUF8QkOCktSmSOCyiQ2liQ3aDRI3nz4I6qIAp0p": (
        "my AWS keys: AKIAZ5BS77WTGKZCRJPF / +IUF8QkOCktSmSOCyiQ2liQ3aDRI3nz4I6qIAp0p"
    ),
    "hunter2Secret": "my password hunter2Secret",
    "s3cr3tPass": "the db is postgres://app:s3cr3tPass@db.internal:5432/app",
    "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY": "AWS_SECRET_ACCESS_KEY=wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
    "npm_1IZokUKg1iqyZpvcOHd92fPpR7qHADKAX0zE": "publish with npm_1IZokUKg1iqyZpvcOHd92fPpR7qHADKAX0zE",
    "ZGVwbG95OlRyMHViNGRvciYz": "send Authorization: Basic ZGVwbG95OlRyMHViNGRvciYz",
}
ORDINARY = [
    "I forgot my password yesterday and had to reset it.",
    "My password manager is great, and the wifi password is on the fridge note.",
    "She has a basic understanding of statistics.",
    "The key to success is patience; my secret recipe uses basil.",
    "The cvv field was confusing on the form.",
    "We took the access road to the lake, then the token ring exhibit.",
    "Abandon the plan, we are able to adapt above all and act with ability.",
]


def test_labelled_secrets_are_redacted_idempotently() -> None:
    """At least 95% of the labelled secret shapes lose every piece of the secret, and redacting twice changes
    nothing (no ``[redacted:credential]]``)."""
    missed = []
    for text, secret in SECRETS:
        once = redact_identifiers(text)[0]
        if any(len(piece) >= 3 and piece in once for piece in secret.split()):
            missed.append(once)
        assert redact_identifiers(once)[0] == once
    assert len(missed) <= 0.05 * len(SECRETS), missed


@pytest.mark.parametrize(
    "text", ["password: [redacted:credential]", "AWS_SECRET_ACCESS_KEY=[redacted:high_entropy]", "pw [redacted:token]"]
)
def test_redacted_text_is_left_as_it_is(text: str) -> None:
    """Text that already holds redaction markers is not redacted again (no ``[redacted:credential]]``)."""
    assert redact_identifiers(text) == (text, ())


@pytest.mark.parametrize("text", ORDINARY)
def test_ordinary_talk_is_not_redacted(text: str) -> None:
    """Talk about passwords, keys, codes and BIP-39 words (fewer than twelve in a row) is stored as written."""
    assert redact_identifiers(text) == (text, ())


def test_quoted_passphrase_is_redacted_whole() -> None:
    """A quoted multi-word passphrase loses every word, not only the first."""
    text, kinds = redact_identifiers('my passphrase is "correct horse battery staple" ok?')
    assert text == 'my passphrase is "[redacted:credential]" ok?'
    assert kinds == ("credential",)


def test_keys_asked_to_remember_are_still_redacted() -> None:
    """A user asking to remember an access key does not get it stored: keys and tokens are never kept."""
    message = "Please remember my npm token is npm_1IZokUKg1iqyZpvcOHd92fPpR7qHADKAX0zE."
    keep = remembered_identifiers([message])
    assert "npm_1IZokUKg1iqyZpvcOHd92fPpR7qHADKAX0zE" not in redact_identifiers(message, keep=keep)[0]


@given(st.lists(st.sampled_from(sorted(bip39_words())), min_size=12, max_size=24))
def test_any_run_of_twelve_bip39_words_is_a_seed_phrase(words: list[str]) -> None:
    """Twelve to twenty-four BIP-39 words, however separated, are one ``seed_phrase`` span covering them all."""
    text = "wallet backup: " + " ".join(words) + " (keep safe)"
    spans = list(seed_phrases(text))
    assert len(spans) == 1
    assert text[spans[0][0] : spans[0][1]] == " ".join(words)


def test_labelled_instruction_plants_are_flagged() -> None:
    """Every labelled plant (languages, homoglyphs, entities, spacing, markdown exfiltration) is flagged."""
    assert [text for text in INSTRUCTIONS if injection_reason(text) is None] == []


def _files_holding(root: Path, needles: list[str]) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for path in root.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            hits = [needle for needle in needles if needle.encode() in data]
            if hits:
                found[str(path.relative_to(root))] = hits
    return found


@pytest.mark.slow
async def test_secrets_typed_in_chat_are_on_disk_nowhere(make_proxy: ProxyFactory, tmp_path: Path) -> None:
    """Six secret shapes typed in chats (answered, stored, facts extracted) are in no file of the data directory:
    not in the store, the keyword index, the job queue or its WAL."""
    proxy = await make_proxy(admin={"api_key": "admin"})
    for i, text in enumerate(TYPED.values()):
        body = {"model": "fake-echo", "messages": [{"role": "user", "content": text}]}
        headers = {"X-Memory-User": "leaky-lee", "X-Memory-Conversation": f"c{i}"}
        response = await proxy.post("/v1/chat/completions", json=body, headers=headers)
        assert response.status == 200
    await settled(proxy)
    export = await proxy.get("/v1/memory/users/leaky-lee/export", headers={"Authorization": "Bearer admin"})
    exported = await export.text()
    assert "[redacted:" in exported
    assert [secret for secret in TYPED if secret in exported] == []
    assert _files_holding(tmp_path, list(TYPED)) == {}
