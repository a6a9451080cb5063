"""Routing end to end: router and workers in-process, real nats-server, Ollama stand-in."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from nats.aio.client import Client

from devtools.fakes.ollama import FakeOllama
from devtools.servers import NatsServer
from schemas.subjects import TASKS_STREAM
from tests.harness import ServiceRunner, error_of, last_task_event, request, workers_live

MODEL = "qwen2.5:0.5b"


async def ask(nc: Client, **fields: Any) -> tuple[dict[str, Any], dict[str, str]]:
    body = {"prompt": "1+1は？", "model": MODEL, "wait": True, **fields}
    return await request(nc, "coordinator.route", body)


async def test_a_prompt_is_routed_to_a_worker_and_answered(
    nats_server: NatsServer, nc: Client, ollama: FakeOllama, runner: ServiceRunner
) -> None:
    runner.router(nats_server.url)
    runner.worker(nats_server.url, ollama.url, "cpu-1")
    await workers_live(nc, 1)

    body, headers = await ask(nc)

    assert "Nats-Service-Error-Code" not in headers
    assert body["status"] == "done"
    assert body["response"] == "2"
    assert body["worker"] == "cpu-1"
    assert body["queue"] == "tasks.cpu.cpu-1"
    js = nc.jetstream()
    kinds = []
    for kind in ("submitted", "routed", "started", "completed"):
        msg = await last_task_event(js, body["task_id"], kind)
        kinds.append(str(msg.subject).rsplit(".", 1)[-1])
    assert kinds == ["submitted", "routed", "started", "completed"]
    # The task's message was acknowledged after its outcome, so the work queue is empty.
    assert (await js.stream_info(TASKS_STREAM)).state.messages == 0


async def test_without_wait_the_reply_says_queued_and_the_task_still_runs(
    nats_server: NatsServer, nc: Client, ollama: FakeOllama, runner: ServiceRunner
) -> None:
    runner.router(nats_server.url)
    runner.worker(nats_server.url, ollama.url, "cpu-1")
    await workers_live(nc, 1)
    done = await nc.subscribe("events.task.*.*.completed")

    body, _ = await ask(nc, wait=False)

    assert body["status"] == "queued"
    assert body["worker"] == "cpu-1"
    event = await done.next_msg(timeout=10)
    assert body["task_id"] in event.subject


BAD_REQUESTS: list[tuple[str, bytes | dict[str, Any], str]] = [
    ("not json", b"{prompt: 1+1", "bad_request"),
    ("no prompt", {"model": MODEL}, "bad_request"),
    ("prompt of the wrong type", {"prompt": 12, "model": MODEL}, "bad_request"),
    ("wait of the wrong type", {"prompt": "x", "model": MODEL, "wait": "yes"}, "bad_request"),
    ("empty prompt", {"prompt": "   ", "model": MODEL}, "bad_request"),
    ("unknown field", {"prompt": "x", "model": MODEL, "modle": "y"}, "bad_request"),
    ("worker id with a dot", {"prompt": "x", "model": MODEL, "worker": "a.b"}, "bad_request"),
    ("negative timeout", {"prompt": "x", "model": MODEL, "timeout_s": -1}, "bad_request"),
    ("prompt over the limit", {"prompt": "x" * 101, "model": MODEL}, "prompt_too_large"),
    ("unknown model", {"prompt": "x", "model": "llama-9000"}, "no_worker"),
    (
        "designated worker not live",
        {"prompt": "x", "model": MODEL, "worker": "gpu-9"},
        "worker_unavailable",
    ),
]


async def test_bad_requests_get_an_error_with_a_code_and_leave_no_task_behind(
    nats_server: NatsServer, nc: Client, ollama: FakeOllama, runner: ServiceRunner
) -> None:
    runner.router(nats_server.url, max_prompt_chars=100)
    runner.worker(nats_server.url, ollama.url, "cpu-1")
    await workers_live(nc, 1)
    js = nc.jetstream()
    # Task events only: the worker's own registration event may still be on its way.
    task_events = await nc.subscribe("events.task.>")

    for label, body, code in BAD_REQUESTS:
        reply, headers = await request(nc, "coordinator.route", body)
        error = error_of(reply).error
        assert (label, error.code) == (label, code), error.message
        assert headers["Nats-Service-Error-Code"] == code, label
        assert headers["Nats-Service-Error"], label
        assert error.message, label

    await nc.flush()
    await asyncio.sleep(0.2)
    assert task_events.pending_msgs == 0
    assert (await js.stream_info(TASKS_STREAM)).state.messages == 0


async def test_an_unknown_model_error_names_the_model_and_what_is_served(
    nats_server: NatsServer, nc: Client, ollama: FakeOllama, runner: ServiceRunner
) -> None:
    runner.router(nats_server.url)
    runner.worker(nats_server.url, ollama.url, "cpu-1")
    await workers_live(nc, 1)

    reply, _ = await ask(nc, model="llama-9000")

    message = error_of(reply).error.message
    assert "'llama-9000'" in message
    assert MODEL in message


async def test_backend_answering_500_ends_the_task_failed_with_the_reason(
    nats_server: NatsServer, nc: Client, ollama: FakeOllama, runner: ServiceRunner
) -> None:
    runner.router(nats_server.url)
    runner.worker(nats_server.url, ollama.url, "cpu-1")
    await workers_live(nc, 1)
    ollama.fail_status = 500

    body, _ = await ask(nc)

    assert body["status"] == "failed"
    assert body["failure"]["code"] == "backend_server_error"
    assert "500" in body["failure"]["message"]
    assert body["error"] == f"backend_server_error: {body['failure']['message']}"


async def test_backend_timing_out_ends_the_task_failed_with_the_reason(
    nats_server: NatsServer, nc: Client, ollama: FakeOllama, runner: ServiceRunner
) -> None:
    runner.router(nats_server.url)
    runner.worker(nats_server.url, ollama.url, "cpu-1")
    await workers_live(nc, 1)
    ollama.delay_s = 3.0

    body, _ = await ask(nc, timeout_s=0.5)

    assert body["status"] == "failed"
    assert body["failure"]["code"] == "backend_timeout"
    assert "0.5 s" in body["failure"]["message"]
    assert body["error"] == f"backend_timeout: {body['failure']['message']}"


async def test_a_slow_waiting_request_does_not_hold_up_others(
    nats_server: NatsServer, nc: Client, ollama: FakeOllama, runner: ServiceRunner
) -> None:
    runner.router(nats_server.url)
    runner.worker(nats_server.url, ollama.url, "cpu-1")
    await workers_live(nc, 1)
    ollama.delay_s = 2.0

    slow = asyncio.create_task(ask(nc))
    await asyncio.sleep(0.2)
    quick, _ = await ask(nc, wait=False)
    workers, _ = await request(nc, "coordinator.workers", {})

    assert quick["status"] == "queued"
    assert workers["workers"][0]["worker_id"] == "cpu-1"
    assert not slow.done()
    assert (await slow)[0]["status"] == "done"


async def test_a_worker_stopping_mid_task_finishes_it_first(
    nats_server: NatsServer, nc: Client, ollama: FakeOllama, runner: ServiceRunner
) -> None:
    runner.router(nats_server.url)
    worker = runner.worker(nats_server.url, ollama.url, "cpu-1")
    await workers_live(nc, 1)
    ollama.delay_s = 1.0
    started = await nc.subscribe("events.task.*.*.started")

    answer = asyncio.create_task(ask(nc))
    await started.next_msg(timeout=10)
    await runner.stop(worker)

    body, _ = await answer
    assert body["status"] == "done"
    assert worker.done()
    workers, _ = await request(nc, "coordinator.workers", {})
    assert workers["workers"] == []


@pytest.mark.parametrize("supports", ["gpu_inference", "cpu_inference"])
async def test_the_queue_follows_the_workers_tier(
    supports: str, nats_server: NatsServer, nc: Client, ollama: FakeOllama, runner: ServiceRunner
) -> None:
    runner.router(nats_server.url)
    runner.worker(nats_server.url, ollama.url, "box", worker_supports=[supports])
    await workers_live(nc, 1)

    body, _ = await ask(nc)

    tier = "gpu" if supports == "gpu_inference" else "cpu"
    assert body["queue"] == f"tasks.{tier}.box"
    assert body["status"] == "done"
