"""OpenTelemetry spans where memproxy works, at no cost while tracing is off.

``proxy.telemetry`` installs a tracer when an OTLP endpoint is configured; until then every helper here
returns after one ``None`` check; this module imports nothing of OpenTelemetry (the ``otel`` extra is optional).

- ``span(name)``: a child of the current span, around a block;
- ``record_span(name, seconds)``: a child that ended just now and lasted ``seconds`` (for steps that are
  already timed, so the hot path is not re-indented around them);
- ``current_traceparent()``: the W3C ``traceparent`` of the current span, for a job to carry;
- ``job_span(name, traceparent)``: a span whose parent is that ``traceparent`` (the write-side job of a
  request, in the request's trace).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

_tracer: Any = None  # an opentelemetry.trace.Tracer while tracing is on
_propagator: Any = None  # a W3C trace-context propagator (inject / extract) while tracing is on
_NULL = contextlib.nullcontext()


def install(tracer: Any, propagator: Any) -> None:
    """Turn spans on with ``tracer`` and ``propagator`` (both ``None``: off). The one switch, set by the app's
    lifecycle (``proxy.telemetry``), which imports OpenTelemetry."""
    global _tracer, _propagator
    _tracer, _propagator = tracer, propagator


def enabled() -> bool:
    """Whether spans are being made."""
    return _tracer is not None


def span(name: str, **attributes: Any) -> contextlib.AbstractContextManager[Any]:
    """A child of the current span around a block (a no-op context while tracing is off)."""
    if _tracer is None:
        return _NULL
    return _tracer.start_as_current_span(name, attributes=_clean(attributes))  # type: ignore[no-any-return]


def record_span(name: str, seconds: float, **attributes: Any) -> None:
    """A child of the current span that ended now and lasted ``seconds``."""
    if _tracer is None:
        return
    end = time.time_ns()
    started = _tracer.start_span(name, start_time=end - int(seconds * 1e9), attributes=_clean(attributes))
    started.end(end_time=end)


def current_traceparent() -> str | None:
    """The current span's ``traceparent`` header value, or None (tracing off, or no span)."""
    if _tracer is None:
        return None
    carrier: dict[str, str] = {}
    _propagator.inject(carrier)
    return carrier.get("traceparent")


@contextlib.contextmanager
def job_span(name: str, traceparent: str | None, **attributes: Any) -> Iterator[Any]:
    """A span (yielded; None while tracing is off) whose parent is ``traceparent``: a job in the trace of the
    request that enqueued it, or a request in its caller's trace (a root span without one)."""
    if _tracer is None:
        yield None
        return
    parent = _propagator.extract({"traceparent": traceparent}) if traceparent else None
    with _tracer.start_as_current_span(name, context=parent, attributes=_clean(attributes)) as current:
        yield current


def _clean(attributes: dict[str, Any]) -> dict[str, Any]:
    """Attributes OpenTelemetry takes (no None values)."""
    return {key: value for key, value in attributes.items() if value is not None}
