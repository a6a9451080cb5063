"""The services ride out a nats-server restart: reconnect, rebind, keep routing."""

from __future__ import annotations

import asyncio

import nats
from structlog.testing import capture_logs

from devtools.fakes.ollama import FakeOllama
from devtools.servers import NatsServer
from tests.harness import ServiceRunner, eventually, request, workers_live

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
