"""What another worker can do is retried there: a backend that fails at its own work (an HTTP
500, an error mid-answer, a reset connection) fails its task retryably, the reaper moves the
task to another worker with the model, and the worker that saw it is degraded at once, so
nothing more is routed to it until its probe finds the backend working. A failure no worker
could do better (a request the model refuses, an answer already streamed to its client)
fails the task at once. Real nats-server, router, reaper, workers, Ollama stand-ins."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from nats.aio.client import Client

from devtools.fakes.ollama import FakeOllama
from devtools.servers import NatsServer
from schemas.events import TaskFailed, TaskRouted
from schemas.route import RouteReply, StreamChunk
from services.runtime.request import stream_call
from tests.harness import ServiceRunner, eventually, request, workers_live
from tests.reaper_harness import TaskEvents

MODEL = "qwen2.5:0.5b"
EMBEDDER = "nomic-embed-text:latest"
PROMPT = "tell me about " + " ".join(f"item{i}" for i in range(12))
# Probes every 0.3 s while idle (a degraded worker's tell when it is well again).
PROBING: dict[str, Any] = {
    "health_interval_s": 0.3,
    "first_token_timeout_s": 2.0,
    "progress_timeout_s": 2.0,
}


async def workers(nc: Client) -> dict[str, dict[str, Any]]:
    body, _ = await request(nc, "coordinator.workers", {}, timeout_s=5.0)
    return {w["worker_id"]: w for w in body["workers"]}


async def health_of(nc: Client, worker_id: str) -> str:
    # A healthy worker's ``health`` is the default, so the reply leaves it out.
    return str((await workers(nc))[worker_id].get("health", "healthy"))


async def fleet(
    nats_server: NatsServer, nc: Client, runner: ServiceRunner, first: str, second: str
) -> None:
    """Router, reaper, and two workers: ``gpu-a`` on ``first``, which routing prefers (a GPU
    worker), and ``cpu-b`` on ``second``."""
    runner.router(nats_server.url)
    runner.reaper(nats_server.url)
    runner.worker(nats_server.url, first, "gpu-a", worker_supports=["gpu_inference"], **PROBING)
    runner.worker(nats_server.url, second, "cpu-b", **PROBING)
    await workers_live(nc, 2)


def attempts(events: TaskEvents, task_id: str) -> list[tuple[int, str]]:
    return [
        (e.attempt, e.worker) for e in events.of(task_id, "routed") if isinstance(e, TaskRouted)
    ]


@pytest.mark.parametrize(
    ("knobs", "code"),
    [
        pytest.param({"fail_status": 500}, "backend_server_error", id="HTTP 500"),
        pytest.param({"error_after_chunks": 2}, "backend_server_error", id="error mid-answer"),
        pytest.param({"reset_after_chunks": 0}, "backend_unavailable", id="connection reset"),
    ],
)
async def test_a_task_whose_backend_fails_at_its_own_work_completes_on_another_worker(
    knobs: dict[str, Any], code: str, nats_server: NatsServer, nc: Client, runner: ServiceRunner
) -> None:
    with FakeOllama(models=[MODEL]) as sick, FakeOllama(models=[MODEL]) as well:
        await fleet(nats_server, nc, runner, sick.url, well.url)
        sick.configure(**knobs)
        async with TaskEvents(nc) as events:
            body, _ = await request(
                nc, "coordinator.route", {"prompt": PROMPT, "model": MODEL, "wait": True}
            )
            task_id = body["task_id"]
            await events.ended(task_id, "completed")
            failed = [e for e in events.of(task_id, "failed") if isinstance(e, TaskFailed)]

            assert (body["status"], body["worker"]) == ("done", "cpu-b")
            assert body["response"] == f"Echo from {MODEL}: {PROMPT}"
            assert attempts(events, task_id) == [(1, "gpu-a"), (2, "cpu-b")]
            assert [(f.attempt, f.worker, f.code, f.retryable) for f in failed] == [
                (1, "gpu-a", code, True)
            ]
            # The sick worker says so in its next heartbeat, and gets nothing meanwhile.

            async def degraded() -> dict[str, Any] | None:
                record = (await workers(nc))["gpu-a"]
                return record if record.get("health") == "degraded" else None

            sick_record = await eventually(degraded, timeout_s=5)
            assert code in sick_record["health_reason"]
            again, _ = await request(
                nc, "coordinator.route", {"prompt": "1+1", "model": MODEL, "wait": True}
            )
            assert (again["status"], again["worker"]) == ("done", "cpu-b")
            await events.ended(again["task_id"], "completed")
            assert attempts(events, again["task_id"]) == [(1, "cpu-b")]

        # Its probe lifts the mark once the backend works again.
        sick.configure(fail_status=None, error_after_chunks=None, reset_after_chunks=None)

        async def healthy() -> bool:
            return await health_of(nc, "gpu-a") == "healthy"

        await eventually(healthy, timeout_s=10)


async def test_a_request_the_model_refuses_fails_at_once_though_another_worker_is_idle(
    nats_server: NatsServer, nc: Client, runner: ServiceRunner
) -> None:
    """An HTTP 400 (an input over the model's context, asked not to be cut): another
    worker's copy would refuse it too. Nobody is degraded for it."""
    with FakeOllama(models=[EMBEDDER]) as one, FakeOllama(models=[EMBEDDER]) as other:
        await fleet(nats_server, nc, runner, one.url, other.url)
        sanity = other.stats()["embed_calls"]  # cpu-b's sanity run
        long = " ".join(["word"] * 600)  # past the model's 512-token context
        asked = {
            "model": EMBEDDER,
            "task_type": "embedding",
            "prompt": long,
            "input": [long],
            "truncate": False,
            "wait": True,
        }
        async with TaskEvents(nc) as events:
            body, _ = await request(nc, "coordinator.route", asked)
            task_id = body["task_id"]

            assert (body["status"], body["failure"]["code"]) == ("failed", "backend_error")
            assert "input exceeds maximum context length" in body["failure"]["message"]
            await events.ended(task_id, "failed")
            assert attempts(events, task_id) == [(1, "gpu-a")]
            failed = events.of(task_id, "failed")
            assert [(e.worker, e.retryable) for e in failed if isinstance(e, TaskFailed)] == [
                ("gpu-a", False)
            ]
        assert other.stats()["embed_calls"] == sanity  # never asked of cpu-b
        assert await health_of(nc, "gpu-a") == "healthy"


async def test_a_streamed_answer_its_backend_cuts_short_fails_and_is_not_run_again(
    nats_server: NatsServer, nc: Client, runner: ServiceRunner
) -> None:
    """The client has the answer's start: a new attempt's answer would not continue it."""
    with FakeOllama(models=[MODEL]) as sick, FakeOllama(models=[MODEL]) as well:
        await fleet(nats_server, nc, runner, sick.url, well.url)
        sick.error_after_chunks = 3
        chunks: list[StreamChunk] = []
        final = b""
        body = msgspec.json.encode({"prompt": PROMPT, "model": MODEL, "stream": True})
        async with TaskEvents(nc) as events:
            async for item in stream_call(nc, "coordinator.route", body, 30.0):
                if isinstance(item, bytes):
                    final = item
                else:
                    chunks.append(item)
            reply = msgspec.json.decode(final, type=RouteReply)

            assert reply.status == "failed" and reply.failure is not None
            assert reply.failure.code == "backend_server_error"
            assert "".join(c.response for c in chunks)  # what reached the client first
            await events.ended(reply.task_id, "failed")
            assert attempts(events, reply.task_id) == [(1, "gpu-a")]
        assert well.stats()["generate_calls"] == 1  # cpu-b: its sanity run alone
