"""Sleeping machines: idle shutdown on the worker, Wake-on-LAN from the router."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import msgspec
import pytest
from nats.aio.client import Client
from nats.js.errors import KeyNotFoundError

from devtools.fakes.ollama import FakeOllama
from devtools.servers import NatsServer
from schemas.subjects import TASKS_STREAM
from tests.harness import ServiceRunner, eventually, request

MODEL = "qwen2.5:0.5b"
MAC = "aa:bb:cc:dd:ee:ff"


def sleepy(tmp_path: Path) -> dict[str, object]:
    return {
        "worker_supports": ["gpu_inference"],
        "wol_mac": MAC,
        "idle_shutdown_sec": 0.5,
        "idle_check_interval_sec": 0.2,
        "shutdown_command": f"touch {tmp_path / 'powered-off'}",
    }


async def sleeps(nc: Client, worker_id: str) -> bool:
    try:
        kv = await nc.jetstream().key_value("asleep")
        entry = await kv.get(worker_id)
    except Exception:
        return False
    return bool(entry.value)


async def test_an_idle_worker_deregisters_records_how_to_wake_it_and_shuts_down(
    nats_server: NatsServer, nc: Client, ollama: FakeOllama, runner: ServiceRunner, tmp_path: Path
) -> None:
    worker = runner.worker(nats_server.url, ollama.url, "pc", **sleepy(tmp_path))
    asleep_events = await nc.subscribe("events.worker.pc.asleep")

    await asyncio.wait_for(worker, timeout=15)

    assert (tmp_path / "powered-off").exists()
    event = msgspec.json.decode((await asleep_events.next_msg(timeout=5)).data)
    assert event["wol_mac"] == MAC
    assert MODEL in event["models"]
    assert await sleeps(nc, "pc")
    workers = await nc.jetstream().key_value("workers")
    with pytest.raises(KeyNotFoundError):
        await workers.get("pc")


async def test_a_task_for_a_sleeping_worker_wakes_it_and_runs_when_it_is_back(
    nats_server: NatsServer,
    nc: Client,
    ollama: FakeOllama,
    runner: ServiceRunner,
    tmp_path: Path,
    wol_listener: socket.socket,
) -> None:
    port = wol_listener.getsockname()[1]
    runner.router(nats_server.url, wol_broadcast="127.0.0.1", wol_port=port, wake_wait_s=30.0)
    await asyncio.wait_for(
        runner.worker(nats_server.url, ollama.url, "pc", **sleepy(tmp_path)), timeout=15
    )
    await eventually(lambda: sleeps(nc, "pc"))
    wakes = await nc.subscribe("events.worker.pc.wake_requested")

    answer = asyncio.create_task(
        request(nc, "coordinator.route", {"prompt": "1+1", "model": MODEL, "wait": True}, 60)
    )
    packet, _ = await asyncio.to_thread(wol_listener.recvfrom, 200)
    assert packet == b"\xff" * 6 + bytes.fromhex("aabbccddeeff") * 16
    wake = msgspec.json.decode((await wakes.next_msg(timeout=5)).data)
    assert wake["mac"] == MAC

    # The machine boots and its worker starts again: it finds the task waiting in its queue.
    runner.worker(nats_server.url, ollama.url, "pc", worker_supports=["gpu_inference"])
    body, _ = await answer
    assert body["status"] == "done"
    assert body["queue"] == "tasks.gpu.pc"
    assert not await sleeps(nc, "pc")


async def test_a_worker_that_does_not_wake_in_time_fails_the_task_and_leaves_no_copy(
    nats_server: NatsServer,
    nc: Client,
    ollama: FakeOllama,
    runner: ServiceRunner,
    tmp_path: Path,
    wol_listener: socket.socket,
) -> None:
    port = wol_listener.getsockname()[1]
    runner.router(nats_server.url, wol_broadcast="127.0.0.1", wol_port=port, wake_wait_s=1.0)
    await asyncio.wait_for(
        runner.worker(nats_server.url, ollama.url, "pc", **sleepy(tmp_path)), timeout=15
    )
    await eventually(lambda: sleeps(nc, "pc"))

    body, _ = await request(
        nc, "coordinator.route", {"prompt": "1+1", "model": MODEL, "wait": True}, 30
    )

    assert body["status"] == "failed"
    assert body["failure"]["code"] == "wake_timeout"
    assert "'pc' was woken but did not start the task within 1 s" in body["failure"]["message"]
    assert body["error"] == f"wake_timeout: {body['failure']['message']}"
    assert (await nc.jetstream().stream_info(TASKS_STREAM)).state.messages == 0


async def test_without_idle_settings_a_worker_never_sleeps(
    nats_server: NatsServer, nc: Client, ollama: FakeOllama, runner: ServiceRunner
) -> None:
    worker = runner.worker(nats_server.url, ollama.url, "box")
    await workers_live_direct(nc)
    await asyncio.sleep(1.5)
    assert not worker.done()
    assert not await sleeps(nc, "box")


async def workers_live_direct(nc: Client) -> None:
    async def registered() -> bool:
        try:
            kv = await nc.jetstream().key_value("workers")
            # Listing its models: past its sanity runs, not only holding its lease.
            entry = await kv.get("box")
            return bool(msgspec.json.decode(entry.value or b"{}").get("models"))
        except Exception:
            return False

    await eventually(registered)
