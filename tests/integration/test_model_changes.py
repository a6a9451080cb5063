"""A change to chosen machines' models from one place (``coordinator pull``, ``create``,
``copy``, ``rm``), carried out by each machine's worker through its Ollama's own API: the
progress streams back, the change is recorded per machine, and the registry (so routing)
follows at once. A real nats-server, the router and the workers in-process, each worker on an
Ollama stand-in that answers the model APIs as Ollama does (devtools/fakes/ollama.py)."""

from __future__ import annotations

import asyncio
import re
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
from nats.aio.client import Client

from devtools.fakes.ollama import FakeOllama
from devtools.servers import NatsServer
from schemas.events import ModelChanged, TaskCompleted, TaskStarted, any_event_decoder
from schemas.subjects import ROUTE, task_event
from services.runtime.request import new_task_id
from tests.harness import (
    ServiceRunner,
    clean_env,
    error_of,
    eventually,
    request,
    run_cli,
    workers_live,
)
from tests.integration.test_sleep_wake import sleeps, sleepy

SERVED = "qwen2.5:0.5b"
PULLED = "llama3.2:1b"


@pytest.fixture
async def two_machines(
    nats_server: NatsServer, nc: Client, runner: ServiceRunner
) -> AsyncIterator[tuple[FakeOllama, FakeOllama]]:
    with (
        FakeOllama(models=[SERVED]) as first,
        FakeOllama(models=[SERVED]) as second,
    ):
        first.pull_chunk_delay_s = 0.01
        runner.router(nats_server.url)
        runner.worker(nats_server.url, first.url, "cpu-1")
        runner.worker(nats_server.url, second.url, "cpu-2")
        await workers_live(nc, 2)
        yield first, second


def cli(nats_server: NatsServer, tmp_path: Path, *args: str) -> Any:
    env = clean_env(NATS_URL=nats_server.url, COORDINATOR_HOME=str(tmp_path))
    return asyncio.to_thread(run_cli, *args, env=env, timeout=120)


async def models_of(nc: Client, worker: str) -> list[str]:
    body, _ = await request(nc, "coordinator.workers", {})
    return next(w["models"] for w in body["workers"] if w["worker_id"] == worker)


async def changes(nc: Client, worker: str) -> list[ModelChanged]:
    js = nc.jetstream()
    found: list[ModelChanged] = []
    sub = await js.subscribe(f"events.worker.{worker}.model_changed", ordered_consumer=True)
    try:
        while True:
            try:
                msg = await sub.next_msg(timeout=0.5)
            except TimeoutError:
                return found
            event = any_event_decoder.decode(msg.data)
            assert isinstance(event, ModelChanged)
            found.append(event)
    finally:
        await sub.unsubscribe()


async def test_a_pull_onto_a_chosen_machine_streams_its_progress_and_routing_follows_at_once(
    nats_server: NatsServer,
    nc: Client,
    two_machines: tuple[FakeOllama, FakeOllama],
    tmp_path: Path,
) -> None:
    first, second = two_machines
    assert PULLED not in await models_of(nc, "cpu-1")

    pulled = await cli(nats_server, tmp_path, "pull", PULLED, "--on", "cpu-1")

    assert pulled.returncode == 0, pulled.stderr
    lines = pulled.stdout.splitlines()
    shares: dict[str, list[int]] = {}
    for line in lines:
        if m := re.fullmatch(r"cpu-1: pulling (\w{12}): (\d+)% \(.* GB\)", line):
            shares.setdefault(m.group(1), []).append(int(m.group(2)))
    assert shares, lines
    for each in shares.values():  # each layer's bytes, up to all of them, each share once
        assert each == sorted(set(each)) and each[-1] == 100, lines
    assert any(line.startswith("cpu-1: pulling manifest") for line in lines), lines
    assert lines[-1].startswith(f"cpu-1: {PULLED} on cpu-1: pull done, digest "), lines
    # Announced before the answer: routing has it at once, on that machine only.
    assert PULLED in await models_of(nc, "cpu-1")
    assert PULLED not in await models_of(nc, "cpu-2")
    listed = (await asyncio.to_thread(httpx.get, f"{first.url}/api/tags")).json()
    tags = {m["name"]: m["digest"] for m in listed["models"]}
    [change] = await changes(nc, "cpu-1")
    assert (change.op, change.model, change.digest) == ("pull", PULLED, tags[PULLED])
    assert lines[-1].endswith(tags[PULLED])
    reply, headers = await request(
        nc, ROUTE, {"prompt": "1+1", "model": PULLED, "wait": True}, timeout_s=30
    )
    assert "Nats-Service-Error-Code" not in headers, reply
    assert (reply["status"], reply["worker"], reply["response"]) == ("done", "cpu-1", "2")
    assert all(call["api"] != "pull" for call in second.calls())


async def test_a_pull_the_registry_cannot_serve_or_the_disk_cannot_hold_fails_on_its_machine(
    nats_server: NatsServer,
    nc: Client,
    two_machines: tuple[FakeOllama, FakeOllama],
    tmp_path: Path,
) -> None:
    _, second = two_machines
    second.disk_free_bytes = 1_000_000

    missing = await cli(nats_server, tmp_path, "pull", "no-such-model:1b", "--on", "cpu-1")
    full = await cli(nats_server, tmp_path, "pull", PULLED, "--on", "cpu-1", "cpu-2")

    assert missing.returncode == 1
    assert "cpu-1: failed: backend_error:" in missing.stderr
    assert "pull model manifest: file does not exist" in missing.stderr
    # One machine took it, the other's disk filled part way: said, and the exit status is 1.
    assert full.returncode == 1
    assert f"cpu-1: {PULLED} on cpu-1: pull done" in full.stdout
    assert "cpu-2: failed: backend_error:" in full.stderr
    assert "no space left on device" in full.stderr
    assert PULLED not in await models_of(nc, "cpu-2")
    assert [c.model for c in await changes(nc, "cpu-2")] == []


async def test_a_pull_a_machine_has_no_room_for_is_refused_before_it_starts(
    nats_server: NatsServer, nc: Client, runner: ServiceRunner, tmp_path: Path
) -> None:
    """The worker checks the disk where its Ollama keeps models against the model's size where
    the fleet has it, before it asks its Ollama for anything."""
    with FakeOllama(models=[SERVED]) as fake:
        runner.router(nats_server.url)
        runner.worker(nats_server.url, fake.url, "cpu-1", ollama_models=str(tmp_path))
        await workers_live(nc, 1)
        asked = {
            "prompt": "",
            "model": PULLED,
            "task_type": "model_change",
            "change": {"op": "pull", "size": 10**18},
            "worker": "cpu-1",
            "wait": True,
        }
        reply, _ = await request(nc, ROUTE, asked, timeout_s=30)

    assert reply["status"] == "failed", reply
    assert reply["failure"]["code"] == "insufficient_storage"
    assert f"GB free in {tmp_path}" in reply["failure"]["message"]
    assert all(call["api"] != "pull" for call in fake.calls())


async def test_create_from_a_modelfile_then_copy_and_remove_on_one_machine(
    nats_server: NatsServer,
    nc: Client,
    two_machines: tuple[FakeOllama, FakeOllama],
    tmp_path: Path,
) -> None:
    first, _ = two_machines
    modelfile = tmp_path / "Modelfile"
    modelfile.write_text(
        f'FROM {SERVED}\nSYSTEM """Answer in Japanese.\nAlways."""\nPARAMETER temperature 0.2\n'
    )

    created = await cli(
        nats_server, tmp_path, "create", "jp", "-f", str(modelfile), "--on", "cpu-1"
    )
    copied = await cli(nats_server, tmp_path, "copy", "jp", "jp-copy", "--on", "cpu-1")
    assert created.returncode == 0, created.stderr
    assert copied.returncode == 0, copied.stderr
    assert {"jp:latest", "jp-copy:latest"} <= set(await models_of(nc, "cpu-1"))
    show = f"{first.url}/api/show"
    shown = (await asyncio.to_thread(httpx.post, show, json={"model": "jp"})).json()
    assert shown["system"] == "Answer in Japanese.\nAlways."
    assert "temperature" in shown["parameters"]

    removed = await cli(nats_server, tmp_path, "rm", "jp-copy", "--all")

    assert removed.returncode == 0, removed.stderr
    assert removed.stdout.strip() == "cpu-1: jp-copy:latest on cpu-1: removed"
    assert "jp-copy:latest" not in await models_of(nc, "cpu-1")
    assert "jp:latest" in await models_of(nc, "cpu-1")
    ops = [(c.op, c.model, c.source) for c in await changes(nc, "cpu-1")]
    assert ops == [
        ("create", "jp:latest", SERVED),
        ("copy", "jp-copy:latest", "jp:latest"),
        ("delete", "jp-copy:latest", None),
    ]


async def test_a_machine_busy_with_a_task_finishes_it_before_its_models_change(
    nats_server: NatsServer,
    nc: Client,
    two_machines: tuple[FakeOllama, FakeOllama],
    tmp_path: Path,
) -> None:
    first, _ = two_machines
    first.delay_s = 2.0
    task_id = new_task_id()
    queued = {"prompt": "1+1", "model": SERVED, "worker": "cpu-1", "task_id": task_id}
    reply, _ = await request(nc, ROUTE, queued)
    assert reply["status"] == "queued"

    async def running() -> bool:
        body, _ = await request(nc, "coordinator.workers", {})
        return any(w.get("current_task") == task_id for w in body["workers"])

    await eventually(running, timeout_s=10)
    pulled = await cli(nats_server, tmp_path, "pull", PULLED, "--on", "cpu-1")

    assert pulled.returncode == 0, pulled.stderr
    js = nc.jetstream()
    ended = msgspec.json.decode(
        (await js.get_last_msg("EVENTS", task_event(task_id, "completed", "cpu-1"))).data or b"",
        type=TaskCompleted,
    )
    [change] = await changes(nc, "cpu-1")
    began = msgspec.json.decode(
        (await js.get_last_msg("EVENTS", task_event(change.task_id, "started", "cpu-1"))).data
        or b"",
        type=TaskStarted,
    )
    assert began.at >= ended.at


async def test_only_the_operator_may_change_models_and_a_change_names_its_machine(
    nc: Client, two_machines: tuple[FakeOllama, FakeOllama]
) -> None:
    """Refused by the router, whose rule reads who asks from the reply subject (the shipped
    NATS configuration lets each identity read only its own inbox)."""
    change = {"prompt": "", "model": PULLED, "task_type": "model_change", "wait": True}
    inbox = "_INBOX_client-alice." + new_task_id()
    replies = await nc.subscribe(inbox)
    body = {**change, "change": {"op": "pull"}, "worker": "cpu-1"}
    await nc.publish(ROUTE, msgspec.json.encode(body), reply=inbox)
    refused = await replies.next_msg(timeout=10)
    await replies.unsubscribe()
    assert refused.headers is not None
    assert refused.headers.get("Nats-Service-Error-Code") == "forbidden"
    assert "only the operator" in error_of(msgspec.json.decode(refused.data)).error.message

    unnamed, headers = await request(nc, ROUTE, {**change, "change": {"op": "pull"}})
    assert headers.get("Nats-Service-Error-Code") == "bad_request"
    assert "names the machine" in error_of(unnamed).error.message
    no_source, headers = await request(
        nc, ROUTE, {**change, "change": {"op": "copy"}, "worker": "cpu-1"}
    )
    assert headers.get("Nats-Service-Error-Code") == "bad_request"
    assert "change.source" in error_of(no_source).error.message
    unknown, headers = await request(
        nc, ROUTE, {**change, "change": {"op": "pull"}, "worker": "nobody"}, timeout_s=30
    )
    assert headers.get("Nats-Service-Error-Code") == "worker_unavailable", unknown


async def test_a_sleeping_machine_is_woken_for_a_pull_and_pulls_once_it_is_back(
    nats_server: NatsServer,
    nc: Client,
    runner: ServiceRunner,
    tmp_path: Path,
    wol_listener: socket.socket,
) -> None:
    with FakeOllama(models=[SERVED]) as fake:
        port = wol_listener.getsockname()[1]
        runner.router(nats_server.url, wol_broadcast="127.0.0.1", wol_port=port, wake_wait_s=30.0)
        await asyncio.wait_for(
            runner.worker(nats_server.url, fake.url, "pc", **sleepy(tmp_path)), timeout=15
        )
        await eventually(lambda: sleeps(nc, "pc"))
        pulling = asyncio.ensure_future(cli(nats_server, tmp_path, "pull", PULLED, "--on", "pc"))
        packet, _ = await asyncio.to_thread(wol_listener.recvfrom, 200)
        assert packet == b"\xff" * 6 + bytes.fromhex("aabbccddeeff") * 16
        # The machine boots and its worker starts again: the pull waits in its queue.
        runner.worker(nats_server.url, fake.url, "pc", worker_supports=["gpu_inference"])
        pulled = await pulling

    assert pulled.returncode == 0, pulled.stderr
    assert pulled.stdout.splitlines()[-1].startswith(f"pc: {PULLED} on pc: pull done")
    assert PULLED in await models_of(nc, "pc")
