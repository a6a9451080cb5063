"""A client asks again by itself, for a bounded time, while nobody can serve its request just
now: no router started yet, or JetStream away (here the nats-server is replaced, on its port,
by one without JetStream: requests still reach the services and every JetStream call of theirs
fails, as while a cluster elects a stream's leader). It is answered once somebody can, as the
one task it named; past its bound it fails, saying how long it asked."""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import nats
import pytest
from nats.aio.client import Client
from structlog.testing import capture_logs

from devtools.fakes.ollama import FakeOllama
from devtools.servers import NatsServer, nats_server_binary, wait_for_port
from schemas.route import RouteReply
from schemas.subjects import ROUTE, WORKERS
from services.errors import CoordinatorError, NoResponder, Unavailable
from services.runtime.request import call, new_task_id, stream_call
from tests.harness import ServiceRunner, clean_env, eventually, request, run_cli, workers_live
from tests.integration.test_follow import count_events
from tests.integration.test_processes import workers_live_via_kv

MODEL = "qwen2.5:0.5b"
# Long enough that only a fault, never a slow machine, exhausts it: the tests that expect an
# answer do not race the bound.
PATIENT_S = 60.0


@pytest.fixture
async def client(nats_server: NatsServer) -> AsyncIterator[Client]:
    """A client that rides out the server's restarts."""
    nc = await nats.connect(nats_server.url, max_reconnect_attempts=-1, reconnect_time_wait=0.2)
    yield nc
    await nc.close()


class Unserved:
    """What a request's ``on_unserved`` was told, and when."""

    def __init__(self) -> None:
        self.errors: list[CoordinatorError] = []
        self.told = asyncio.Event()

    def __call__(self, exc: CoordinatorError, within_s: float) -> None:
        self.errors.append(exc)
        self.told.set()


def take_jetstream_away(server: NatsServer) -> subprocess.Popen[bytes]:
    """``server`` stopped, and a nats-server without JetStream on its port instead."""
    server.stop()
    bare = subprocess.Popen(
        [nats_server_binary(), "-a", server.host, "-p", str(server.port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wait_for_port(server.port, host=server.host)
    return bare


def bring_jetstream_back(server: NatsServer, bare: subprocess.Popen[bytes]) -> None:
    """The server without JetStream stopped, and ``server`` started again on its store."""
    bare.terminate()
    bare.wait(10)
    server.start()


async def route_reply(nc: Client, ask: dict[str, Any], unserved: Unserved, within_s: float) -> Any:
    final = b""
    async for item in stream_call(
        nc,
        ROUTE,
        msgspec.json.encode(ask),
        PATIENT_S,
        reask_s=2.0,
        unserved_s=within_s,
        on_unserved=unserved,
    ):
        if isinstance(item, bytes):
            final = item
    return msgspec.json.decode(final, type=RouteReply)


async def router_answers(nc: Client) -> bool:
    """The router is connected: ``coordinator.workers`` needs no JetStream to answer."""
    try:
        await request(nc, WORKERS, {}, timeout_s=1.0)
    except Exception:
        return False
    return True


async def test_an_ask_made_before_any_router_runs_is_answered_once_one_starts(
    nats_server: NatsServer, client: Client, ollama: FakeOllama, runner: ServiceRunner
) -> None:
    runner.worker(nats_server.url, ollama.url, "cpu-1")
    await workers_live_via_kv(client, "cpu-1")  # registered: the router will find it
    task_id = new_task_id()
    asked = Unserved()
    listed = Unserved()
    asking = asyncio.create_task(
        route_reply(
            client,
            {"prompt": "1+1", "model": MODEL, "wait": True, "task_id": task_id},
            asked,
            PATIENT_S,
        )
    )
    listing = asyncio.create_task(
        call(client, WORKERS, b"{}", 5.0, unserved_s=PATIENT_S, on_unserved=listed)
    )
    await asyncio.wait_for(asked.told.wait(), PATIENT_S)
    await asyncio.wait_for(listed.told.wait(), PATIENT_S)
    runner.router(nats_server.url)

    reply = await asyncio.wait_for(asking, PATIENT_S)
    workers = msgspec.json.decode(await asyncio.wait_for(listing, PATIENT_S))

    assert [e.code for e in asked.errors + listed.errors] == ["no_responder", "no_responder"]
    assert (reply.task_id, reply.status, reply.response) == (task_id, "done", "2")
    assert await count_events(client, task_id, "submitted") == 1
    assert await count_events(client, task_id, "started") == 1
    assert "workers" in workers


async def test_an_ask_while_jetstream_is_away_is_answered_once_it_is_back_and_runs_once(
    nats_server: NatsServer, client: Client, ollama: FakeOllama, runner: ServiceRunner
) -> None:
    runner.router(nats_server.url)
    runner.worker(nats_server.url, ollama.url, "cpu-1")
    await workers_live(client, 1)
    bare = await asyncio.to_thread(take_jetstream_away, nats_server)
    try:
        await eventually(lambda: router_answers(client), timeout_s=30)
        task_id = new_task_id()
        unserved = Unserved()
        ask = {"prompt": "2+3", "model": MODEL, "wait": True, "task_id": task_id}
        asking = asyncio.create_task(route_reply(client, ask, unserved, PATIENT_S))
        await asyncio.wait_for(unserved.told.wait(), PATIENT_S)
    finally:
        await asyncio.to_thread(bring_jetstream_back, nats_server, bare)

    reply = await asyncio.wait_for(asking, PATIENT_S)

    [said] = unserved.errors
    assert isinstance(said, Unavailable)
    assert "a JetStream leader being chosen" in said.message
    assert (reply.task_id, reply.status, reply.response) == (task_id, "done", "5")
    assert await count_events(client, task_id, "submitted") == 1
    assert await count_events(client, task_id, "started") == 1


async def test_asked_past_its_bound_a_request_fails_saying_how_long_it_asked(
    nats_server: NatsServer, client: Client, ollama: FakeOllama, runner: ServiceRunner
) -> None:
    runner.router(nats_server.url)
    runner.worker(nats_server.url, ollama.url, "cpu-1")
    await workers_live(client, 1)
    bare = await asyncio.to_thread(take_jetstream_away, nats_server)
    try:
        await eventually(lambda: router_answers(client), timeout_s=30)
        unserved = Unserved()
        ask = {"prompt": "1+1", "model": MODEL, "wait": True, "task_id": new_task_id()}
        with pytest.raises(Unavailable) as routed:
            await route_reply(client, ask, unserved, 1.0)
        with pytest.raises(NoResponder) as queried:
            await call(client, "coordinator.task", b"{}", 5.0, unserved_s=1.0)
    finally:
        await asyncio.to_thread(bring_jetstream_back, nats_server, bare)

    assert len(unserved.errors) == 1
    assert routed.value.message.startswith(
        "coordinator.route was still unavailable after asking again for 1 s: NATS did not "
        "serve this request (ServiceUnavailableError)"
    )
    assert queried.value.message == (
        "no service answered coordinator.task in 1 s of asking: is the stack running?"
    )


async def test_a_request_not_answered_in_time_is_not_asked_again(
    nats_server: NatsServer, client: Client
) -> None:
    silent = await client.subscribe("coordinator.silent")  # takes requests, answers none
    unserved = Unserved()
    with pytest.raises(NoResponder) as raised:
        await call(
            client, "coordinator.silent", b"{}", 0.5, unserved_s=PATIENT_S, on_unserved=unserved
        )
    await client.flush()

    assert raised.value.message == "coordinator.silent did not answer within 0.5 s"
    assert unserved.errors == []
    assert silent.pending_msgs == 1  # asked once


async def test_the_cli_asks_again_and_then_fails_clearly_and_a_change_is_asked_once(
    nats_server: NatsServer, client: Client, ollama: FakeOllama, runner: ServiceRunner
) -> None:
    runner.router(nats_server.url)
    runner.worker(nats_server.url, ollama.url, "cpu-1")
    await workers_live(client, 1)
    env = clean_env(NATS_URL=nats_server.url)
    bare = await asyncio.to_thread(take_jetstream_away, nats_server)
    try:
        await eventually(lambda: router_answers(client), timeout_s=30)
        asked, queried, changed = await asyncio.gather(
            asyncio.to_thread(run_cli, "ask", "1+1", "--model", MODEL, env=env),
            # No stats service: nobody listens on its subjects.
            asyncio.to_thread(run_cli, "task", "some-task", env=env),
            asyncio.to_thread(run_cli, "alias", "add", "old:1b", MODEL, env=env),
        )
    finally:
        await asyncio.to_thread(bring_jetstream_back, nats_server, bare)

    unavailable = (
        "NATS did not serve this request (ServiceUnavailableError): a JetStream leader being "
        "chosen, or a network fault; ask again"
    )
    assert asked.returncode == 1
    assert asked.stderr.splitlines() == [
        f"asking again for up to 10 s: unavailable: {unavailable}",
        "error unavailable: coordinator.route was still unavailable after asking again for "
        f"10 s: {unavailable}",
    ]
    assert queried.returncode == 1
    assert queried.stderr.splitlines() == [
        "asking again for up to 10 s: no_responder: no service answers coordinator.task: is "
        "the stack running?",
        "error no_responder: no service answered coordinator.task in 10 s of asking: is the "
        "stack running?",
    ]
    assert changed.returncode == 1
    assert changed.stderr.splitlines() == [
        "error no_responder: no service answers coordinator.stats.alias.add: is the stack running?"
    ]


async def test_a_worker_started_while_jetstream_is_away_waits_for_it_as_in_its_own_process(
    nats_server: NatsServer, client: Client, ollama: FakeOllama, runner: ServiceRunner
) -> None:
    """A service run beside others waits for JetStream until its own stop, as it does in its
    own process: it never gives up at the first unanswered request (the harness once ran its
    services as one-shot commands, and a worker whose consumer's creation went unanswered
    during a test's outage ended, failing a later task for want of it)."""
    runner.router(nats_server.url)
    bare = await asyncio.to_thread(take_jetstream_away, nats_server)
    try:
        with capture_logs() as logs:
            worker = runner.worker(nats_server.url, ollama.url, "cpu-1")

            async def waiting() -> bool:
                return any(e["event"] == "JetStream does not answer; asking again" for e in logs)

            await eventually(waiting, timeout_s=30)
        assert not worker.done()
    finally:
        await asyncio.to_thread(bring_jetstream_back, nats_server, bare)
    await workers_live(client, 1, timeout_s=30)
    reply = await asyncio.wait_for(
        route_reply(
            client,
            {"prompt": "2+3", "model": MODEL, "wait": True, "task_id": new_task_id()},
            Unserved(),
            PATIENT_S,
        ),
        PATIENT_S,
    )
    assert (reply.status, reply.response) == ("done", "5")
