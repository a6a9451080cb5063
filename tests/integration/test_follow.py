"""Answers reach their clients: a route request names its task, and asking again with the same
id (after the router died, or the reply was lost) is answered as that task, never run twice."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time
from typing import Any

import msgspec
import ollama as ollama_client
import openai
import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import StreamInfo

from devtools.fakes.ollama import FakeOllama
from devtools.servers import NatsServer
from schemas.events import (
    Durations,
    TaskCompleted,
    TaskEvent,
    TaskFailed,
    TaskRouted,
    TaskStarted,
    TaskSubmitted,
)
from schemas.route import RouteReply
from schemas.work import Work
from services.runtime import outcomes
from services.runtime.bus import ensure_streams, publish_event
from services.runtime.request import new_task_id, stream_call
from tests.harness import (
    COORDINATOR,
    Processes,
    ServiceRunner,
    clean_env,
    error_of,
    eventually,
    last_task_event,
    request,
    workers_live,
)
from tests.integration.test_gateway import start_gateway
from tests.reaper_harness import no_live_worker_serving

MODEL = "qwen2.5:0.5b"


def start_router(processes: Processes, nats_server: NatsServer) -> subprocess.Popen[str]:
    return processes.start(
        [COORDINATOR, "router"], clean_env(NATS_URL=nats_server.url, WORKER_TTL_S="3")
    )


def kill(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)


async def count_events(nc: Client, task_id: str, kind: str) -> int:
    """How many ``kind`` events the log holds for the task, whoever recorded them."""
    js = nc.jetstream()
    info: StreamInfo = await js.stream_info("EVENTS", subjects_filter=f"events.task.{task_id}.>")
    subjects = info.state.subjects or {}
    return sum(n for subject, n in subjects.items() if subject.endswith(f".{kind}"))


async def started(nc: Client, task_id: str) -> bool:
    try:
        await last_task_event(nc.jetstream(), task_id, "started")
    except Exception:
        return False
    return True


async def test_a_client_whose_router_dies_while_it_waits_gets_the_answer_by_asking_again(
    nats_server: NatsServer,
    nc: Client,
    ollama: FakeOllama,
    runner: ServiceRunner,
    processes: Processes,
) -> None:
    first = start_router(processes, nats_server)
    runner.worker(nats_server.url, ollama.url, "cpu-1")
    await workers_live(nc, 1, timeout_s=30)
    ollama.delay_s = 3.0
    task_id = new_task_id()
    body = msgspec.json.encode({"prompt": "1+1", "model": MODEL, "wait": True, "task_id": task_id})

    async def ask() -> bytes:
        final = b""
        async for item in stream_call(nc, "coordinator.route", body, 60.0, reask_s=1.0):
            if isinstance(item, bytes):
                final = item
        return final

    asking = asyncio.create_task(ask())
    await eventually(lambda: started(nc, task_id), timeout_s=15)
    kill(first)  # the router that holds the waiting request, with the answer it would send
    start_router(processes, nats_server)
    reply = msgspec.json.decode(await asyncio.wait_for(asking, 30), type=RouteReply)

    assert (reply.task_id, reply.status, reply.response) == (task_id, "done", "2")
    # One task, run once: asking again submitted nothing.
    assert await count_events(nc, task_id, "submitted") == 1
    assert await count_events(nc, task_id, "started") == 1
    assert ollama.stats()["generate_calls"] + ollama.stats()["chat_calls"] >= 1


async def test_asking_again_for_a_task_that_ended_answers_it_at_once_without_running_it(
    nats_server: NatsServer, nc: Client, ollama: FakeOllama, runner: ServiceRunner
) -> None:
    runner.router(nats_server.url)
    runner.worker(nats_server.url, ollama.url, "cpu-1")
    await workers_live(nc, 1)
    task_id = new_task_id()
    ask: dict[str, Any] = {"prompt": "2+3", "model": MODEL, "wait": True, "task_id": task_id}
    first, _ = await request(nc, "coordinator.route", ask)
    calls = ollama.stats()

    again, _ = await request(nc, "coordinator.route", ask, timeout_s=5)
    queued, _ = await request(nc, "coordinator.route", {**ask, "wait": False}, timeout_s=5)

    assert first["status"] == again["status"] == "done"
    assert first["response"] == again["response"] == "5"
    assert again["worker"] == first["worker"] and again["task_id"] == task_id
    assert queued["status"] == "done"  # it has ended: said as it is
    assert ollama.stats() == calls
    assert await count_events(nc, task_id, "submitted") == 1


async def test_a_task_id_that_cannot_be_one_is_refused(
    nats_server: NatsServer, nc: Client, ollama: FakeOllama, runner: ServiceRunner
) -> None:
    runner.router(nats_server.url)
    runner.worker(nats_server.url, ollama.url, "cpu-1")
    await workers_live(nc, 1)
    for bad in ("a.b", "", "x" * 65, "with space", "*"):
        body, headers = await request(
            nc, "coordinator.route", {"prompt": "1+1", "model": MODEL, "task_id": bad}
        )
        assert headers["Nats-Service-Error-Code"] == "bad_request", bad
        assert "task_id must be 1 to 64 letters" in error_of(body).error.message


async def test_the_gateway_asks_again_when_its_router_dies_and_its_clients_get_whole_answers(
    nats_server: NatsServer,
    nc: Client,
    runner: ServiceRunner,
    processes: Processes,
) -> None:
    with FakeOllama(models=[MODEL]) as fake:
        first = start_router(processes, nats_server)
        runner.worker(nats_server.url, fake.url, "cpu-1")
        url = await start_gateway(runner, nats_server.url, gateway_reask_s=1.0)
        await workers_live(nc, 1, timeout_s=30)

        # A whole answer (the official ollama client) whose router dies while it waits.
        fake.delay_s = 3.0
        async with ollama_client.AsyncClient(host=url) as oc:
            chat = asyncio.create_task(
                oc.chat(model=MODEL, messages=[{"role": "user", "content": "what is 6*7"}])
            )
            await eventually(lambda: _running(nc), timeout_s=15)
            kill(first)
            second = start_router(processes, nats_server)
            answer = await asyncio.wait_for(chat, 30)
        assert answer.message.content == "42"

        # A stream (the official openai client) whose router dies mid-answer: the pieces
        # lost with it come with the end, and the text is whole.
        fake.delay_s = 0.0
        fake.chunk_delay_s = 0.3
        prompt = "tell me about " + " ".join(f"item{i}" for i in range(12))
        pieces: list[str] = []

        async def stream() -> None:
            async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused") as ai:
                chunks = await ai.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": prompt}], stream=True
                )
                async for chunk in chunks:
                    if chunk.choices and chunk.choices[0].delta.content:
                        pieces.append(chunk.choices[0].delta.content)

        async def some_pieces() -> bool:
            return len(pieces) >= 3

        streaming = asyncio.create_task(stream())
        await eventually(some_pieces, timeout_s=15)
        kill(second)
        start_router(processes, nats_server)
        await asyncio.wait_for(streaming, 40)
        assert "".join(pieces) == f"Echo from {MODEL}: {prompt}"


async def _running(nc: Client) -> bool:
    body, _ = await request(nc, "coordinator.workers", {}, timeout_s=2)
    return any(w.get("current_task") for w in body["workers"])


async def test_coordinator_ask_gets_its_answer_when_its_router_dies_while_it_waits(
    nats_server: NatsServer,
    nc: Client,
    ollama: FakeOllama,
    runner: ServiceRunner,
    processes: Processes,
) -> None:
    first = start_router(processes, nats_server)
    runner.worker(nats_server.url, ollama.url, "cpu-1")
    await workers_live(nc, 1, timeout_s=30)
    ollama.delay_s = 3.0
    ask = processes.start(
        [COORDINATOR, "ask", "what is 6*7", "--model", MODEL],
        clean_env(NATS_URL=nats_server.url),
    )
    await eventually(lambda: _running(nc), timeout_s=15)
    kill(first)
    start_router(processes, nats_server)
    # The command asks again after 10 s of silence (REASK_AFTER_S), naming its task.
    out, err = await asyncio.to_thread(ask.communicate, timeout=40)
    assert ask.returncode == 0, err
    assert out.strip() == "42"
    assert "done on cpu-1" in err


async def test_a_task_a_lagging_copy_of_the_log_misses_is_followed_not_refused(
    nats_server: NatsServer, nc: Client, runner: ServiceRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client asks again for a task another router submitted and a worker completed; the
    copy of the log this router reads first lags (a node that just rejoined the cluster), and
    no worker looks live to it (the registry's leader is being elected). It must not refuse
    ``no_worker``: before a refusal the stream's leader is asked, and the task is answered."""
    js = nc.jetstream()
    await ensure_streams(js, worker_ttl_s=3.0)
    task_id, now = new_task_id(), time.time()
    for event, by in (
        (
            TaskSubmitted(
                at=now, task_id=task_id, model=MODEL, timeout_s=60, work=Work(prompt="1+1")
            ),
            None,
        ),
        (
            TaskRouted(at=now, task_id=task_id, attempt=1, worker="cpu-1", queue="tasks.cpu.cpu-1"),
            None,
        ),
        (TaskStarted(at=now, task_id=task_id, attempt=1, worker="cpu-1", host="h"), "cpu-1"),
        (
            TaskCompleted(
                at=now,
                task_id=task_id,
                attempt=1,
                worker="cpu-1",
                model=MODEL,
                response="2",
                durations=Durations(total_ms=1),
            ),
            "cpu-1",
        ),
    ):
        await publish_event(js, event, by=by)
    read = outcomes.last_stored

    async def lagging(
        js: JetStreamContext, subject: str, *, leader: bool = False
    ) -> outcomes.Stored | None:
        return await read(js, subject, leader=True) if leader else None

    monkeypatch.setattr(outcomes, "last_stored", lagging)
    runner.router(nats_server.url)
    await eventually(lambda: _router_ready(nc), timeout_s=10)
    await no_live_worker_serving(nc, MODEL)

    body, _ = await request(
        nc, "coordinator.route", {"prompt": "1+1", "model": MODEL, "wait": True, "task_id": task_id}
    )

    assert (body["status"], body["task_id"], body["response"]) == ("done", task_id, "2")


def completed_by(worker: str, task_id: str, attempt: int = 1) -> TaskCompleted:
    return TaskCompleted(
        at=time.time(),
        task_id=task_id,
        attempt=attempt,
        worker=worker,
        model=MODEL,
        response="2",
        durations=Durations(total_ms=1),
    )


async def ran_then_moved(js: JetStreamContext, task_id: str, end: tuple[TaskEvent, str]) -> None:
    """A task routed to cpu-1, which ran it and stored ``end`` (event, recorded by), then
    routed again as attempt 2 by the reaper (a move that raced the end: no attempt 2 runs)."""
    await ensure_streams(js, worker_ttl_s=3.0)
    now = time.time()
    submitted = TaskSubmitted(
        at=now, task_id=task_id, model=MODEL, timeout_s=60, work=Work(prompt="1+1")
    )
    first = TaskRouted(at=now, task_id=task_id, attempt=1, worker="cpu-1", queue="tasks.cpu.cpu-1")
    started = TaskStarted(at=now, task_id=task_id, attempt=1, worker="cpu-1", host="h")
    moved = TaskRouted(
        at=now, task_id=task_id, attempt=2, worker="shared", queue="tasks.cpu.shared"
    )
    for event, by in ((submitted, None), (first, None), (started, "cpu-1"), end, (moved, None)):
        await publish_event(js, event, by=by)


async def ask_again(nc: Client, task_id: str, *, wait: bool) -> dict[str, Any]:
    ask = {"prompt": "1+1", "model": MODEL, "wait": wait, "task_id": task_id}
    body, _ = await request(nc, "coordinator.route", ask, timeout_s=10)
    return body


async def test_asking_again_for_a_task_whose_move_raced_its_end_is_answered_by_that_end(
    nats_server: NatsServer, nc: Client, runner: ServiceRunner
) -> None:
    """The worker's completion was stored, then the reaper's move (it had judged the worker
    lost a moment before) was stored too; the move went no further, so attempt 2 never ends.
    A client asking again gets attempt 1's answer, instead of waiting for attempt 2's."""
    task_id = new_task_id()
    await ran_then_moved(nc.jetstream(), task_id, (completed_by("cpu-1", task_id), "cpu-1"))
    runner.router(nats_server.url)
    await eventually(lambda: _router_ready(nc), timeout_s=10)

    body = await ask_again(nc, task_id, wait=True)

    assert (body["status"], body["response"], body["worker"]) == ("done", "2", "cpu-1")


@pytest.mark.parametrize(
    "end",
    [
        # what the move was for: a failure another worker may do better
        "retryable_failure",
        # recorded by a worker the attempt was never routed to
        "completed_elsewhere",
    ],
)
async def test_an_earlier_attempts_end_that_does_not_end_the_task_is_not_the_answer(
    nats_server: NatsServer, nc: Client, runner: ServiceRunner, end: str
) -> None:
    task_id = new_task_id()
    stored: tuple[TaskEvent, str] = (
        (
            TaskFailed(
                at=time.time(),
                task_id=task_id,
                attempt=1,
                worker="cpu-1",
                code="backend_error",
                reason="HTTP 500",
                retryable=True,
            ),
            "cpu-1",
        )
        if end == "retryable_failure"
        else (completed_by("cpu-2", task_id), "cpu-2")
    )
    await ran_then_moved(nc.jetstream(), task_id, stored)
    runner.router(nats_server.url)
    await eventually(lambda: _router_ready(nc), timeout_s=10)

    body = await ask_again(nc, task_id, wait=False)

    assert (body["status"], body["queue"]) == ("queued", "tasks.cpu.shared")


async def _router_ready(nc: Client) -> bool:
    try:
        await request(nc, "coordinator.workers", {}, timeout_s=1.0)
    except Exception:
        return False
    return True
