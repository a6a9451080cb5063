"""Model aliases in routing (lesson 6): one canonical key, whatever name is served or asked."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from nats.aio.client import Client

from devtools.fakes.ollama import FakeOllama
from devtools.servers import NatsServer
from schemas.events import AliasSet
from services.runtime.bus import ensure_streams, publish_event
from tests.harness import ServiceRunner, eventually, request, workers_live

SERVED = "hf.co/elyza/Llama-3-ELYZA-JP-8B-GGUF:Q4_K_M"
CANONICAL = "elyza-jp-8b"


@pytest.fixture
def hf_ollama() -> Iterator[FakeOllama]:
    with FakeOllama(models=[SERVED, "gemma3:1b"]) as fake:
        yield fake


async def alias(nc: Client, name: str, canonical: str) -> None:
    js = nc.jetstream()
    await ensure_streams(js)
    await publish_event(js, AliasSet(at=time.time(), alias=name, canonical=canonical))


async def ask(nc: Client, model: str) -> dict[str, Any]:
    body, _ = await request(
        nc, "coordinator.route", {"prompt": "say hello", "model": model, "wait": True}
    )
    return body


async def test_a_worker_registers_the_canonical_name_and_runs_the_served_one(
    nats_server: NatsServer, nc: Client, hf_ollama: FakeOllama, runner: ServiceRunner
) -> None:
    await alias(nc, SERVED, CANONICAL)
    runner.router(nats_server.url)
    runner.worker(nats_server.url, hf_ollama.url, "mac")

    workers = await workers_live(nc, 1)
    assert sorted(workers[0]["models"]) == sorted([CANONICAL, "gemma3:1b"])
    for name in (CANONICAL, SERVED):
        reply = await ask(nc, name)
        assert reply["status"] == "done", reply
        assert reply["response"].startswith(f"Echo from {SERVED}")

    task_id = reply["task_id"]
    submitted = await nc.jetstream().get_last_msg("EVENTS", f"events.task.{task_id}.submitted")
    assert b'"model":"elyza-jp-8b"' in (submitted.data or b"")
    assert f'"requested_model":"{SERVED}"'.encode() in (submitted.data or b"")


async def test_an_alias_added_while_running_reaches_router_and_registration(
    nats_server: NatsServer, nc: Client, hf_ollama: FakeOllama, runner: ServiceRunner
) -> None:
    runner.router(nats_server.url)
    runner.worker(nats_server.url, hf_ollama.url, "mac")
    await workers_live(nc, 1)
    unknown, headers = await request(
        nc, "coordinator.route", {"prompt": "x", "model": CANONICAL, "wait": True}
    )
    assert headers["Nats-Service-Error-Code"] == "no_worker", unknown

    await alias(nc, SERVED, CANONICAL)

    async def registered() -> bool:
        workers = await workers_live(nc, 1)
        return CANONICAL in workers[0]["models"]

    await eventually(registered, timeout_s=10)
    assert (await ask(nc, CANONICAL))["status"] == "done"
