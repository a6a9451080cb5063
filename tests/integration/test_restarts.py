"""The services ride out a nats-server restart: reconnect, rebind, keep routing."""

from __future__ import annotations

import asyncio

import msgspec
import nats
from structlog.testing import capture_logs

from devtools.fakes.ollama import FakeOllama
from devtools.servers import NatsServer
from tests.harness import ServiceRunner, eventually, last_task_event, request, workers_live

MODEL = "qwen2.5:0.5b"


async def test_router_and_worker_keep_working_across_a_nats_server_restart(
    nats_server: NatsServer, ollama: FakeOllama, runner: ServiceRunner
) -> None:
    with capture_logs() as logs:
        runner.router(nats_server.url)
        runner.worker(nats_server.url, ollama.url, "cpu-1")
        nc = await nats.connect(nats_server.url, max_reconnect_attempts=-1, reconnect_time_wait=0.2)
        try:
            await workers_live(nc, 1)
            before, _ = await request(
                nc, "coordinator.route", {"prompt": "1+1", "model": MODEL, "wait": True}
            )
            assert before["status"] == "done"

            nats_server.stop()
            await asyncio.sleep(1.0)
            nats_server.start()

            async def answered() -> dict[str, object] | None:
                try:
                    body, _ = await request(
                        nc, "coordinator.route", {"prompt": "2+2", "model": MODEL, "wait": True}, 10
                    )
                except Exception:
                    return None
                return body if body.get("status") == "done" else None

            after = await eventually(answered, timeout_s=30, interval_s=0.5)
            assert after["response"] == "4"
        finally:
            await nc.close()
    events = [entry["event"] for entry in logs]
    assert "nats disconnected" in events
    assert "nats reconnected" in events


async def test_a_generation_finished_while_the_bus_was_away_is_kept_not_run_again(
    nats_server: NatsServer, ollama: FakeOllama, runner: ServiceRunner
) -> None:
    """The server goes away mid-generation and stays away past the point where the worker,
    out of touch, stops what runs: the generation had finished by then, so its outcome is
    stored once the server is back, and the task is not run a second time."""
    prompt = " ".join(f"word{i}" for i in range(8))
    runner.router(nats_server.url)
    runner.worker(nats_server.url, ollama.url, "cpu-1")
    nc = await nats.connect(nats_server.url, max_reconnect_attempts=-1, reconnect_time_wait=0.2)
    try:
        await workers_live(nc, 1)
        ollama.configure(chunk_delay_s=0.1)  # a generation of about a second
        with capture_logs() as logs:
            reply, _ = await request(nc, "coordinator.route", {"prompt": prompt, "model": MODEL})
            task_id = reply["task_id"]

            def generating() -> bool:
                return any(c["prompt"] == prompt and c["ended_at"] is None for c in ollama.calls())

            await eventually(lambda: asyncio.to_thread(generating), timeout_s=15)
            nats_server.stop()
            # Away until the worker has noticed it is out of touch (a TTL less a heartbeat
            # interval without a stored heartbeat), by when the generation has long finished.
            await eventually(
                lambda: asyncio.to_thread(
                    lambda: any(e["event"].startswith("no heartbeat stored for") for e in logs)
                ),
                timeout_s=20,
            )
            nats_server.start()

            async def completed() -> dict[str, object] | None:
                try:
                    event = await last_task_event(nc.jetstream(), task_id, "completed")
                except Exception:
                    return None
                body: dict[str, object] = msgspec.json.decode(event.data or b"")
                return body

            done = await eventually(completed, timeout_s=30, interval_s=0.2)
    finally:
        await nc.close()
    assert done["attempt"] == 1 and done["worker"] == "cpu-1", done
    # Its outcome waited for the server, past the moment the worker knew it was out of touch,
    # and was stored from the one generation.
    events = [e["event"] for e in logs]
    adrift = next(i for i, e in enumerate(events) if e.startswith("no heartbeat stored for"))
    assert "task done" in events[adrift:], events
    assert [c["prompt"] for c in ollama.calls()].count(prompt) == 1
    assert not any(e["event"] == "running again the task stopped while out of touch" for e in logs)
