"""The credential screen: the shapes secrets take when people paste or type them into a chat.

Each finder returns spans of ``(start, end, kind)`` in the text, the secret itself only (the words around it stay):

- **tokens by their prefix** (``api_key``): cloud and SaaS keys whose shape names them (AWS key ids, GitHub, GitLab,
  Slack, Stripe, npm, PyPI, SendGrid, Hugging Face, Google, Twilio, Mailchimp, Shopify, Vault, ...), after the
  patterns of detect-secrets' and gitleaks' rules;
- **connection strings** (``connection_string``): the password of ``scheme://user:password@host``, and Azure's
  ``AccountKey=`` / ``SharedAccessKey=`` / ``sig=``;
- **assignments** (``secret_assignment``): ``NAME=value``, ``NAME: value`` or ``"name": "value"`` where the name
  reads as a secret's (``AWS_SECRET_ACCESS_KEY``, ``db_password``, ``client_secret``, ``api-key``);
- **Authorization headers** (``token``): ``Bearer``, ``Basic`` (base64 of ``user:password``), ``Authorization:``;
- **passwords however phrased** (``credential``): "password is x", "pw: x", "my password hunter2Secret" (a bare
  word after the keyword counts only when it looks like a password: digits, symbols or mixed case), and a quoted
  passphrase whole ("passphrase 'correct horse battery staple'");
- **card security codes** (``card_security_code``): "cvv 123", "CVC: 4321", "security code 123";
- **seed phrases** (``seed_phrase``): 12 or more consecutive words of the BIP-39 English list (the list
  ``mnemonic`` ships);
- **unlabelled random strings** (``high_entropy``): a 30+ character run mixing upper case, lower case and digits
  with high character entropy, such as an AWS secret access key pasted on its own.
"""

from __future__ import annotations

import base64
import binascii
import functools
import math
import re
from collections import Counter
from collections.abc import Callable, Iterator

from mnemonic import Mnemonic

_I = re.IGNORECASE
Found = tuple[int, int, str]

_PREFIXED = re.compile(
    r"\b(?:A3T[A-Z0-9]|AKIA|ASIA|AGPA|AIDA|AROA|AIPA|ANPA|ANVA)[A-Z0-9]{16}\b"  # AWS access key ids
    r"|\b(?:sk|rk|pk)-[A-Za-z0-9_-]{16,}"  # OpenAI, Anthropic (sk-ant-), ...
    r"|\b[sr]k_(?:live|test)_[A-Za-z0-9]{16,}|\bwhsec_[A-Za-z0-9]{24,}"  # Stripe
    r"|\bgh[pousr]_[A-Za-z0-9]{30,}|\bgithub_pat_[A-Za-z0-9_]{30,}"  # GitHub
    r"|\bglpat-[A-Za-z0-9_-]{20,}|\bgl(?:dt|rt|soat|ptt)-[A-Za-z0-9_-]{20,}"  # GitLab
    r"|\bxox[abposre]-[A-Za-z0-9-]{10,}|hooks\.slack\.com/services/[A-Za-z0-9/]{20,}"  # Slack
    r"|\bAIza[0-9A-Za-z_-]{35}|\bya29\.[0-9A-Za-z_-]{20,}|\bGOCSPX-[0-9A-Za-z_-]{20,}"  # Google
    r"|\bnpm_[A-Za-z0-9]{36}\b|\bpypi-[A-Za-z0-9_-]{50,}"  # npm, PyPI
    r"|\bSG\.[A-Za-z0-9_-]{16,32}\.[A-Za-z0-9_-]{16,64}"  # SendGrid
    r"|\bhf_[A-Za-z0-9]{30,}|\bSK[0-9a-f]{32}\b|\b[0-9a-f]{32}-us\d{1,2}\b|\bkey-[0-9a-z]{32}\b"  # HF, Twilio, ...
    r"|\bsq0(?:atp|csp)-[0-9A-Za-z_-]{22,}|\bshp(?:at|ca|pa|ss)_[a-fA-F0-9]{32}"  # Square, Shopify
    r"|\bdop_v1_[a-f0-9]{64}|\bdapi[a-f0-9]{32}|\bhv[sb]\.[A-Za-z0-9_-]{24,}|\bPMAK-[A-Za-z0-9-]{30,}"
    r"|\bAGE-SECRET-KEY-1[0-9A-Z]{50,}|\blin_api_[A-Za-z0-9]{30,}|\bgls[a]_[A-Za-z0-9_]{30,}|\bATATT[A-Za-z0-9_=-]{30,}"
    r"|\b\d{8,10}:AA[0-9A-Za-z_-]{33}\b"  # Telegram bot tokens
    r"|\b[MN][A-Za-z\d]{23,25}\.[\w-]{6}\.[\w-]{27,38}"  # Discord bot tokens
    r"|\beyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}"  # JWTs
)
_CONNECTION = re.compile(
    r"\b[a-z][a-z0-9+.-]{1,20}://[^\s:/@\"'<>]{0,64}:(?P<secret>[^\s@/\"'<>]{1,128})@[^\s]"
    r"|\b(?:AccountKey|SharedAccessKey|SharedSecret|sig|password|pwd)=(?P<azure>[^\s;&\"'<>]{4,})",
    _I,
)
# A name that reads as a secret's, matched from its secret word on (bounded: no scan back over a long run).
_NAME_WORDS = (
    r"(?:secret|passw(?:or)?d|pwd|token|api[_-]?key|access[_-]?key|private[_-]?key|credentials?"
    r"|auth[_-]?key|account[_-]?key|signing[_-]?key|encryption[_-]?key|session[_-]?key)[A-Za-z0-9_.-]{0,40}"
)
_ASSIGNMENT = re.compile(rf"{_NAME_WORDS}[\"']?\s*(?::=|=>|[:=])\s*(?P<quote>[\"'`]?)(?P<secret>[^\s\"'`,;]{{4,}})", _I)
_AUTHORIZATION = re.compile(
    r"\b(?:proxy-)?authorization\s*[:=]\s*(?:(?:bearer|basic|token|digest|apikey)\s+)?(?P<secret>[^\s\"',;]{6,})"
    r"|\bx-api-key\s*[:=]\s*(?P<key>[^\s\"',;]{6,})"
    r"|\bbearer\s+(?P<bearer>[A-Za-z0-9._~+/-]{16,}=*)"
    r"|\bbasic\s+(?P<basic>[A-Za-z0-9+/]{6,}={0,2})(?![A-Za-z0-9+/=])",
    _I,
)
# "password: x", "password is x", "password's x", "password - x", and "ist", "es", "est", "é" after the German,
# Spanish, French and Portuguese words.
_SEPARATOR = r"\s*(?:[:=]|\s(?:is|was|are|ist|es|est|é)\s|['\u2019]s\s|\s[-\u2013\u2014]\s)\s*"
_QUOTES = {'"': '"', "'": "'", "`": "`", "\u201c": "\u201d", "\u2018": "\u2019", "\u00ab": "\u00bb"}
_PASSWORD = re.compile(
    r"\b(?P<word>passwords?|passwd|passphrase|passcode|pass\s+word|pass\s*code|pwd|pw|mot\s+de\s+passe|passwort|"
    r"kennwort|contraseña|senha|wi-?fi\s+(?:key|code)|login|pin(?:\s+(?:code|number))?)\b"
    rf"(?P<topic>\s+(?:for|to|of|on|at)(?:\s+[^\s.,;:!?]+){{1,4}}?(?={_SEPARATOR}))?"
    rf"(?P<sep>{_SEPARATOR}|\s+)"
    r"(?P<value>[\"'`\u201c\u2018\u00ab][^\n]{1,80}|[^\s]{1,80})",
    _I,
)
_EXPLICIT_SEP = re.compile(_SEPARATOR, _I)
_WEAK_WORDS = frozenset({"pw", "pwd", "login", "pin", "pin code", "pin number"})
_TRAILING = ".,;:!?)]}'\"\u3002\uff0c"
_CVV = re.compile(
    r"\b(?:cvv2?|cvc2?|cvn|csc|cid|security\s+code|card\s+verification(?:\s+(?:code|value|number))?)\b"
    r"[^\w\n]{0,3}(?:is\s+|was\s+|of\s+)?(?P<secret>\d{3,4})\b",
    _I,
)
_RANDOM = re.compile(r"(?<![A-Za-z0-9+/_=.-])[A-Za-z0-9+/_-]{30,}={0,2}(?![A-Za-z0-9+/_=-])")
_WORD = re.compile(r"[a-z]+")
SEED_WORDS = 12


@functools.cache
def bip39_words() -> frozenset[str]:
    """The 2,048 words of the BIP-39 English list."""
    return frozenset(Mnemonic("english").wordlist)


def _spans(pattern: re.Pattern[str], text: str, kind: str, groups: tuple[str, ...] = ("secret",)) -> Iterator[Found]:
    for match in pattern.finditer(text):
        group = next((g for g in groups if g in pattern.groupindex and match.group(g)), 0)
        yield match.start(group), match.end(group), kind


def prefixed_tokens(text: str) -> Iterator[Found]:
    """Keys and tokens whose prefix names them."""
    yield from _spans(_PREFIXED, text, "api_key")


def connection_strings(text: str) -> Iterator[Found]:
    """The password of a URL with credentials, Azure's account and access keys, SAS signatures."""
    yield from _spans(_CONNECTION, text, "connection_string", ("secret", "azure"))


def assignments(text: str) -> Iterator[Found]:
    """``SECRET_NAME=value`` and its JSON, YAML and shell forms."""
    for match in _ASSIGNMENT.finditer(text):
        value = match.group("secret").rstrip(_TRAILING)
        if value and not value.startswith("[redacted"):
            yield match.start("secret"), match.start("secret") + len(value), "secret_assignment"


def _basic_credentials(value: str) -> bool:
    try:
        decoded = base64.b64decode(value + "=" * (-len(value) % 4), validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError):
        return False
    return ":" in decoded and decoded.isprintable()


def authorization(text: str) -> Iterator[Found]:
    """Authorization headers and their bearer, basic and API-key values."""
    for match in _AUTHORIZATION.finditer(text):
        group = next(g for g in ("secret", "key", "bearer", "basic") if match.group(g))
        if group == "basic" and not _basic_credentials(match.group(group)):
            continue
        yield match.start(group), match.end(group), "token"


def _looks_like_password(value: str) -> bool:
    """A bare word after "password" (no "is" or ":"): a password if it has digits, symbols or mixed case."""
    if len(value) < 4:
        return False
    has_digit = any(c.isdigit() for c in value)
    has_symbol = any(not c.isalnum() for c in value)
    mixed = any(c.isupper() for c in value[1:]) and any(c.islower() for c in value)
    return has_digit or has_symbol or mixed


def _value_span(match: re.Match[str]) -> tuple[int, int] | None:
    start, value = match.start("value"), match.group("value")
    closer = _QUOTES.get(value[0])
    if closer is not None:
        end = value.find(closer, 1)
        return (start + 1, start + end) if end > 1 else None
    value = value.rstrip(_TRAILING)
    return (start, start + len(value)) if value else None


def passwords(text: str) -> Iterator[Found]:
    """Passwords, passphrases, PINs and logins however phrased (see the module doc)."""
    for match in _PASSWORD.finditer(text):
        span = _value_span(match)
        if span is None or text.startswith("[redacted", span[0]):
            continue
        explicit = _EXPLICIT_SEP.fullmatch(match.group("sep")) is not None
        quoted = text[span[0] - 1] in _QUOTES
        word = re.sub(r"\s+", " ", match.group("word").lower())
        if match.group("topic") and not explicit:
            continue
        if not explicit and not quoted and (word in _WEAK_WORDS or not _looks_like_password(text[span[0] : span[1]])):
            continue
        if word in _WEAK_WORDS and word != "pw" and not any(c.isdigit() for c in text[span[0] : span[1]]):
            continue  # "login: tomorrow", "pin: the map": a PIN or login has digits
        yield span[0], span[1], "credential"


def card_security_codes(text: str) -> Iterator[Found]:
    """ "cvv 123", "CVC: 4321", "security code is 123"."""
    yield from _spans(_CVV, text, "card_security_code")


def seed_phrases(text: str) -> Iterator[Found]:
    """Runs of at least ``SEED_WORDS`` BIP-39 words, separated by spaces, commas, newlines or list numbers."""
    words, run = bip39_words(), list[re.Match[str]]()
    lowered = text.lower()
    for match in _WORD.finditer(lowered):
        between = lowered[run[-1].end() : match.start()] if run else ""
        if match.group() in words and (not run or re.fullmatch(r"[\s,;.\d)-]*", between)):
            run.append(match)
            continue
        if len(run) >= SEED_WORDS:
            yield run[0].start(), run[-1].end(), "seed_phrase"
        run = [match] if match.group() in words else []
    if len(run) >= SEED_WORDS:
        yield run[0].start(), run[-1].end(), "seed_phrase"


def _entropy(value: str) -> float:
    counts = Counter(value)
    return -sum(n / len(value) * math.log2(n / len(value)) for n in counts.values())


def random_strings(text: str) -> Iterator[Found]:
    """30+ characters mixing upper, lower and digits with high entropy (a secret key pasted without a label)."""
    for match in _RANDOM.finditer(text):
        value = match.group()
        if not (
            any(c.isupper() for c in value) and any(c.islower() for c in value) and any(c.isdigit() for c in value)
        ):
            continue
        if _entropy(value) >= 4.2:
            yield match.start(), match.end(), "high_entropy"


# Each finder with the needles (lower case) one of which the text must hold for the finder to run.
FINDERS: tuple[tuple[Callable[[str], Iterator[Found]], tuple[str, ...]], ...] = (
    (prefixed_tokens, ()),
    (connection_strings, ("://", "key=", "sig=", "password=", "pwd=")),
    (assignments, ("secret", "pass", "pwd", "token", "key", "credential")),
    (authorization, ("authorization", "x-api-key", "bearer", "basic")),
    (passwords, ("pass", "pw", "mot de", "kennwort", "contrase", "senha", "wi", "login", "pin")),
    (card_security_codes, ("cvv", "cvc", "cvn", "csc", "cid", "security code", "verification")),
    (seed_phrases, ()),
    (random_strings, ()),
)


def secret_spans(text: str) -> list[Found]:
    """Every credential-shaped span of ``text`` (overlaps allowed; the caller keeps the outermost)."""
    lowered = text.lower()
    found: list[Found] = []
    for finder, needles in FINDERS:
        if not needles or any(needle in lowered for needle in needles):
            found.extend(finder(text))
    return found
