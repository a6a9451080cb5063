"""A task message settled as the connection goes down is not lost: the worker's next task does
not wait out the ack wait, and nobody takes the worker's queue for a ghost.

The worker reaches nats-server through a relay (`tests.relay`) that closes its connection the
moment given bytes pass, without passing them on: its acknowledgement of a finished task, or
the delivery of the next one. Its consumer's ack wait is two minutes, so a settlement that
were simply lost would hold the next task for that long (and a reaper judging the queue a ghost
after seconds would fail a task asked of this worker by name).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from nats.aio.client import Client
from structlog.testing import capture_logs

from devtools.fakes.ollama import FakeOllama
from devtools.servers import NatsServer
from schemas.subjects import ROUTE, TASKS_STREAM, worker_consumer
from tests.harness import ServiceRunner, eventually, request, workers_live
from tests.reaper_harness import MODEL
from tests.relay import Relay

WORKER = "cpu-1"
# Long enough that a task held by a lost settlement could not end within the test's wait.
ACK_WAIT_S = 120.0


@pytest.fixture
async def relay(nats_server: NatsServer) -> AsyncIterator[Relay]:
    async with Relay(nats_server.port).running() as running:
        yield running


async def ask(nc: Client, prompt: str) -> dict[str, object]:
    """A task asked of the worker by name, waited for (well within the ack wait)."""
    body = {"prompt": prompt, "model": MODEL, "worker": WORKER, "wait": True, "timeout_s": 60}
    answer, _ = await request(nc, ROUTE, body, timeout_s=30)
    return answer


async def start_fleet(
    runner: ServiceRunner, nats_server: NatsServer, relay: Relay, ollama: FakeOllama, nc: Client
) -> None:
    runner.router(nats_server.url)
    runner.reaper(nats_server.url)
    runner.worker(relay.url, ollama.url, WORKER, ack_wait_s=ACK_WAIT_S)
    await workers_live(nc, 1)


async def test_an_acknowledgement_lost_with_the_connection_is_sent_again(
    relay: Relay, nats_server: NatsServer, nc: Client, ollama: FakeOllama, runner: ServiceRunner
) -> None:
    await start_fleet(runner, nats_server, relay, ollama, nc)
    cut = relay.cut_on(b"+ACK", upstream=True)
    with capture_logs() as logs:
        first = await ask(nc, "1+1")
        assert first["status"] == "done", first
        # The acknowledgement goes out once the outcome is stored, after the answer: the first
        # one never reaches the server.
        await asyncio.wait_for(cut.wait(), 10)

        second = await ask(nc, "2+2")

    assert second["status"] == "done" and second["worker"] == WORKER, second
    again = [e for e in logs if e["event"] == "task message settled after a bus outage"]
    assert again and again[0]["verb"] == "+ACK", again

    async def settled() -> bool:
        info = await nc.jetstream().consumer_info(TASKS_STREAM, worker_consumer(WORKER))
        assert info.num_redelivered == 0  # nothing waited out its ack wait
        return bool(info.num_ack_pending == 0)

    await eventually(settled)


async def test_a_delivery_lost_with_the_connection_is_handed_out_again_at_once(
    relay: Relay, nats_server: NatsServer, nc: Client, ollama: FakeOllama, runner: ServiceRunner
) -> None:
    await start_fleet(runner, nats_server, relay, ollama, nc)
    cut = relay.cut_on(b"$JS.ACK." + TASKS_STREAM.encode(), upstream=False)
    with capture_logs() as logs:
        answer = await ask(nc, "1+1")

    assert cut.is_set()  # the task's first delivery never reached the worker
    assert answer["status"] == "done" and answer["worker"] == WORKER, answer
    recovered = [e for e in logs if e["event"].startswith("a task handed out as the connection")]
    assert recovered, [e["event"] for e in logs]
    assert [c["prompt"] for c in ollama.calls()].count("1+1") == 1  # run once
