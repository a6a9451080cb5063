"""Streaming: pieces reach the client as the backend produces them; the answer is still an event."""

from __future__ import annotations

import asyncio

import msgspec
import nats
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from devtools.fakes.ollama import FakeOllama
from devtools.servers import NatsServer
from schemas.route import CHUNK_HEADER, RouteReply, StreamChunk
from schemas.subjects import chunk_subject
from services.errors import NoResponder, NoWorker, WaitTimeout
from services.runtime.endpoints import error_body
from services.runtime.request import stream_call
from tests.harness import (
    ServiceRunner,
    clean_env,
    request,
    run_cli,
    workers_live,
)


async def streamed(nc: Client, model: str, prompt: str) -> tuple[list[StreamChunk], RouteReply]:
    body = msgspec.json.encode({"prompt": prompt, "model": model, "stream": True})
    chunks: list[StreamChunk] = []
    final = b""
    async for item in stream_call(nc, "coordinator.route", body, timeout_s=20):
        if isinstance(item, bytes):
            final = item
        else:
            chunks.append(item)
    return chunks, msgspec.json.decode(final, type=RouteReply)


async def test_chunks_arrive_before_the_final_reply_and_add_up_to_the_answer(
    nats_server: NatsServer, nc: Client, ollama: FakeOllama, runner: ServiceRunner
) -> None:
    runner.router(nats_server.url)
    runner.worker(nats_server.url, ollama.url, "cpu-1")
    await workers_live(nc, 1)
    ollama.chunk_delay_s = 0.02

    chunks, reply = await streamed(nc, "qwen2.5:0.5b", "tell me about the weather today")

    assert reply.status == "done"
    assert len(chunks) > 3
    # seq 0 (no text) names the task before any output; the pieces follow in order.
    assert [c.seq for c in chunks] == list(range(len(chunks)))
    assert not (chunks[0].response or chunks[0].thinking)
    assert chunks[0].task_id == reply.task_id
    assert "".join(c.response for c in chunks) == reply.response
    completed = await nc.jetstream().get_last_msg(
        "EVENTS", f"events.task.{reply.task_id}.*.completed"
    )
    durations = msgspec.json.decode(completed.data or b"")["durations"]
    assert 0 < durations["first_token_ms"] <= durations["total_ms"]


async def test_thinking_streams_apart_from_the_answer(
    nats_server: NatsServer, nc: Client, runner: ServiceRunner
) -> None:
    with FakeOllama(models=["qwen3:0.6b"]) as thinker:
        runner.router(nats_server.url)
        runner.worker(nats_server.url, thinker.url, "cpu-1")
        await workers_live(nc, 1)

        chunks, reply = await streamed(nc, "qwen3:0.6b", "1+1は？")

    assert reply.response == "2"
    assert reply.thinking
    assert "".join(c.thinking for c in chunks) == reply.thinking
    assert "".join(c.response for c in chunks) == "2"


async def test_a_refused_stream_request_ends_with_the_error(
    nats_server: NatsServer, nc: Client, ollama: FakeOllama, runner: ServiceRunner
) -> None:
    runner.router(nats_server.url)
    runner.worker(nats_server.url, ollama.url, "cpu-1")
    await workers_live(nc, 1)
    body, headers = await request(
        nc, "coordinator.route", {"prompt": "x", "model": "nope", "stream": True}
    )
    assert headers["Nats-Service-Error-Code"] == "no_worker", body


async def test_ask_stream_prints_the_answer(
    nats_server: NatsServer, nc: Client, ollama: FakeOllama, runner: ServiceRunner
) -> None:
    runner.router(nats_server.url)
    runner.worker(nats_server.url, ollama.url, "cpu-1")
    await workers_live(nc, 1)

    result = await asyncio.to_thread(
        run_cli,
        "ask",
        "1+1は？",
        "--model",
        "qwen2.5:0.5b",
        "--stream",
        env=clean_env(NATS_URL=nats_server.url),
    )

    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "2"


async def test_a_chunk_from_a_worker_the_task_does_not_run_on_never_reaches_the_client(
    nats_server: NatsServer, nc: Client, ollama: FakeOllama, runner: ServiceRunner
) -> None:
    """Workers stream on ``coordinator.chunk.<own id>.<task>`` and the router passes on only
    the chunks of the worker the task was routed to: a forged one is dropped."""
    runner.router(nats_server.url)
    runner.worker(nats_server.url, ollama.url, "cpu-1")
    await workers_live(nc, 1)
    ollama.chunk_delay_s = 0.05
    body = msgspec.json.encode({"prompt": "tell me a long story", "model": "qwen2.5:0.5b"})
    body = body[:-1] + b',"stream":true}'
    chunks: list[StreamChunk] = []
    final = b""
    async for item in stream_call(nc, "coordinator.route", body, timeout_s=20):
        if isinstance(item, bytes):
            final = item
            continue
        chunks.append(item)
        if item.seq == 1:  # the real stream has begun: forge a piece under another worker
            forged = StreamChunk(task_id=item.task_id, seq=2, response="FORGED")
            for sender in ("cpu-2", "shared"):
                await nc.publish(
                    chunk_subject(sender, item.task_id),
                    msgspec.json.encode(forged),
                    headers={CHUNK_HEADER: "2"},
                )
    reply = msgspec.json.decode(final, type=RouteReply)

    assert reply.status == "done" and reply.worker == "cpu-1"
    assert "FORGED" not in "".join(c.response for c in chunks)
    assert [c.seq for c in chunks] == list(range(len(chunks)))
    assert "".join(c.response for c in chunks) == reply.response


async def test_a_service_that_takes_a_request_and_never_answers_is_a_wait_timeout(
    nats_server: NatsServer,
) -> None:
    """A streamed request whose service stays silent for its whole wait ends in `WaitTimeout`
    (the gateway's 504), not in the "nobody answers" of a stack that is not running."""
    nc = await nats.connect(nats_server.url)
    try:
        taken = await nc.subscribe("silent.service")  # takes the request, answers nothing
        with pytest.raises(WaitTimeout, match=r"nothing arrived for 0\.5 s"):
            async for _ in stream_call(nc, "silent.service", b"{}", timeout_s=0.5):
                pass
        assert (await taken.next_msg(timeout=1)).data == b"{}"
        with pytest.raises(NoResponder):  # nobody listens at all
            async for _ in stream_call(nc, "nobody.listens", b"{}", timeout_s=5):
                pass
    finally:
        await nc.close()


class _Refuser:
    """A service that takes a request and stays silent until it is asked again, then refuses
    on the first reply subject (a router's stale answer, held up), and answers ``final`` on
    any later reply subject (a router that follows the task another one recorded)."""

    def __init__(self, nc: Client, final: bytes | None) -> None:
        self.nc = nc
        self.final = final
        self.asked: list[str] = []

    async def on_request(self, msg: Msg) -> None:
        self.asked.append(msg.reply)
        first = self.asked[0]
        if msg.reply == first and len(self.asked) == 2:  # asked again: the stale refusal
            await self.nc.publish(
                first,
                error_body("no_worker", "no live worker serves model 'm'"),
                headers={"Nats-Service-Error-Code": "no_worker", "Nats-Service-Error": "no"},
            )
        elif msg.reply != first:
            if self.final is None:
                await self.nc.publish(
                    msg.reply,
                    error_body("no_worker", "still no live worker"),
                    headers={"Nats-Service-Error-Code": "no_worker", "Nats-Service-Error": "no"},
                )
            else:
                await self.nc.publish(msg.reply, self.final)


async def test_a_refusal_after_asking_again_is_checked_on_a_fresh_reply_subject(
    nats_server: NatsServer,
) -> None:
    """A router that took the first copy of a request may refuse it late, after another
    router recorded and ran the task from a copy asked again; its refusal is not the answer.
    The request is asked again on a reply subject nothing earlier can reach, and that answer
    is taken: the task as recorded, or the refusal when it is one still."""
    nc = await nats.connect(nats_server.url)
    try:
        ran = _Refuser(nc, final=b'{"status": "done"}')
        await nc.subscribe("route.ran", cb=ran.on_request)
        items = [i async for i in stream_call(nc, "route.ran", b"{}", 10, reask_s=0.3)]
        assert items == [b'{"status": "done"}']
        assert len(set(ran.asked)) == 2  # the first reply subject, then a fresh one

        refused = _Refuser(nc, final=None)
        await nc.subscribe("route.refused", cb=refused.on_request)
        with pytest.raises(NoWorker, match="still no live worker"):
            async for _ in stream_call(nc, "route.refused", b"{}", 10, reask_s=0.3):
                pass

        once: list[str] = []  # refused at once: nothing was asked again, nothing to check

        async def refuse_now(msg: Msg) -> None:
            once.append(msg.reply)
            await nc.publish(
                msg.reply,
                error_body("no_worker", "no live worker"),
                headers={"Nats-Service-Error-Code": "no_worker", "Nats-Service-Error": "no"},
            )

        await nc.subscribe("route.once", cb=refuse_now)
        with pytest.raises(NoWorker):
            async for _ in stream_call(nc, "route.once", b"{}", 10, reask_s=5):
                pass
        assert len(once) == 1
    finally:
        await nc.close()
