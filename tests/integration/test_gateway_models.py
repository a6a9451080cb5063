"""``ollama pull``, ``ollama create``, ``ollama cp`` and ``ollama rm`` pointed at the gateway
work as they do against one Ollama, on the machines a header names or, by default, the ones
the change makes sense on; only an operator's key may change models. The official ``ollama``
client; a real nats-server; the router, two workers on Ollama stand-ins and the gateway
in-process."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import ollama
import pytest
from nats.aio.client import Client

from devtools.fakes.ollama import FakeOllama
from devtools.servers import NatsServer
from tests.harness import ServiceRunner, request, workers_live
from tests.integration.test_gateway import start_gateway
from tests.integration.test_gateway_keys import add_key

SERVED = "qwen2.5:0.5b"
PULLED = "llama3.2:1b"
ON_FIRST = {"X-Coordinator-Machines": "cpu-1"}


@dataclass
class Fleet:
    url: str
    first: FakeOllama
    second: FakeOllama


@pytest.fixture
async def fleet(nats_server: NatsServer, nc: Client, runner: ServiceRunner) -> AsyncIterator[Fleet]:
    with FakeOllama(models=[SERVED]) as first, FakeOllama(models=[SERVED]) as second:
        first.pull_chunk_delay_s = 0.01
        runner.router(nats_server.url)
        runner.worker(nats_server.url, first.url, "cpu-1")
        runner.worker(nats_server.url, second.url, "cpu-2")
        url = await start_gateway(runner, nats_server.url)
        await workers_live(nc, 2)
        yield Fleet(url, first, second)
        await runner.stop_all()


async def models_of(nc: Client, worker: str) -> list[str]:
    body, _ = await request(nc, "coordinator.workers", {})
    found: list[str] = next(w["models"] for w in body["workers"] if w["worker_id"] == worker)
    return found


def pulls(fake: FakeOllama) -> int:
    return sum(call["api"] == "pull" for call in fake.calls())


async def test_ollama_pull_onto_the_machine_a_header_names_streams_one_bar_per_layer(
    fleet: Fleet, nc: Client
) -> None:
    async with ollama.AsyncClient(host=fleet.url, headers=ON_FIRST) as oc:
        steps = [step async for step in await oc.pull(PULLED, stream=True)]
        listed = await oc.list()

    assert steps[0].status == "pulling manifest" and steps[-1].status == "success"
    layers: dict[str, list[int]] = {}
    for step in steps:
        if step.digest:
            assert step.total and step.status == f"pulling {step.digest[7:19]}"
            layers.setdefault(step.digest, []).append(step.completed or 0)
    assert layers and all(done == sorted(done) and done[-1] > 0 for done in layers.values())
    assert [s.status for s in steps if s.status == "success"] == ["success"]
    assert PULLED in {m.model for m in listed.models}
    assert PULLED in await models_of(nc, "cpu-1")
    assert PULLED not in await models_of(nc, "cpu-2")
    assert (pulls(fleet.first), pulls(fleet.second)) == (1, 0)


async def test_a_pull_by_default_goes_to_every_machine_of_the_models_tier(
    fleet: Fleet, nc: Client
) -> None:
    async with ollama.AsyncClient(host=fleet.url) as oc:
        pulled = await oc.pull(SERVED)  # not streamed: Ollama's last line
        with pytest.raises(ollama.ResponseError) as nowhere:
            await oc.pull("nope:1b")

    assert pulled.status == "success"
    assert (pulls(fleet.first), pulls(fleet.second)) == (1, 1)
    assert nowhere.value.status_code == 404
    assert "X-Coordinator-Machines" in nowhere.value.error


async def test_a_pull_that_fails_on_a_machine_ends_in_ollamas_error_naming_it(
    fleet: Fleet,
) -> None:
    fleet.second.disk_free_bytes = 1_000_000
    both = {"X-Coordinator-Machines": "cpu-1,cpu-2"}
    async with ollama.AsyncClient(host=fleet.url, headers=both) as oc:
        with pytest.raises(ollama.ResponseError) as streamed:
            [step async for step in await oc.pull(PULLED, stream=True)]
        with pytest.raises(ollama.ResponseError) as missing:
            await oc.pull("no-such-model:1b")

    assert "cpu-2:" in streamed.value.error and "no space left on device" in streamed.value.error
    assert "cpu-1" not in streamed.value.error
    assert missing.value.status_code == 502
    assert "cpu-1:" in missing.value.error and "cpu-2:" in missing.value.error
    assert "pull model manifest: file does not exist" in missing.value.error


async def test_ollama_create_copy_and_rm_through_the_gateway(fleet: Fleet, nc: Client) -> None:
    async with ollama.AsyncClient(host=fleet.url, headers=ON_FIRST) as oc:
        made = [
            step.status
            async for step in await oc.create(
                model="jp", from_=SERVED, system="Answer in Japanese.", stream=True
            )
        ]
        answer = await oc.chat(model="jp", messages=[{"role": "user", "content": "1+1"}])
        await oc.copy("jp", "jp-copy")
    async with ollama.AsyncClient(host=fleet.url) as oc:  # default: the machines that have it
        await oc.delete("jp-copy")
        with pytest.raises(ollama.ResponseError) as gone:
            await oc.delete("jp-copy")

    assert made[-1] == "success" and "writing manifest" in made
    assert answer.message.content == "2"
    shown = await asyncio.to_thread(httpx.post, f"{fleet.first.url}/api/show", json={"model": "jp"})
    assert shown.json()["system"] == "Answer in Japanese."
    models = await models_of(nc, "cpu-1")
    assert "jp:latest" in models and "jp-copy:latest" not in models
    assert gone.value.status_code == 404


async def test_a_create_from_files_is_refused_as_ollama_refuses(fleet: Fleet) -> None:
    async with httpx.AsyncClient(base_url=fleet.url, headers=ON_FIRST) as http:
        files = await http.post("/api/create", json={"model": "x", "files": {"a.gguf": "sha"}})
        neither = await http.post("/api/create", json={"model": "x"})
        unnamed = await http.request("DELETE", "/api/delete", json={"model": ""})

    assert files.status_code == 400 and "not carried" in files.json()["error"]
    assert neither.json() == {"error": "neither 'from' or 'files' was specified"}
    assert unnamed.status_code == 400 and unnamed.json() == {"error": 'name "" is invalid'}


async def test_only_an_operators_key_changes_models(
    nats_server: NatsServer, nc: Client, runner: ServiceRunner
) -> None:
    with FakeOllama(models=[SERVED]) as fake:
        household = await add_key(nc, "household")
        admin = await add_key(nc, "admin", operator=True)
        runner.router(nats_server.url)
        runner.worker(nats_server.url, fake.url, "cpu-1")
        url = await start_gateway(runner, nats_server.url)
        await workers_live(nc, 1)

        def client(key: str) -> ollama.AsyncClient:
            headers = {"Authorization": f"Bearer {key}", **ON_FIRST}
            return ollama.AsyncClient(host=url, headers=headers)

        async with client(household) as oc:
            served: Any = await oc.pull(SERVED)  # nothing to do: at once, no pull
            with pytest.raises(ollama.ResponseError) as pull:
                await oc.pull(PULLED)
            with pytest.raises(ollama.ResponseError) as delete:
                await oc.delete(SERVED)
        async with client(admin) as oc:
            pulled = await oc.pull(PULLED)

    assert served.status == "success"
    assert pull.value.status_code == 403 and "operator's key" in pull.value.error
    assert delete.value.status_code == 403
    assert pulled.status == "success"
    assert sum(call["api"] == "pull" for call in fake.calls()) == 1
    assert all(call["api"] != "delete" for call in fake.calls())
