"""structlog configuration: JSON lines on stdout, configured once at start, request ids via contextvars.

A redaction processor drops anything that looks like a credential, so that no key or Authorization header can
reach a log line even by mistake.
"""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import MutableMapping
from typing import Any

import orjson
import structlog

_SECRET_KEYS = re.compile(r"(authorization|api[_-]?key|secret|password|access_token)", re.IGNORECASE)
_SECRET_VALUES = re.compile(r"(Bearer\s+\S+|sk-[A-Za-z0-9_\-]{8,})")


def redact(_: Any, __: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """Blank credential-like keys and values in a log event."""
    for key, value in list(event.items()):
        if _SECRET_KEYS.search(key):
            event[key] = "[redacted]"
        elif isinstance(value, str) and _SECRET_VALUES.search(value):
            event[key] = _SECRET_VALUES.sub("[redacted]", value)
    return event


def _dumps(obj: Any, default: Any = None) -> str:
    return orjson.dumps(obj, default=default or str).decode()


def configure_logging(level: str = "info") -> None:
    """Configure structlog (and the stdlib root logger) to write JSON lines to stdout."""
    numeric = logging.getLevelName(level.upper())
    logging.basicConfig(stream=sys.stdout, level=numeric, format="%(message)s", force=True)
    for noisy in ("aiohttp.access", "LiteLLM", "httpx", "lance"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            redact,
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(serializer=_dumps),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stdout),
        cache_logger_on_first_use=True,
    )
