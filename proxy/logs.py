"""structlog configuration: JSON lines on stdout, configured once at start, request ids via contextvars.

A redaction processor drops anything that looks like a credential, so that no key or Authorization header can
reach a log line even by mistake. The same redaction runs on every stdlib log record (``RedactingFilter`` on the
root handler), messages and tracebacks included: aiohttp logs a malformed request with the raw bytes it could
not parse, ``Authorization: Bearer ...`` header and all.

Every line is one JSON object, whatever it holds: a value that is not valid UTF-8 (a header's bad byte, a lone
surrogate from a JSON body) is written escaped (``\\xff``, ``\\ud800``) instead of making the line fail
(``safe_value``), and stdlib records (aiohttp's own errors, libraries' warnings) are written as JSON lines too
(``JsonFormatter``), tracebacks inside the ``exception`` field, never as plain text.
"""

from __future__ import annotations

import functools
import logging
import re
import sys
from collections.abc import MutableMapping
from datetime import UTC, datetime
from typing import Any

import orjson
import structlog

_SECRET_KEYS = re.compile(r"(authorization|api[_-]?key|secret|password|access_token)", re.IGNORECASE)
_SECRET_VALUES = re.compile(r"(Bearer\s+\S+|sk-[A-Za-z0-9_\-]{8,})")
# A credential header inside free text (a raw request in an error message): its value up to the line's end,
# a quote, or an escaped CR/LF as ``repr`` shows it.
_SECRET_HEADERS = re.compile(
    r"((?:proxy-)?authorization|x-api-key|api-key|cookie)(\s*[:=]\s*)(?:(?!\\r|\\n)[^\r\n'\"])+", re.IGNORECASE
)
# Every match of the two patterns above holds one of these, case aside. For ASCII text (what log values almost
# always are) a search of the lower-cased text decides that exactly, and text without any has nothing to redact:
# the regex passes over each value were a large share of a request's log line.
_MARKERS = re.compile("sk-|bearer|authorization|api-key|cookie")


def redact_text(text: str) -> str:
    """``text`` with credential headers and bearer tokens / API keys replaced by ``[redacted]``."""
    if text.isascii() and _MARKERS.search(text.lower()) is None:
        return text
    return redact_patterns(text)


def redact_patterns(text: str) -> str:
    """``redact_text`` without its quick path: both patterns run over the text."""
    return _SECRET_VALUES.sub("[redacted]", _SECRET_HEADERS.sub(r"\1\2[redacted]", text))


@functools.lru_cache(maxsize=1024)
def _secret_key(key: str) -> bool:
    """Whether an event key names a credential (keys are the code's own names: a few dozen, decided once)."""
    return _SECRET_KEYS.search(key) is not None


class RedactingFilter(logging.Filter):
    """Redacts credentials from a stdlib log record's message and traceback before any handler formats it."""

    _formatter = logging.Formatter()

    def filter(self, record: logging.LogRecord) -> bool:
        """Rewrite the record in place; never drops it."""
        record.msg = redact_text(record.getMessage())
        record.args = None
        if record.exc_info and not record.exc_text:
            record.exc_text = self._formatter.formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact_text(record.exc_text)
        return True


def redact(_: Any, __: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """Blank credential-like keys and values in a log event."""
    for key, value in list(event.items()):
        if _secret_key(key):
            event[key] = "[redacted]"
        elif isinstance(value, str):
            event[key] = redact_text(value)
    return event


def escaped(text: str) -> str:
    """``text`` as printable text: bytes that were not UTF-8 (surrogate-escaped) as ``\\xNN``."""
    try:
        return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:  # a surrogate that is no escaped byte
        return text.encode("utf-8", "backslashreplace").decode("utf-8")


def safe_value(value: Any) -> Any:
    """``value`` with every string (keys included) valid UTF-8 and everything else JSON can hold."""
    if isinstance(value, str):
        return escaped(value)
    if isinstance(value, dict):
        return {safe_value(str(key)): safe_value(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [safe_value(item) for item in value]
    if value is None or isinstance(value, (bool, int, float)):
        return value
    return escaped(str(value))


def _dumps(obj: Any, default: Any = None) -> bytes:
    try:
        return orjson.dumps(obj, default=default or str)
    except (orjson.JSONEncodeError, UnicodeError):  # text that is not UTF-8: escaped, the line still written
        return orjson.dumps(safe_value(obj))


def _dumps_text(obj: Any, default: Any = None) -> str:
    return _dumps(obj, default).decode()


class JsonFormatter(logging.Formatter):
    """A stdlib record as one JSON line shaped like structlog's (after ``RedactingFilter`` ran on it)."""

    def format(self, record: logging.LogRecord) -> str:
        """The record's line: event, logger, level, timestamp, the request's bound context, any traceback."""
        when = datetime.fromtimestamp(record.created, UTC).isoformat().replace("+00:00", "Z")
        event: dict[str, Any] = {
            **structlog.contextvars.get_contextvars(),
            "event": record.getMessage(),
            "logger": record.name,
            "level": record.levelname.lower(),
            "timestamp": when,
        }
        if record.exc_info and not record.exc_text:
            record.exc_text = redact_text(self.formatException(record.exc_info))
        if record.exc_text:
            event["exception"] = record.exc_text
        return _dumps_text(event)


def configure_logging(level: str = "info") -> None:
    """Configure structlog (and the stdlib root logger) to write JSON lines to stdout."""
    numeric = logging.getLevelName(level.upper())
    logging.basicConfig(stream=sys.stdout, level=numeric, format="%(message)s", force=True)
    for handler in logging.getLogger().handlers:
        handler.addFilter(RedactingFilter())
        handler.setFormatter(JsonFormatter())
    for noisy in ("aiohttp.access", "LiteLLM", "httpx", "lance"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # A line and its newline in one write (``print`` makes them two system calls on an unbuffered stdout, the
    # container's): the binary stream when there is one.
    binary = getattr(sys.stdout, "buffer", None)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            redact,
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(serializer=_dumps if binary is not None else _dumps_text),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=(
            structlog.BytesLoggerFactory(file=binary)
            if binary is not None
            else structlog.PrintLoggerFactory(file=sys.stdout)
        ),
        cache_logger_on_first_use=True,
    )
