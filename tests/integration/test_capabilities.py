"""Capabilities, embeddings and everything a request carries, through the router and real
workers (real nats-server, the Ollama stand-in over real sockets)."""

from __future__ import annotations

import asyncio
import base64
import os
import tempfile
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
from nats.aio.client import Client

from devtools.fakes.ollama import FakeOllama
from devtools.servers import NatsServer
from schemas.route import RouteReply, StreamChunk
from schemas.subjects import EVENTS_STREAM, TASKS_STREAM
from schemas.vectors import dimensions, to_floats
from schemas.workers import WorkerRecord
from services.runtime.request import stream_call
from tests.harness import (
    ServiceRunner,
    clean_env,
    error_of,
    eventually,
    request,
    run_cli,
    workers_live,
)

CHAT = "qwen2.5:0.5b"
EMBEDDER = "nomic-embed-text:latest"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
# A 1x1 transparent PNG.
PIXEL = (
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA60e6kg"
    "AAAABJRU5ErkJggg=="
)


async def ask(nc: Client, **fields: Any) -> tuple[dict[str, Any], dict[str, str]]:
    body = {"prompt": "1+1は？", "model": CHAT, "wait": True, **fields}
    return await request(nc, "coordinator.route", body)


async def records(nc: Client, count: int, *, router: bool = True) -> dict[str, WorkerRecord]:
    """The registry's entries once ``count`` are there, and (``router``) the router sees them."""

    async def read() -> dict[str, WorkerRecord] | None:
        try:
            kv = await nc.jetstream().key_value("workers")
            keys = await kv.keys()
        except Exception:
            return None
        found = {}
        for key in keys:
            entry = await kv.get(key)
            found[key] = msgspec.json.decode(entry.value or b"", type=WorkerRecord)
        # Registered with its models (a starting worker holds its lease with none yet).
        ready = len(found) >= count and all(record.models for record in found.values())
        return found if ready else None

    result: dict[str, WorkerRecord] = await eventually(read, timeout_s=20)
    if router:
        await workers_live(nc, count)
    return result


async def task_kinds(nc: Client) -> int:
    """How many task events the stream holds (not the workers' own events: a worker's
    ``registered`` may be stored after the registry lists its models)."""
    info = await nc.jetstream().stream_info(EVENTS_STREAM, subjects_filter="events.task.>")
    return sum((info.state.subjects or {}).values())


@pytest.fixture
def plain() -> Iterator[FakeOllama]:
    """A backend whose models have no tools, vision or embedding."""
    with FakeOllama(models=[CHAT], tool_models=[], vision_models=[], embedding_models=[]) as fake:
        yield fake


@pytest.fixture
def able() -> Iterator[FakeOllama]:
    """A backend whose chat model has tools and vision, beside an embedding-only model."""
    with FakeOllama(
        models=[CHAT, EMBEDDER],
        tool_models=[CHAT],
        vision_models=[CHAT],
        embedding_models=[EMBEDDER],
    ) as fake:
        yield fake


async def test_workers_register_what_their_backend_says_of_each_model(
    nats_server: NatsServer, nc: Client, able: FakeOllama, runner: ServiceRunner
) -> None:
    runner.worker(nats_server.url, able.url, "cpu-1")
    record = (await records(nc, 1, router=False))["cpu-1"]

    facts = {f.name: f for f in record.facts}
    assert sorted(facts) == sorted(record.models) == sorted([CHAT, EMBEDDER])
    assert {"completion", "tools", "vision"} <= set(facts[CHAT].capabilities)
    assert facts[EMBEDDER].capabilities == ["embedding"]
    assert facts[CHAT].digest != facts[EMBEDDER].digest
    assert len(facts[CHAT].digest) == 64 and facts[CHAT].size > 0
    assert facts[CHAT].details.family and facts[CHAT].details.parameter_size
    assert facts[CHAT].context_length
    # The embedding-only model passed a sanity run through the embed API, not a generation.
    assert able.stats()["embed_calls"] >= 1
    assert able.stats()["generate_calls"] == 1


async def test_a_tools_request_goes_only_to_a_worker_whose_model_has_tools(
    nats_server: NatsServer,
    nc: Client,
    plain: FakeOllama,
    able: FakeOllama,
    runner: ServiceRunner,
) -> None:
    runner.router(nats_server.url)
    runner.worker(nats_server.url, plain.url, "a-plain", worker_models=[CHAT])
    runner.worker(nats_server.url, able.url, "b-able", worker_models=[CHAT])
    await records(nc, 2)
    conversation = [{"role": "user", "content": "What is the weather in Paris? get_weather"}]

    for _ in range(3):
        body, headers = await ask(nc, messages=conversation, tools=[WEATHER])
        assert "Nats-Service-Error-Code" not in headers, body
        assert body["worker"] == "b-able"
        reply = msgspec.convert(body, RouteReply)
        assert reply.tool_calls and reply.tool_calls[0].name == "get_weather"
        assert isinstance(reply.tool_calls[0].arguments, dict)
        assert "city" in reply.tool_calls[0].arguments
    assert plain.stats()["chat_calls"] == 0
    sent = able.last("chat")
    assert sent["tools"] == [WEATHER]

    # The tool's result goes back as a tool turn, and the answer rests on it.
    turns = [
        *conversation,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}],
        },
        {"role": "tool", "content": "18 degrees and sunny", "tool_name": "get_weather"},
    ]
    body, headers = await ask(nc, messages=turns, tools=[WEATHER])
    assert body["status"] == "done", body
    assert "18 degrees and sunny" in body["response"]
    history = able.last("chat")["messages"]
    assert history[1]["tool_calls"][0]["function"] == {
        "name": "get_weather",
        "arguments": {"city": "Paris"},
    }
    assert history[2] == {
        "role": "tool",
        "content": "18 degrees and sunny",
        "tool_name": "get_weather",
    }


async def test_streamed_tool_calls_arrive_as_a_chunk_and_in_the_reply(
    nats_server: NatsServer, nc: Client, able: FakeOllama, runner: ServiceRunner
) -> None:
    runner.router(nats_server.url)
    runner.worker(nats_server.url, able.url, "cpu-1")
    await records(nc, 1)
    body = {
        "prompt": "weather in Oslo? get_weather",
        "model": CHAT,
        "tools": [WEATHER],
        "stream": True,
    }
    chunks: list[StreamChunk] = []
    final = b""
    async for item in stream_call(nc, "coordinator.route", msgspec.json.encode(body), 20):
        if isinstance(item, StreamChunk):
            chunks.append(item)
        else:
            final = item
    calls = [c for chunk in chunks for c in chunk.tool_calls or []]
    assert [c.name for c in calls] == ["get_weather"]
    reply = msgspec.json.decode(final, type=RouteReply)
    assert reply.tool_calls == calls


async def test_a_need_no_live_worker_can_meet_is_refused_in_ollamas_words(
    nats_server: NatsServer, nc: Client, plain: FakeOllama, runner: ServiceRunner
) -> None:
    runner.router(nats_server.url)
    runner.worker(nats_server.url, plain.url, "cpu-1")
    await records(nc, 1)
    before = await task_kinds(nc)

    image = [{"role": "user", "content": "what is this?", "images": [PIXEL]}]
    cases: list[tuple[dict[str, Any], str]] = [
        ({"messages": image}, f"{CHAT} does not support vision"),
        ({"tools": [WEATHER]}, f"{CHAT} does not support tools"),
        ({"think": True}, f'"{CHAT}" does not support thinking'),
        ({"task_type": "embedding", "input": ["x"]}, f"{CHAT} does not support embedding"),
    ]
    for fields, words in cases:
        body, headers = await ask(nc, **fields)
        assert headers.get("Nats-Service-Error-Code") == "unsupported_capability", body
        assert error_of(body).error.message == words
    # A designated worker without the capability is an error naming it.
    body, headers = await ask(nc, worker="cpu-1", tools=[WEATHER])
    assert headers.get("Nats-Service-Error-Code") == "worker_unavailable"
    assert "does not support tools" in error_of(body).error.message
    assert await task_kinds(nc) == before  # nothing written for a refusal
    assert plain.stats()["chat_calls"] == 0


async def test_format_images_options_and_keep_alive_reach_the_backend_unchanged(
    nats_server: NatsServer, nc: Client, able: FakeOllama, runner: ServiceRunner
) -> None:
    runner.router(nats_server.url)
    runner.worker(nats_server.url, able.url, "cpu-1")
    await records(nc, 1)
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    }
    options = {"num_ctx": 4096, "top_k": 20, "repeat_penalty": 1.1, "mirostat": 2, "seed": 7}

    body, _ = await ask(
        nc, prompt="describe", format=schema, options=options, keep_alive="10m", images=[PIXEL]
    )

    assert body["status"] == "done", body
    answer = msgspec.json.decode(body["response"])
    assert isinstance(answer["name"], str) and isinstance(answer["age"], int)
    sent = able.last("generate")
    assert sent["format"] == schema
    assert sent["options"] == options
    assert sent["keep_alive"] == "10m"
    assert sent["images"] == [PIXEL]


async def test_an_embedding_task_runs_on_a_worker_that_serves_the_model(
    nats_server: NatsServer, nc: Client, able: FakeOllama, runner: ServiceRunner
) -> None:
    runner.router(nats_server.url)
    runner.worker(nats_server.url, able.url, "cpu-1")
    await records(nc, 1)
    texts = ["the cat sat", "on the mat", "the cat sat"]

    # A bare name is the model's :latest, as Ollama resolves it.
    body, headers = await ask(
        nc, prompt="", model="nomic-embed-text", task_type="embedding", input=texts, dimensions=64
    )

    assert "Nats-Service-Error-Code" not in headers, body
    reply = msgspec.convert(body, RouteReply)
    assert reply.model == EMBEDDER
    assert reply.embeddings is not None and len(reply.embeddings) == 3
    assert [dimensions(v) for v in reply.embeddings] == [64, 64, 64]
    first, second, third = (to_floats(v) for v in reply.embeddings)
    assert first == third != second
    assert abs(sum(x * x for x in first) - 1.0) < 1e-4  # unit length, as /api/embed gives
    sent = able.last("embed")
    assert sent["input"] == texts and sent["dimensions"] == 64
    # One task for the batch, recorded like any other.
    js = nc.jetstream()
    done = await js.get_last_msg(EVENTS_STREAM, f"events.task.{reply.task_id}.*.completed")
    assert msgspec.json.decode(done.data or b"")["embeddings"] == body["embeddings"]
    submitted = await js.get_last_msg(EVENTS_STREAM, f"events.task.{reply.task_id}.submitted")
    assert msgspec.json.decode(submitted.data or b"")["work"]["domain"] == "embedding"
    assert (await js.stream_info(TASKS_STREAM)).state.messages == 0


async def test_the_older_embeddings_api_gets_the_models_own_vectors(
    nats_server: NatsServer, nc: Client, able: FakeOllama, runner: ServiceRunner
) -> None:
    runner.router(nats_server.url)
    runner.worker(nats_server.url, able.url, "cpu-1")
    await records(nc, 1)

    body, _ = await ask(
        nc, prompt="", model=EMBEDDER, task_type="embedding", input=["hello"], normalize=False
    )

    reply = msgspec.convert(body, RouteReply)
    assert reply.embeddings is not None and len(reply.embeddings) == 1
    assert able.last("embeddings")["prompt"] == "hello"


async def test_an_embedding_task_can_be_cancelled(
    nats_server: NatsServer, nc: Client, able: FakeOllama, runner: ServiceRunner
) -> None:
    runner.router(nats_server.url)
    runner.worker(nats_server.url, able.url, "cpu-1")
    await records(nc, 1)
    able.configure(delay_s=5)
    started = await nc.subscribe("events.task.*.*.started")
    asking = asyncio.create_task(
        ask(nc, prompt="", model=EMBEDDER, task_type="embedding", input=["slow"])
    )
    event = msgspec.json.decode((await started.next_msg(timeout=10)).data)

    cancelled, _ = await request(nc, "coordinator.cancel", {"task_id": event["task_id"]})
    body, _ = await asyncio.wait_for(asking, timeout=5)

    assert cancelled["status"] == "cancelling"
    assert (body["status"], body["error"].split(":")[0]) == ("failed", "cancelled")


def small_server(store: str, limit: int) -> NatsServer:
    config = os.path.join(store, "small.conf")
    with open(config, "w") as f:
        f.write(f"max_payload: {limit}\njetstream {{ store_dir: {store!r} }}\n")
    return NatsServer(store, config=config).start()


async def test_what_does_not_fit_in_one_message_is_refused_or_failed_explicitly(
    able: FakeOllama, runner: ServiceRunner
) -> None:
    import nats

    with tempfile.TemporaryDirectory(prefix="coord-small-") as store:
        server = small_server(store, 64 * 1024)
        try:
            nc = await nats.connect(server.url)
            runner.router(server.url)
            runner.worker(server.url, able.url, "cpu-1")
            await records(nc, 1)
            before = await task_kinds(nc)

            # Fits the server, but not as a task with its ids and headers: refused, no task.
            image = base64.b64encode(os.urandom(47_000)).decode()
            body, headers = await ask(nc, images=[image])
            assert headers.get("Nats-Service-Error-Code") == "too_large"
            assert "max_payload of 65536 bytes" in error_of(body).error.message
            assert await task_kinds(nc) == before

            # An answer too large for one event ends the task failed, saying why.
            texts = [f"text {i}" for i in range(40)]
            body, _ = await ask(nc, prompt="", model=EMBEDDER, task_type="embedding", input=texts)
            assert body["status"] == "failed"
            assert body["error"].startswith("too_large: the answer is")
            await nc.close()
        finally:
            await runner.stop_all()
            server.stop()


async def test_coordinator_embed_prints_one_vector_per_text(
    nats_server: NatsServer, nc: Client, able: FakeOllama, runner: ServiceRunner
) -> None:
    runner.router(nats_server.url)
    runner.worker(nats_server.url, able.url, "cpu-1")
    await records(nc, 1)
    env = clean_env(NATS_URL=nats_server.url)

    done = await asyncio.to_thread(
        run_cli, "embed", "first text", "second text", "--model", "nomic-embed-text", env=env
    )

    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 2
    vectors = [msgspec.json.decode(line, type=list[float]) for line in lines]
    assert len(vectors[0]) == len(vectors[1]) > 0
    assert "2 vectors of" in done.stderr

    failed = await asyncio.to_thread(run_cli, "embed", "x", "--model", CHAT, env=env)
    assert failed.returncode == 1
    assert (
        "unsupported_capability" in failed.stderr and "does not support embedding" in failed.stderr
    )


async def test_the_gateway_refuses_what_a_smaller_nats_limit_cannot_carry_with_a_413(
    able: FakeOllama, runner: ServiceRunner
) -> None:
    """A fleet whose nats-server keeps a lower max_payload than the shipped 8 MB: a body under
    the gateway's own limit but over the server's is a 413 in the API's shape, never a 500."""
    import httpx
    import nats

    from tests.integration.test_gateway import start_gateway

    with tempfile.TemporaryDirectory(prefix="coord-small-") as store:
        server = small_server(store, 64 * 1024)
        try:
            nc = await nats.connect(server.url)
            runner.router(server.url)
            runner.worker(server.url, able.url, "cpu-1")
            url = await start_gateway(runner, server.url)
            await records(nc, 1)
            image = base64.b64encode(os.urandom(100_000)).decode()
            async with httpx.AsyncClient(base_url=url) as http:
                big = await http.post(
                    "/api/chat",
                    json={
                        "model": CHAT,
                        "stream": False,
                        "messages": [{"role": "user", "content": "what?", "images": [image]}],
                    },
                )
                small = await http.post(
                    "/api/generate", json={"model": CHAT, "prompt": "1+1", "stream": False}
                )
            assert big.status_code == 413
            assert "max_payload of 65536 bytes" in big.json()["error"]
            assert small.status_code == 200 and small.json()["response"] == "2"
            await nc.close()
        finally:
            await runner.stop_all()
            server.stop()
