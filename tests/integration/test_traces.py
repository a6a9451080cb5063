"""One trace per task, from the client's request through router, queue, worker, backend call
and the stats projection; and one canonical log line per handled message carrying it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
from nats.aio.client import Client
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from structlog.contextvars import merge_contextvars
from structlog.testing import capture_logs

from devtools.fakes.ollama import FakeOllama
from devtools.servers import NatsServer
from schemas.route import RouteReply, RouteRequest
from schemas.subjects import ROUTE, TASK
from services.runtime.logging import add_trace_id
from services.runtime.request import call
from tests.harness import ServiceRunner, eventually, request, workers_live


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    """Every span ended in this process while the test runs (all services are in-process)."""
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield exporter
    exporter.shutdown()  # the processor stays, exporting nothing


async def test_one_trace_across_services_and_its_id_on_each_canonical_log_line(
    nats_server: NatsServer,
    nc: Client,
    ollama: FakeOllama,
    runner: ServiceRunner,
    pg_dsn: str,
    spans: InMemorySpanExporter,
) -> None:
    runner.stats(nats_server.url, pg_dsn)
    runner.router(nats_server.url)
    runner.worker(nats_server.url, ollama.url, "cpu1")
    await workers_live(nc, 1)

    tracer = trace.get_tracer("tests")
    with capture_logs(processors=[merge_contextvars, add_trace_id]) as logs:
        with tracer.start_as_current_span("client ask") as client_span:
            body = RouteRequest(prompt="1+1?", model="qwen2.5:0.5b", wait=True)
            reply = msgspec.json.decode(
                await call(nc, ROUTE, msgspec.json.encode(body), 30.0), type=RouteReply
            )
        assert reply.status == "done"

        async def projected() -> dict[str, Any] | None:
            try:
                found, _ = await request(nc, TASK, {"task_id": reply.task_id}, timeout_s=2.0)
            except Exception:
                return None  # the stats service is still starting
            return found if found.get("status") == "done" else None

        await eventually(projected, timeout_s=10.0)

        def ours() -> list[ReadableSpan]:
            trace_id = client_span.get_span_context().trace_id
            return [
                s
                for s in spans.get_finished_spans()
                if s.context is not None and s.context.trace_id == trace_id
            ]

        names = {"client ask", "route", "run task", "backend generate", "project event"}
        await eventually(lambda: _async(names <= {s.name for s in ours()}), timeout_s=5.0)

    trace_id = format(client_span.get_span_context().trace_id, "032x")
    by_name = {s.name: s for s in ours()}
    # The worker's spans hang under the router's, the backend call under the worker's.
    assert by_name["route"].parent is not None
    assert by_name["run task"].parent is not None
    assert by_name["backend generate"].parent.span_id == by_name["run task"].context.span_id  # type: ignore[union-attr]

    canonical = {
        entry["event"]: entry
        for entry in logs
        if entry.get("task_id") == reply.task_id
        and entry["event"] in ("routed", "task done", "event projected")
    }
    assert set(canonical) == {"routed", "task done", "event projected"}, logs
    for entry in canonical.values():
        assert entry["trace_id"] == trace_id
        assert entry["subject"]
        assert isinstance(entry["stream_seq"], int)
    assert canonical["routed"]["subject"] == "tasks.cpu.cpu1"
    assert canonical["task done"]["subject"] == "tasks.cpu.cpu1"
    assert canonical["event projected"]["subject"].startswith(f"events.task.{reply.task_id}.")


async def _async(value: bool) -> bool:
    return value
