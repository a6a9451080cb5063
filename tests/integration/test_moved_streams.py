"""A task the reaper moves runs as its client asked, and a streamed one streams: the official
``ollama`` and ``openai`` clients, through the gateway, get the whole answer of the attempt
that completed, whether the first worker died before it pulled the task or mid-answer; and
when the new attempt's answer does not continue what was streamed, an error naming the task
instead of garbled text. Real nats-server, router, reaper, workers, Ollama stand-ins."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable, Coroutine
from typing import Any

import httpx
import msgspec
import ollama as ollama_client
import openai
import pytest
from nats.aio.client import Client

from devtools.fakes.ollama import FakeOllama
from devtools.servers import NatsServer
from schemas.events import TaskCompleted, TaskRouted
from schemas.models import ModelFacts
from schemas.route import RouteReply, StreamChunk
from services.runtime.request import stream_call
from tests.harness import COORDINATOR, Processes, ServiceRunner, eventually, workers_live
from tests.integration.test_gateway import start_gateway
from tests.integration.test_reaper import worker_env
from tests.reaper_harness import MODEL, Registration, TaskEvents

PROMPT = "tell me about " + " ".join(f"item{i}" for i in range(24))
ANSWER = f"Echo from {MODEL}: {PROMPT}"

Stream = Callable[[str, list[str]], Coroutine[Any, Any, None]]


async def ollama_stream(url: str, pieces: list[str]) -> None:
    """``/api/chat`` streamed, with the official ``ollama`` client."""
    async with ollama_client.AsyncClient(host=url) as oc:
        parts = await oc.chat(
            model=MODEL, messages=[{"role": "user", "content": PROMPT}], stream=True
        )
        async for part in parts:
            pieces.append(part.message.content or "")


async def openai_stream(url: str, pieces: list[str]) -> None:
    """``/v1/chat/completions`` streamed, with the official ``openai`` client."""
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused") as ai:
        chunks = await ai.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": PROMPT}], stream=True
        )
        async for chunk in chunks:
            if chunk.choices and chunk.choices[0].delta.content:
                pieces.append(chunk.choices[0].delta.content)


STREAMS: dict[str, Stream] = {"ollama": ollama_stream, "openai": openai_stream}
# What each client raises for the API's mid-stream error.
STREAM_ERRORS: dict[str, type[Exception]] = {
    "ollama": ollama_client.ResponseError,
    "openai": openai.APIError,
}


async def control_plane(nats_server: NatsServer, runner: ServiceRunner) -> str:
    """Router, reaper (moving dead workers' tasks; not ghosts: none here), gateway: its URL."""
    runner.router(nats_server.url)
    runner.reaper(nats_server.url, ghost_after_s=30.0)
    return await start_gateway(runner, nats_server.url)


async def at_least(pieces: list[str], count: int) -> bool:
    return len(pieces) >= count


@pytest.mark.parametrize("api", ["ollama", "openai"])
async def test_a_streamed_task_whose_worker_died_before_pulling_it_streams_from_the_next(
    api: str, nats_server: NatsServer, nc: Client, runner: ServiceRunner
) -> None:
    url = await control_plane(nats_server, runner)
    with FakeOllama(models=[MODEL]) as fake:
        fake.chunk_delay_s = 0.02
        async with Registration(nc, "cpu-a") as doomed, TaskEvents(nc) as events:
            await workers_live(nc, 1)
            pieces: list[str] = []
            streaming = asyncio.create_task(STREAMS[api](url, pieces))
            routed = await events.wait_for(lambda e: isinstance(e, TaskRouted))
            assert isinstance(routed, TaskRouted) and routed.worker == "cpu-a"
            runner.worker(nats_server.url, fake.url, "cpu-b")
            await workers_live(nc, 2)
            doomed.silence()  # killed before it took the task from its queue

            await asyncio.wait_for(streaming, 30)
            done = await events.first("completed", routed.task_id)

    assert isinstance(done, TaskCompleted) and (done.attempt, done.worker) == (2, "cpu-b")
    assert "".join(pieces) == ANSWER
    assert len([p for p in pieces if p]) > 10  # streamed as generated, not one last piece


async def start_doomed_worker(
    nats_server: NatsServer, nc: Client, processes: Processes, fake: FakeOllama
) -> Any:
    """Worker ``cpu-a`` as a process of its own (to be killed), the only live one."""
    doomed = processes.start([COORDINATOR, "worker"], worker_env(nats_server, fake, "cpu-a"))
    await workers_live(nc, 1)
    return doomed


@pytest.mark.parametrize("api", ["ollama", "openai"])
async def test_a_streamed_task_whose_worker_is_killed_mid_answer_streams_the_whole_answer(
    api: str, nats_server: NatsServer, nc: Client, runner: ServiceRunner, processes: Processes
) -> None:
    """The next attempt starts its answer over; what it repeats is not written twice, and
    the stream goes on from where the killed worker stopped."""
    url = await control_plane(nats_server, runner)
    with FakeOllama(models=[MODEL]) as slow, FakeOllama(models=[MODEL]) as fast:
        slow.chunk_delay_s = 0.5  # about 15 s of answer: it is killed well before the end
        doomed = await start_doomed_worker(nats_server, nc, processes, slow)
        async with TaskEvents(nc) as events:
            pieces: list[str] = []
            streaming = asyncio.create_task(STREAMS[api](url, pieces))
            await eventually(lambda: at_least(pieces, 3), timeout_s=20)
            runner.worker(nats_server.url, fast.url, "cpu-b")
            await workers_live(nc, 2)
            assert not events.of(events.events[0].task_id, "completed")
            written = len("".join(pieces))
            doomed.send_signal(signal.SIGKILL)
            await asyncio.to_thread(doomed.wait)

            await asyncio.wait_for(streaming, 30)
            done = await events.first("completed")

    assert isinstance(done, TaskCompleted) and (done.attempt, done.worker) == (2, "cpu-b")
    assert "".join(pieces) == ANSWER
    assert 0 < written < len(ANSWER)


@pytest.mark.parametrize("api", ["ollama", "openai"])
async def test_a_moved_stream_whose_new_answer_differs_ends_in_an_error_naming_the_task(
    api: str,
    nats_server: NatsServer,
    nc: Client,
    runner: ServiceRunner,
    processes: Processes,
    pg_dsn: str,
) -> None:
    """A stream cannot take back what it wrote: the client is told, in the API's mid-stream
    error, that the task was run again and where to read its whole answer; the task goes
    on to its end."""
    url = await control_plane(nats_server, runner)
    runner.stats(nats_server.url, pg_dsn)  # answers GET /task/{id}
    with FakeOllama(models=[MODEL]) as slow, FakeOllama(models=[MODEL]) as other:
        slow.chunk_delay_s = 0.5
        other.replies = {"tell me about": "Something else entirely."}
        doomed = await start_doomed_worker(nats_server, nc, processes, slow)
        async with TaskEvents(nc) as events:
            pieces: list[str] = []
            streaming = asyncio.create_task(STREAMS[api](url, pieces))
            await eventually(lambda: at_least(pieces, 3), timeout_s=20)
            task_id = events.events[0].task_id
            runner.worker(nats_server.url, other.url, "cpu-b")
            await workers_live(nc, 2)
            doomed.send_signal(signal.SIGKILL)
            await asyncio.to_thread(doomed.wait)

            with pytest.raises(STREAM_ERRORS[api]) as raised:
                await asyncio.wait_for(streaming, 30)
            await events.first("completed", task_id)

        assert f"task {task_id} was run again" in str(raised.value)
        assert f"GET /task/{task_id}" in str(raised.value)
        assert ANSWER.startswith("".join(pieces))  # nothing of the other answer was written
        async with httpx.AsyncClient(base_url=url) as http:

            async def answered() -> dict[str, Any] | None:
                task: dict[str, Any] = (await http.get(f"/task/{task_id}")).json()
                return task if task.get("status") == "done" else None

            task = await eventually(answered, timeout_s=15)
        assert task["response"] == "Something else entirely."


# -- every field of the work survives a move ----------------------------------------------------

EVERYTHING = "qwen3:0.6b"  # served below with every capability a request can need
EMBEDDER = "nomic-embed-text:latest"
PNG = (
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA60e6"
    "kgAAAABJRU5ErkJggg=="
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
CHAT = {
    "model": EVERYTHING,
    "prompt": "User: what is in this picture?",
    "messages": [{"role": "user", "content": "what is in this picture?", "images": [PNG]}],
    "tools": [WEATHER],
    "format": SCHEMA,
    "options": {"temperature": 0.25, "num_ctx": 2048},
    "keep_alive": "7m",
    "think": True,
    "domain": "pictures",
    "stream": True,
}
GENERATE = {
    "model": EVERYTHING,
    "prompt": "def add(a, b):",
    "suffix": "    return c",
    "images": [PNG],
    "format": "json",
    "options": {"seed": 7},
    "keep_alive": 30,
    "think": False,
    "wait": True,
}
EMBED = {
    "model": EMBEDDER,
    "task_type": "embedding",
    "prompt": "a\nb",
    "input": ["the cat sat", "dogs bark"],
    "truncate": False,
    "dimensions": 64,
    "keep_alive": "1m",
    "options": {"num_ctx": 256},
    "wait": True,
}


async def test_every_field_of_the_work_reaches_the_backend_of_a_moved_attempt(
    nats_server: NatsServer, nc: Client, runner: ServiceRunner
) -> None:
    """Three tasks that hold every field of `schemas.work.Work` between them are routed to a
    worker that dies before it pulls them; the one they are moved to gets each field as the
    client sent it, and the chat streams."""
    runner.router(nats_server.url)
    runner.reaper(nats_server.url, ghost_after_s=30.0)
    every = ["completion", "tools", "vision", "thinking", "insert"]
    with FakeOllama(
        models=[EVERYTHING, EMBEDDER],
        thinking_models=[EVERYTHING],
        tool_models=[EVERYTHING],
        vision_models=[EVERYTHING],
        insert_models=[EVERYTHING],
    ) as fake:
        doomed = Registration(nc, "cpu-a", models=(EVERYTHING, EMBEDDER))
        doomed.record = msgspec.structs.replace(
            doomed.record,
            facts=[
                ModelFacts(name=EVERYTHING, capabilities=every),
                ModelFacts(name=EMBEDDER, capabilities=["embedding"]),
            ],
        )
        async with doomed, TaskEvents(nc) as events:
            await workers_live(nc, 1)
            chunks: list[StreamChunk] = []
            finals: list[bytes] = []

            async def chat() -> None:
                body = msgspec.json.encode(CHAT)
                async for item in stream_call(nc, "coordinator.route", body, 30.0):
                    if isinstance(item, bytes):
                        finals.append(item)
                    else:
                        chunks.append(item)

            async def ask(body: dict[str, Any]) -> RouteReply:
                reply = await nc.request("coordinator.route", msgspec.json.encode(body), 30.0)
                return msgspec.json.decode(reply.data, type=RouteReply)

            asked = asyncio.gather(chat(), ask(GENERATE), ask(EMBED))
            await eventually(lambda: _routed(events, 3), timeout_s=15)
            runner.worker(nats_server.url, fake.url, "cpu-b")
            await workers_live(nc, 2)
            doomed.silence()
            _, generated, embedded = await asyncio.wait_for(asked, 40)
            moved = [e for e in events.events if isinstance(e, TaskRouted) and e.attempt == 2]

    assert sorted(e.worker for e in moved) == ["cpu-b"] * 3
    assert "pictures" in {e.domain for e in moved}
    assert (generated.status, embedded.status) == ("done", "done")
    assert embedded.embeddings is not None and len(embedded.embeddings) == 2
    sent = fake.last()
    chat_body = sent["last_chat"]
    assert chat_body["messages"] == CHAT["messages"]
    for name in ("tools", "format", "options", "keep_alive", "think"):
        assert chat_body[name] == CHAT[name], name
    generate_body = sent["last_generate"]
    for name in ("prompt", "suffix", "images", "format", "options", "keep_alive", "think"):
        assert generate_body[name] == GENERATE[name], name
    embed_body = sent["last_embed"]
    for name in ("input", "truncate", "dimensions", "keep_alive", "options"):
        assert embed_body[name] == EMBED[name], name
    # The chat was streamed by the attempt that ran it: pieces, then the whole answer.
    final = msgspec.json.decode(finals[0], type=RouteReply)
    assert final.status == "done"
    streamed = [c for c in chunks if c.seq > 0]
    assert streamed and {c.attempt for c in streamed} == {2}
    assert "".join(c.response for c in streamed) == final.response


async def _routed(events: TaskEvents, count: int) -> bool:
    return len([e for e in events.events if isinstance(e, TaskRouted)]) >= count
