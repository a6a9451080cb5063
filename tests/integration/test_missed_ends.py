"""An end the router's subscription missed still reaches the waiting client, in seconds.

The router hears outcomes on a plain subscription: what is published while it reconnects
(or while it is cut off from the node that stores the event by replication) never reaches
it. It asks the stream for the ends of the tasks it has waited on for a while
(`services.router.ending.recheck_ends`), instead of at the task's timeout. Here the router
reaches nats-server through a relay that drops its connection, and refuses a new one, while
the worker (connected directly) completes the task.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import suppress

import pytest
from nats.aio.client import Client

from devtools.fakes.ollama import FakeOllama
from devtools.servers import NatsServer
from schemas.subjects import ROUTE
from services.runtime.request import new_task_id
from tests.harness import ServiceRunner, eventually, last_task_event, request, workers_live
from tests.reaper_harness import MODEL
from tests.relay import Relay


@pytest.fixture
async def relay(nats_server: NatsServer) -> AsyncIterator[Relay]:
    """Up until the services using it have stopped (set up before them, torn down after)."""
    async with Relay(nats_server.port).running() as running:
        yield running


async def test_an_end_published_while_the_router_reconnected_reaches_its_waiting_client(
    relay: Relay, nats_server: NatsServer, nc: Client, ollama: FakeOllama, runner: ServiceRunner
) -> None:
    runner.router(relay.url)
    runner.worker(nats_server.url, ollama.url, "cpu-1")
    await workers_live(nc, 1)
    ollama.delay_s = 2.0
    task_id = new_task_id()
    body = {"prompt": "1+1", "model": MODEL, "wait": True, "timeout_s": 300, "task_id": task_id}
    asked = asyncio.create_task(request(nc, ROUTE, body, timeout_s=60))

    async def started() -> bool:
        with suppress(Exception):
            await last_task_event(nc.jetstream(), task_id, "started")
            return True
        return False

    await eventually(started, timeout_s=10)
    await relay.drop_for(4.0)  # the router is away while the worker completes the task

    # Well before the task's timeout (300 s), when the router would otherwise ask the stream.
    answer, _ = await asyncio.wait_for(asked, 20)

    assert answer["status"] == "done" and answer["task_id"] == task_id
