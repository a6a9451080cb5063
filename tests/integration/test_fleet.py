"""Fleet behaviour: leases, registration, dynamic tiers (real nats-server, Ollama stand-in)."""

from __future__ import annotations

import asyncio
import os
import signal
from typing import Any

import httpx
import msgspec
import pytest
from nats.aio.client import Client
from nats.js.errors import BucketNotFoundError, KeyNotFoundError, NoKeysError

from devtools.fakes.ollama import FakeOllama
from devtools.servers import NatsServer
from schemas.workers import WorkerRecord
from services.errors import ConfigError, LeaseLost
from tests.harness import (
    COORDINATOR,
    Processes,
    ServiceRunner,
    clean_env,
    eventually,
    request,
    workers_live,
)

MODEL = "qwen2.5:0.5b"


async def route(nc: Client, **fields: Any) -> dict[str, Any]:
    body, _ = await request(
        nc, "coordinator.route", {"prompt": "1+1", "model": MODEL, "wait": True, **fields}
    )
    return body


async def registered(nc: Client) -> dict[str, WorkerRecord] | None:
    """The registry once every entry lists its models (a starting worker holds its lease
    before its sanity runs, with none); None until then."""
    records = await registry(nc)
    return records if records and all(r.models for r in records.values()) else None


async def registry(nc: Client) -> dict[str, WorkerRecord]:
    """The ``workers`` bucket as it is now (empty before anyone created it)."""
    try:
        kv = await nc.jetstream().key_value("workers")
        keys = await kv.keys()
    except (BucketNotFoundError, NoKeysError):
        return {}
    records = {}
    for key in keys:
        try:
            entry = await kv.get(key)
        except KeyNotFoundError:
            continue  # it expired (or left) since the listing
        records[key] = msgspec.json.decode(entry.value or b"", type=WorkerRecord)
    return records


async def test_registration_carries_identity_capabilities_models_and_wake_address(
    nats_server: NatsServer, nc: Client, ollama: FakeOllama, runner: ServiceRunner
) -> None:
    runner.worker(
        nats_server.url,
        ollama.url,
        "mac",
        worker_supports=["gpu_inference", "cpu_inference"],
        worker_models=[MODEL],
        wol_mac="aa:bb:cc:dd:ee:ff",
    )
    records = await eventually(lambda: registered(nc))

    record = records["mac"]
    assert record.host == "host-mac"
    assert record.supports == ["gpu_inference", "cpu_inference"]
    assert record.models == [MODEL]
    assert record.wol_mac == "aa:bb:cc:dd:ee:ff"
    assert record.pid == os.getpid()
    assert record.instance_id and record.version


async def test_every_model_gets_a_sanity_run_and_start_fails_when_none_passes(
    nats_server: NatsServer, nc: Client, ollama: FakeOllama, runner: ServiceRunner
) -> None:
    ollama.fail_status = 500
    worker = runner.worker(nats_server.url, ollama.url, "cpu-1")

    with pytest.raises(ConfigError, match="no model passed its sanity run"):
        await asyncio.wait_for(worker, timeout=20)
    assert ollama.stats()["generate_calls"] == 2
    assert await registry(nc) == {}


async def test_a_worker_whose_lease_is_taken_over_stops_pulling_and_exits(
    nats_server: NatsServer, nc: Client, ollama: FakeOllama, runner: ServiceRunner
) -> None:
    worker = runner.worker(nats_server.url, ollama.url, "cpu-1")
    records = await eventually(lambda: registered(nc))
    kv = await nc.jetstream().key_value("workers")

    usurper = msgspec.structs.replace(records["cpu-1"], instance_id="other", host="elsewhere")
    await kv.put("cpu-1", msgspec.json.encode(usurper))

    with pytest.raises(LeaseLost, match="lease was taken over"):
        await asyncio.wait_for(worker, timeout=10)
    # It leaves the usurper's entry alone.
    assert (await registry(nc))["cpu-1"].host == "elsewhere"


async def test_a_killed_workers_lease_frees_itself_after_its_ttl(
    nats_server: NatsServer, nc: Client, ollama: FakeOllama, processes: Processes
) -> None:
    env = clean_env(
        NATS_URL=nats_server.url,
        OLLAMA_HOST=ollama.url,
        WORKER_ID="cpu-1",
        HEARTBEAT_INTERVAL_S="0.5",
        WORKER_TTL_S="2",
    )
    first = processes.start([COORDINATOR, "worker"], env)
    await eventually(lambda: registered(nc))
    first.send_signal(signal.SIGKILL)
    await asyncio.to_thread(first.wait)
    assert "cpu-1" in await registry(nc)  # nobody said goodbye

    async def freed() -> bool:
        # The key itself, not a listing: a listing came back without the first worker's entry
        # while it still held (1 run in 8), and the second worker was rightly refused.
        kv = await nc.jetstream().key_value("workers")
        try:
            await kv.get("cpu-1")
        except KeyNotFoundError:
            return True
        return False

    await eventually(freed, timeout_s=10)  # the bucket's TTL (WORKER_TTL_S) removed it
    second = processes.start([COORDINATOR, "worker"], env)

    async def taken_over() -> bool:
        if second.poll() is not None:  # it will never take over: say why it ended
            assert second.stderr is not None
            raise AssertionError(
                f"the second worker (pid {second.pid}; the first {first.pid}) exited: "
                f"{second.stderr.read()[-2000:]}"
            )
        records = await registry(nc)
        return "cpu-1" in records and records["cpu-1"].pid == second.pid

    await eventually(taken_over, timeout_s=15)
    assert second.poll() is None


async def test_the_same_model_moves_between_tiers_as_gpu_workers_come_and_go(
    nats_server: NatsServer, nc: Client, ollama: FakeOllama, runner: ServiceRunner
) -> None:
    runner.router(nats_server.url, gpu_models=[MODEL])
    runner.worker(nats_server.url, ollama.url, "cpu-1")
    await workers_live(nc, 1)
    assert (await route(nc))["queue"] == "tasks.cpu.cpu-1"

    gpu = runner.worker(nats_server.url, ollama.url, "gpu-1", worker_supports=["gpu_inference"])
    await workers_live(nc, 2)
    assert (await route(nc))["queue"] == "tasks.gpu.gpu-1"

    await runner.stop(gpu)
    reply = await eventually(lambda: route(nc), timeout_s=10)
    assert reply["queue"] == "tasks.cpu.cpu-1"
    assert reply["status"] == "done"


async def test_a_designated_worker_is_honoured_and_a_stopped_one_is_a_clear_error(
    nats_server: NatsServer, nc: Client, ollama: FakeOllama, runner: ServiceRunner
) -> None:
    runner.router(nats_server.url)
    runner.worker(nats_server.url, ollama.url, "cpu-1")
    gpu = runner.worker(nats_server.url, ollama.url, "gpu-1", worker_supports=["gpu_inference"])
    await workers_live(nc, 2)
    assert (await route(nc, worker="cpu-1"))["worker"] == "cpu-1"

    await runner.stop(gpu)
    body, headers = await request(
        nc, "coordinator.route", {"prompt": "x", "model": MODEL, "worker": "gpu-1"}
    )
    assert headers["Nats-Service-Error-Code"] == "worker_unavailable"
    assert "'gpu-1' is not live" in body["error"]["message"]


async def listed(nc: Client) -> dict[str, dict[str, Any]]:
    """``coordinator.workers`` by worker id."""
    body, _ = await request(nc, "coordinator.workers", {})
    return {w["worker_id"]: w for w in body["workers"]}


async def test_a_workers_models_in_memory_follow_its_backends_ps(
    nats_server: NatsServer, nc: Client, runner: ServiceRunner
) -> None:
    with FakeOllama(models=[MODEL, "gemma3:1b"]) as backend:
        runner.router(nats_server.url)
        # No sanity run loads anything; the model list is probed twice a second while idle.
        runner.worker(
            nats_server.url,
            backend.url,
            "cpu-1",
            sanity_check=False,
            health_interval_s=0.5,
            health_idle_probe_s=0,
        )
        await workers_live(nc, 1)

        async def resident(expected: list[str]) -> bool:
            record = (await registry(nc)).get("cpu-1")
            shown = (await listed(nc)).get("cpu-1", {})
            return record is not None and record.resident == shown.get("resident") == expected

        await eventually(lambda: resident([]))  # nothing loaded yet, and the worker says so
        before = (await registry(nc))["cpu-1"]
        assert (before.model_memory, before.memory_bytes, before.max_resident) == ({}, None, None)

        assert (await route(nc))["status"] == "done"
        await eventually(lambda: resident([MODEL]))  # the task loaded it
        [loaded] = backend_ps(backend)
        assert loaded["name"] == MODEL
        # What it takes loaded (/api/ps: more than its file), and the most seen at once.
        record = (await registry(nc))["cpu-1"]
        assert loaded["size"] > file_size(backend, MODEL)
        assert record.model_memory == {MODEL: loaded["size"]}
        assert (record.memory_bytes, record.max_resident) == (loaded["size"], 1)
        shown = (await listed(nc))["cpu-1"]
        assert (shown["memory_bytes"], shown["max_resident"]) == (loaded["size"], 1)

        # Unloaded behind the worker's back: its next probe between tasks sees it.
        unload = {"model": MODEL, "keep_alive": 0}
        async with httpx.AsyncClient(base_url=backend.url) as client:
            assert (await client.post("/api/generate", json=unload)).status_code == 200
        await eventually(lambda: resident([]), timeout_s=10)
        # Nothing in memory now; what was seen stays.
        assert (await registry(nc))["cpu-1"].memory_bytes == loaded["size"]


async def test_a_workers_memory_limit_is_the_operators_when_given(
    nats_server: NatsServer, nc: Client, runner: ServiceRunner
) -> None:
    with FakeOllama(models=[MODEL, "gemma3:1b"]) as backend:
        # The sanity runs load both models; each worker reads /api/ps after each.
        runner.worker(nats_server.url, backend.url, "mac", worker_memory_gb=16.0)
        runner.worker(nats_server.url, backend.url, "pc")

        async def both() -> dict[str, WorkerRecord] | None:
            records = await registered(nc)
            return records if records is not None and len(records) == 2 else None

        records = await eventually(both)
        sizes = {m["name"]: m["size"] for m in backend_ps(backend)}
        assert set(sizes) == {MODEL, "gemma3:1b"}
        assert records["mac"].memory_bytes == 16_000_000_000
        assert records["pc"].memory_bytes == sum(sizes.values())  # the most seen at once
        for record in records.values():
            assert (record.model_memory, record.max_resident) == (sizes, 2)


def backend_ps(backend: FakeOllama) -> list[dict[str, Any]]:
    models: list[dict[str, Any]] = httpx.get(f"{backend.url}/api/ps").json()["models"]
    return models


def file_size(backend: FakeOllama, model: str) -> int:
    """What ``/api/tags`` says ``model``'s file takes."""
    tags = httpx.get(f"{backend.url}/api/tags").json()["models"]
    return int(next(t["size"] for t in tags if t["name"] == model))


async def test_an_openai_compatible_worker_says_nothing_of_what_is_in_memory(
    nats_server: NatsServer, nc: Client, ollama: FakeOllama, runner: ServiceRunner
) -> None:
    runner.router(nats_server.url)
    runner.worker(
        nats_server.url,
        ollama.url,
        "llama",
        worker_backend="openai",
        openai_base_url=f"{ollama.url}/v1",
        worker_models=[MODEL],
    )
    await workers_live(nc, 1)
    record = (await eventually(lambda: registered(nc)))["llama"]
    assert (record.models, record.resident) == ([MODEL], None)
    assert "resident" not in (await listed(nc))["llama"]  # left out, as every unset field


async def test_a_task_goes_to_the_worker_that_holds_its_model_in_memory(
    nats_server: NatsServer, nc: Client, runner: ServiceRunner
) -> None:
    with FakeOllama(models=[MODEL]) as backend_a, FakeOllama(models=[MODEL]) as backend_b:
        runner.router(nats_server.url)
        for worker_id, backend in (("a", backend_a), ("b", backend_b)):
            runner.worker(nats_server.url, backend.url, worker_id, sanity_check=False)
        await workers_live(nc, 2)
        assert (await route(nc, worker="b"))["worker"] == "b"  # loads the model on b only

        async def loaded_on_b() -> bool:
            shown = await listed(nc)
            return shown["a"].get("resident") == [] and shown["b"].get("resident") == [MODEL]

        await eventually(loaded_on_b)
        # Both idle: a would need a cold load, b would not (by the smallest id, a would win).
        reply = await route(nc)
        assert (reply["status"], reply["worker"]) == ("done", "b")
        assert backend_a.stats()["generate_calls"] == 0
