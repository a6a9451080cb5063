"""OpenTelemetry: one trace per task, carried across services in NATS headers.

The exporter is chosen by the standard variables: ``OTEL_TRACES_EXPORTER`` = ``otlp``
(OTLP over HTTP to ``OTEL_EXPORTER_OTLP_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``,
which the exporter reads itself, with ``OTEL_EXPORTER_OTLP_HEADERS`` and friends),
``console`` (spans printed) or ``none``. Unset, OTLP is used when an OTLP endpoint is set, and
nothing is exported otherwise. With nothing to export, spans are not recorded (the sampler
drops them unless ``OTEL_TRACES_SAMPLER`` says otherwise): they still carry a trace id, which
log lines show and messages pass on, at a fraction of a recorded span's cost.

The context travels as W3C ``traceparent`` (and ``tracestate``) headers on NATS messages:
`inject_context` on the way out (requests, task messages, events), `extract_context` on the way
in.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
)
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF

from services.errors import ConfigError

EXPORTERS = ("otlp", "console", "none")


def exporter_name(environ: Mapping[str, str] | None = None) -> str:
    """Which exporter the ``OTEL_*`` variables ask for: ``otlp``, ``console`` or ``none``."""
    env = os.environ if environ is None else environ
    name = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if not name:
        endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get(
            "OTEL_EXPORTER_OTLP_ENDPOINT"
        )
        return "otlp" if endpoint else "none"
    if name not in EXPORTERS:
        raise ConfigError(f"OTEL_TRACES_EXPORTER={name!r}: use one of {', '.join(EXPORTERS)}")
    return name


def setup_tracing(service_name: str) -> None:
    """Install the process's tracer provider once (``OTEL_SERVICE_NAME`` wins for the name)."""
    if isinstance(trace.get_tracer_provider(), TracerProvider):
        return
    name = exporter_name()
    resource = Resource.create({"service.name": service_name})  # OTEL_* resource vars merge in
    # Nothing would see a recorded span: keep the ids, skip the recording. An explicit
    # OTEL_TRACES_SAMPLER wins (the provider reads it when given no sampler).
    drop = name == "none" and not os.environ.get("OTEL_TRACES_SAMPLER")
    # The provider flushes buffered spans at exit (shutdown_on_exit).
    provider = TracerProvider(resource=resource, sampler=ALWAYS_OFF if drop else None)
    if name == "console":
        provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
    elif name == "otlp":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)


def spans_recorded() -> bool:
    """Whether a span made now could be recorded: False when the sampler drops every span
    (`setup_tracing` with nothing to export), so a hot path may skip making one."""
    return getattr(trace.get_tracer_provider(), "sampler", None) is not ALWAYS_OFF


def inject_context(headers: dict[str, str]) -> dict[str, str]:
    """Add the current trace context (``traceparent``) to ``headers``; returns them."""
    propagate.inject(headers)
    return headers


def extract_context(headers: Mapping[str, str] | None) -> otel_context.Context:
    """The trace context a message carries (an empty one when it carries none)."""
    return propagate.extract(dict(headers or {}))


def trace_id_of(span: trace.Span | None = None) -> str | None:
    """The 32-hex-digit trace id of ``span`` (default: the current one), None outside a trace."""
    ctx = (span or trace.get_current_span()).get_span_context()
    return format(ctx.trace_id, "032x") if ctx.is_valid else None
