"""Services killed with SIGKILL and started again resume from durable state (the event log, the
durable consumers, the buckets); and the reaper rides out a nats-server restart without taking
the missing heartbeats of the outage for dead workers."""

from __future__ import annotations

import asyncio
import signal
import subprocess
from typing import Any

import asyncpg
from nats.aio.client import Client
from structlog.testing import capture_logs

from devtools.fakes.ollama import FakeOllama
from devtools.servers import NatsServer
from schemas.events import TaskCompleted
from tests.harness import (
    COORDINATOR,
    Processes,
    ServiceRunner,
    clean_env,
    eventually,
    logged,
    request,
    workers_live,
)
from tests.reaper_harness import MODEL, TaskEvents


async def route(nc: Client, **fields: Any) -> dict[str, Any]:
    body, _ = await request(nc, "coordinator.route", {"prompt": "1+1", "model": MODEL, **fields})
    return body


def kill(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)


async def test_a_reaper_killed_and_started_again_reads_back_what_is_under_way_and_acts(
    nats_server: NatsServer,
    nc: Client,
    ollama: FakeOllama,
    runner: ServiceRunner,
    processes: Processes,
) -> None:
    runner.router(nats_server.url)
    runner.worker(nats_server.url, ollama.url, "cpu-b")
    reaper_env = clean_env(NATS_URL=nats_server.url, REAPER_INTERVAL_S="0.2", WORKER_TTL_S="3")
    with FakeOllama() as slow:
        worker_a = processes.start(
            [COORDINATOR, "worker"],
            clean_env(
                NATS_URL=nats_server.url,
                OLLAMA_HOST=slow.url,
                WORKER_ID="cpu-a",
                HEARTBEAT_INTERVAL_S="0.5",
                WORKER_TTL_S="3",
            ),
        )
        await workers_live(nc, 2)
        first = processes.start([COORDINATOR, "reaper"], reaper_env)
        await logged(first, "reaper ready")
        kill(first)
        slow.delay_s = 30.0
        async with TaskEvents(nc) as events:
            task_id = (await route(nc))["task_id"]  # to cpu-a: same depth, first by name
            started = await events.first("started", task_id)
            assert started.worker == "cpu-a"  # type: ignore[union-attr]
            kill(worker_a)  # while no reaper runs

            second = processes.start([COORDINATOR, "reaper"], reaper_env)
            await logged(second, "reaper ready")
            done = await events.first("completed", task_id)

    assert isinstance(done, TaskCompleted)
    assert (done.worker, done.attempt) == ("cpu-b", 2)


async def test_a_router_killed_and_started_again_serves_from_the_registry_at_once(
    nats_server: NatsServer,
    nc: Client,
    ollama: FakeOllama,
    runner: ServiceRunner,
    processes: Processes,
) -> None:
    env = clean_env(NATS_URL=nats_server.url, WORKER_TTL_S="3")
    router = processes.start([COORDINATOR, "router"], env)
    runner.worker(nats_server.url, ollama.url, "cpu-1")
    await workers_live(nc, 1)
    ollama.delay_s = 0.3
    async with TaskEvents(nc) as events:
        ids = [(await route(nc, prompt=f"{i}+1"))["task_id"] for i in range(3)]
        kill(router)
        # What it queued runs without it.
        for task_id in ids:
            await events.first("completed", task_id)

    again = processes.start([COORDINATOR, "router"], env)
    await logged(again, "router ready")
    body, _ = await request(nc, "coordinator.workers", {})
    assert [w["worker_id"] for w in body["workers"]] == ["cpu-1"]
    reply = await route(nc, wait=True)
    assert (reply["status"], reply["response"]) == ("done", "2")


async def test_stats_killed_and_started_again_projects_every_event_once(
    nats_server: NatsServer,
    nc: Client,
    ollama: FakeOllama,
    runner: ServiceRunner,
    processes: Processes,
    pg_dsn: str,
) -> None:
    env = clean_env(NATS_URL=nats_server.url, PG_DSN=pg_dsn)
    stats = processes.start([COORDINATOR, "stats", "serve"], env)
    runner.router(nats_server.url)
    runner.worker(nats_server.url, ollama.url, "cpu-1")
    await workers_live(nc, 1)

    async def done(task_id: str) -> bool:
        try:
            body, _ = await request(nc, "coordinator.task", {"task_id": task_id}, timeout_s=2)
        except Exception:
            return False
        return body.get("status") == "done"

    before = (await route(nc, wait=True))["task_id"]
    await eventually(lambda: done(before), timeout_s=15)
    kill(stats)
    during = [(await route(nc, wait=True, prompt=f"{i}*3"))["task_id"] for i in range(2)]
    processes.start([COORDINATOR, "stats", "serve"], env)

    for task_id in [before, *during]:
        await eventually(lambda t=task_id: done(t), timeout_s=20)  # type: ignore[misc]
    conn = await asyncpg.connect(pg_dsn)
    try:
        outcomes = await conn.fetchval("SELECT count(*) FROM outcomes")
        tasks = await conn.fetchval("SELECT count(*) FROM tasks")
    finally:
        await conn.close()
    assert (tasks, outcomes) == (3, 3)


async def test_the_reaper_takes_a_nats_server_restart_for_no_dead_worker(
    nats_server: NatsServer, ollama: FakeOllama, runner: ServiceRunner
) -> None:
    with capture_logs() as logs:
        runner.router(nats_server.url)
        runner.reaper(nats_server.url)
        runner.worker(nats_server.url, ollama.url, "cpu-1")
        nc = await _client(nats_server)
        try:
            await workers_live(nc, 1)
            ollama.delay_s = 5.0
            async with TaskEvents(nc) as events:
                running = (await route(nc))["task_id"]
                await events.first("started", running)

                nats_server.stop()
                await asyncio.sleep(4.0)  # longer than WORKER_TTL_S: every entry expires meanwhile
                nats_server.start()

                # The task ran on through the outage and ended where it was.
                done = await events.first("completed", running, timeout_s=20)
                assert isinstance(done, TaskCompleted)
                assert (done.worker, done.attempt) == ("cpu-1", 1)
            ollama.delay_s = 0.0

            async def answered() -> dict[str, Any] | None:
                try:
                    body, _ = await request(
                        nc, "coordinator.route", {"prompt": "2+2", "model": MODEL, "wait": True}, 10
                    )
                except Exception:
                    return None
                return body if body.get("status") == "done" else None

            after = await eventually(answered, timeout_s=30, interval_s=0.5)
            assert (after["worker"], after["response"]) == ("cpu-1", "4")
            await asyncio.sleep(1.0)  # a look or five after the worker's entry came back
        finally:
            await nc.close()
    lines = [entry["event"] for entry in logs]
    assert "lease entry had expired (bus outage?); taken again" in lines
    # The worker stopped its task when it could not store its heartbeats, held it, and ran
    # it again once back, naming it in its heartbeats meanwhile: nothing moved or failed.
    assert "running again the task stopped while out of touch" in lines
    assert "task moved" not in lines
    assert "task failed by the reaper" not in lines


async def _client(nats_server: NatsServer) -> Client:
    import nats

    return await nats.connect(nats_server.url, max_reconnect_attempts=-1, reconnect_time_wait=0.2)
