"""Traces: OpenTelemetry spans over OTLP/HTTP when an endpoint is configured (``tracing``), and the
``[telemetry]`` settings that say where they go (``settings``).

Each name is imported on first use, as ``proxy.memory`` does: the config loader takes ``TelemetrySettings``
from here without pulling in the app's state and aiohttp with ``tracing``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from proxy.memory import exports_on_first_use

if TYPE_CHECKING:
    from proxy.telemetry.settings import TelemetrySettings
    from proxy.telemetry.tracing import install_tracing, record_retrieve

# What the face exports, and the module that defines it (imported on first use).
_WHERE = {
    "TelemetrySettings": "proxy.telemetry.settings",
    "install_tracing": "proxy.telemetry.tracing",
    "record_retrieve": "proxy.telemetry.tracing",
}
__all__ = ["TelemetrySettings", "install_tracing", "record_retrieve"]

__getattr__ = exports_on_first_use(__name__, _WHERE)
