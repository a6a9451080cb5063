"""OpenTelemetry: a tracer provider that exports nothing unless configured.

``OTEL_TRACES_EXPORTER=console`` prints spans; anything else (or nothing) keeps them in
process only. The exporter for a collector is configured by the standard ``OTEL_*`` variables.
"""

from __future__ import annotations

import os

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor


def setup_tracing(service_name: str) -> None:
    """Install the process's tracer provider once."""
    if isinstance(trace.get_tracer_provider(), TracerProvider):
        return
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    if os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "console":
        provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
    trace.set_tracer_provider(provider)
