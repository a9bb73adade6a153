"""``[telemetry]``: where OpenTelemetry spans go (``proxy.telemetry.tracing``); off unless an endpoint is set."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class TelemetrySettings(BaseModel):
    """OTLP over HTTP. An empty ``otlp_endpoint`` falls back to ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or
    ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``); with neither, no span is made."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    otlp_endpoint: str = ""  # e.g. http://127.0.0.1:4318 (/v1/traces is added unless the URL has a path)
    service_name: str = Field(default="memproxy", min_length=1)
    sample_ratio: float = Field(default=1.0, ge=0.0, le=1.0)  # of traces that start here (a parent's choice wins)
