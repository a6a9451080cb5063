"""Backend health as a fact (lesson 13), end to end: each worker probes its own backend and
says ``healthy`` or ``degraded`` in its heartbeat; the router, the reaper, ``coordinator
workers`` and the doctor believe it. Real nats-server, Ollama stand-ins over real sockets."""

from __future__ import annotations

import asyncio
import functools
import time
from typing import Any

from nats.aio.client import Client

from devtools.fakes.ollama import FakeOllama
from devtools.servers import NatsServer
from services.cli.doctor import run_doctor
from tests.harness import (
    ServiceRunner,
    clean_env,
    eventually,
    last_task_event,
    request,
    run_cli,
    workers_live,
)

MODEL = "qwen2.5:0.5b"
# Probes every 0.3 s while idle; a generation gets 1 s for its first token.
PROBING: dict[str, Any] = {
    "health_interval_s": 0.3,
    "first_token_timeout_s": 1.0,
    "progress_timeout_s": 1.0,
}


async def workers(nc: Client) -> dict[str, dict[str, Any]]:
    body, _ = await request(nc, "coordinator.workers", {}, timeout_s=5.0)
    return {w["worker_id"]: w for w in body["workers"]}


async def health_of(nc: Client, worker_id: str) -> str | None:
    record = (await workers(nc)).get(worker_id)
    # A healthy worker's ``health`` is the default, so the reply leaves it out.
    return None if record is None else str(record.get("health", "healthy"))


async def ask(nc: Client, **fields: Any) -> tuple[dict[str, Any], dict[str, str]]:
    body = {"prompt": "1+1は？", "model": MODEL, "wait": True, **fields}
    return await request(nc, "coordinator.route", body, timeout_s=30.0)


async def test_a_worker_whose_backend_goes_down_is_degraded_routed_around_and_heals(
    nats_server: NatsServer, nc: Client, runner: ServiceRunner
) -> None:
    with FakeOllama() as down, FakeOllama() as up:
        runner.router(nats_server.url)
        runner.worker(nats_server.url, down.url, "cpu-1", **PROBING)
        runner.worker(nats_server.url, up.url, "cpu-2", **PROBING)
        await workers_live(nc, 2)
        assert await health_of(nc, "cpu-1") == "healthy"

        down.stop()
        stopped_at = time.monotonic()
        await eventually(lambda: _is(nc, "cpu-1", "degraded"), timeout_s=5)
        assert time.monotonic() - stopped_at < 3.0  # within the probe interval (and a beat)
        seen = (await workers(nc))["cpu-1"]
        assert "cannot be reached" in seen["health_reason"]
        assert seen["health_reason"].startswith("backend_unavailable: ")

        # Named, it is a clear error with the reason; by model, the healthy worker answers.
        body, headers = await ask(nc, worker="cpu-1")
        assert headers["Nats-Service-Error-Code"] == "worker_unavailable"
        assert body["error"]["message"].startswith("worker 'cpu-1' is degraded: ")
        assert "cannot be reached" in body["error"]["message"]
        for _ in range(3):
            body, _ = await ask(nc)
            assert (body["status"], body["worker"]) == ("done", "cpu-2")

        listing = await asyncio.to_thread(
            run_cli, "workers", env=clean_env(NATS_URL=nats_server.url), timeout=30
        )
        assert listing.returncode == 0, listing.stderr
        assert "HEALTH" in listing.stdout.splitlines()[0]
        row = next(line for line in listing.stdout.splitlines() if line.startswith("cpu-1 "))
        assert " degraded " in row
        assert "  ! degraded for " in listing.stdout and "cannot be reached" in listing.stdout

        doctor = {c.name: c for c in await run_doctor(nats_server.url)}
        assert doctor["worker backends"].status == "problem"
        assert doctor["worker backends"].detail.startswith(
            f"cpu-1 (ollama at {down.url}): degraded for "
        )

        down.start()  # the same port again
        await eventually(lambda: _is(nc, "cpu-1", "healthy"), timeout_s=5)
        assert "health_reason" not in (await workers(nc))["cpu-1"]
        body, _ = await ask(nc, worker="cpu-1")
        assert (body["status"], body["response"]) == ("done", "2")


async def test_a_backend_that_answers_500_on_generations_is_degraded_by_the_idle_probe(
    nats_server: NatsServer, nc: Client, ollama: FakeOllama, runner: ServiceRunner
) -> None:
    """Its model list answers (as a hung or broken server's often does); the generation
    probe, after being idle for `HEALTH_IDLE_PROBE_S`, is what tells."""
    runner.router(nats_server.url)
    runner.worker(nats_server.url, ollama.url, "cpu-1", health_idle_probe_s=0.5, **PROBING)
    await workers_live(nc, 1)
    ollama.fail_status = 500

    await eventually(lambda: _is(nc, "cpu-1", "degraded"), timeout_s=5)
    reason = (await workers(nc))["cpu-1"]["health_reason"]
    assert (
        reason.startswith("probe of ")
        and "backend_server_error: Ollama answered HTTP 500" in reason
    )
    body, headers = await ask(nc)
    assert headers["Nats-Service-Error-Code"] == "no_worker"
    assert body["error"]["message"].startswith(f"no healthy worker serves model '{MODEL}': ")

    ollama.fail_status = None
    await eventually(lambda: _is(nc, "cpu-1", "healthy"), timeout_s=5)
    body, _ = await ask(nc)
    assert body["status"] == "done"


async def test_a_hung_backend_fails_the_task_within_the_first_token_timeout(
    nats_server: NatsServer, nc: Client, ollama: FakeOllama, runner: ServiceRunner
) -> None:
    runner.router(nats_server.url)
    runner.worker(nats_server.url, ollama.url, "cpu-1", **PROBING)
    await workers_live(nc, 1)
    ollama.delay_s = 60.0  # accepts the request, never sends a first token

    started = time.monotonic()
    body, _ = await ask(nc, timeout_s=60)
    took = time.monotonic() - started

    assert body["status"] == "failed"
    assert body["failure"]["code"] == "backend_timeout"
    assert body["failure"]["message"] == (f"no first token from {MODEL} on {ollama.url} within 1 s")
    assert took < 5.0  # the first-token timeout (1 s), not the task's (60 s)
    await eventually(lambda: _is(nc, "cpu-1", "degraded"), timeout_s=3)
    reason = (await workers(nc))["cpu-1"]["health_reason"]
    assert reason.startswith("backend_timeout: no first token from")
    # Its connection was closed, so the stand-in stopped working on it.
    assert ollama.stats()["cancelled"] >= 1

    ollama.delay_s = 0.0
    await eventually(lambda: _is(nc, "cpu-1", "healthy"), timeout_s=5)


async def test_the_reaper_moves_what_waits_on_a_degraded_workers_queue(
    nats_server: NatsServer, nc: Client, runner: ServiceRunner
) -> None:
    """Two tasks go to the GPU worker (preferred even when busy); its backend hangs on the
    first: that one fails (retryable) and is moved, the one queued behind it is moved
    because the worker is degraded; both end on the CPU worker."""
    with FakeOllama() as hung, FakeOllama() as fine:
        runner.router(nats_server.url)
        runner.reaper(nats_server.url)
        runner.worker(
            nats_server.url, hung.url, "gpu-1", worker_supports=["gpu_inference"], **PROBING
        )
        runner.worker(nats_server.url, fine.url, "cpu-2", **PROBING)
        await workers_live(nc, 2)
        hung.delay_s = 60.0

        first, _ = await ask(nc, wait=False, prompt="first")
        second, _ = await ask(nc, wait=False, prompt="second")
        assert (first["worker"], second["worker"]) == ("gpu-1", "gpu-1")

        js = nc.jetstream()

        async def completed(task_id: str) -> str | None:
            try:
                msg = await last_task_event(js, task_id, "completed")
            except Exception:
                return None
            return str(msg.subject)

        for task_id in (first["task_id"], second["task_id"]):
            subject = await eventually(functools.partial(completed, task_id), timeout_s=15)
            assert subject.endswith(".cpu-2.completed")
        routed = (await last_task_event(js, second["task_id"], "routed")).data or b""
        assert b"degraded_worker" in routed
        assert b"worker 'gpu-1' is degraded: backend_timeout: no first token" in routed


async def _is(nc: Client, worker_id: str, health: str) -> bool:
    return await health_of(nc, worker_id) == health
