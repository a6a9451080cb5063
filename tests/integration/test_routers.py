"""Any number of routers serve one fleet: a waiting client gets exactly one answer for one
task run once, whichever router took its request and whichever it asks again (dead or
alive), and a cancel works whichever router takes it."""

from __future__ import annotations

import asyncio
import signal
import time
from typing import Any

import msgspec
import nats
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from devtools.fakes.ollama import FakeOllama
from devtools.servers import NatsServer
from schemas.route import CHUNK_HEADER, HoldsQuery, HoldsReply, RouteReply
from schemas.subjects import ROUTE, ROUTER_HOLDS
from services.router.peers import Peers
from services.router.waiting import ANSWERED_HOLD_S
from services.runtime.bus import flush_written
from services.runtime.request import new_task_id
from tests.harness import (
    COORDINATOR,
    Processes,
    ServiceRunner,
    clean_env,
    eventually,
    request,
    workers_live,
)
from tests.integration.test_follow import count_events, started
from tests.process_logs import ProcessLog
from tests.reaper_harness import MODEL, no_live_worker_serving

# After the answer, how long the client keeps listening for a second one.
LISTEN_AFTER_S = 3.0


def start_router(processes: Processes, nats_server: NatsServer) -> ProcessLog:
    return ProcessLog(
        processes.start(
            [COORDINATOR, "router"], clean_env(NATS_URL=nats_server.url, WORKER_TTL_S="3")
        )
    )


def kill(router: ProcessLog) -> None:
    router.proc.send_signal(signal.SIGKILL)
    router.proc.wait(10)


def handled(router: ProcessLog, event: str, task_id: str) -> bool:
    return any(line.get("task_id") == task_id for line in router.events(event))


class WaitingClient:
    """A client that waits for a route request on an inbox of its own, asks again with the
    same body after each silence of ``reask_s``, and counts every answer that reaches it."""

    def __init__(self, nc: Client, body: dict[str, Any], reask_s: float) -> None:
        self.nc = nc
        self.body = msgspec.json.encode(body)
        self.reask_s = reask_s
        self.inbox = nc.new_inbox()
        self.finals: list[bytes] = []
        self.asked = 0
        self._sub: Subscription | None = None

    async def ask(self) -> None:
        self.asked += 1
        await self.nc.publish("coordinator.route", self.body, reply=self.inbox)

    async def answer(self, timeout_s: float = 60.0) -> RouteReply:
        """The first final reply (chunks and 503s skipped), asking again on silences; then
        keeps listening `LISTEN_AFTER_S` for any other."""
        self._sub = await self.nc.subscribe(self.inbox)
        await self.ask()
        deadline = time.monotonic() + timeout_s
        while not self.finals:
            assert time.monotonic() < deadline, "no answer"
            try:
                msg = await self._sub.next_msg(timeout=self.reask_s)
            except TimeoutError:
                await self.ask()
                continue
            headers = msg.headers or {}
            if CHUNK_HEADER not in headers and headers.get("Status") != "503":
                self.finals.append(msg.data)
        listen_until = time.monotonic() + LISTEN_AFTER_S
        while (left := listen_until - time.monotonic()) > 0:
            try:
                msg = await self._sub.next_msg(timeout=left)
            except TimeoutError:
                break
            if CHUNK_HEADER not in (msg.headers or {}):
                self.finals.append(msg.data)
        await self._sub.unsubscribe()
        return msgspec.json.decode(self.finals[0], type=RouteReply)


async def test_a_waiting_client_survives_the_kill_of_the_router_that_took_its_request(
    nats_server: NatsServer,
    nc: Client,
    ollama: FakeOllama,
    runner: ServiceRunner,
    processes: Processes,
) -> None:
    routers = [start_router(processes, nats_server) for _ in range(2)]
    for router in routers:
        await router.wait_for("router ready")
    runner.worker(nats_server.url, ollama.url, "cpu-1")
    await workers_live(nc, 1, timeout_s=30)
    ollama.delay_s = 3.0
    task_id = new_task_id()
    client = WaitingClient(
        nc, {"prompt": "1+1", "model": MODEL, "wait": True, "task_id": task_id}, reask_s=1.0
    )
    answering = asyncio.create_task(client.answer())

    async def running() -> bool:
        return await started(nc, task_id)

    await eventually(running, timeout_s=15)
    took = [r for r in routers if handled(r, "routed", task_id)]
    assert len(took) == 1
    kill(took[0])  # whichever it was, with the answer it would have sent
    survivor = next(r for r in routers if r is not took[0])
    reply = await asyncio.wait_for(answering, 60)

    assert (reply.task_id, reply.status, reply.response) == (task_id, "done", "2")
    assert len(client.finals) == 1 and client.asked >= 2
    assert handled(survivor, "followed", task_id)
    assert await count_events(nc, task_id, "submitted") == 1
    assert await count_events(nc, task_id, "started") == 1


async def test_a_client_asking_again_of_the_other_router_while_the_first_lives_gets_one_answer(
    nats_server: NatsServer,
    nc: Client,
    ollama: FakeOllama,
    runner: ServiceRunner,
    processes: Processes,
) -> None:
    routers = [start_router(processes, nats_server) for _ in range(2)]
    for router in routers:
        await router.wait_for("router ready")
    runner.worker(nats_server.url, ollama.url, "cpu-1")
    await workers_live(nc, 1, timeout_s=30)
    ollama.delay_s = 5.0
    task_id = new_task_id()
    # Asked again about fifteen times while the task runs: the queue group sends some of
    # them to the router that does not hold the request.
    client = WaitingClient(
        nc, {"prompt": "2+3", "model": MODEL, "wait": True, "task_id": task_id}, reask_s=0.3
    )
    reply = await client.answer()

    assert (reply.status, reply.response) == ("done", "5")
    assert len(client.finals) == 1, client.finals
    holder = next(r for r in routers if handled(r, "routed", task_id))
    other = next(r for r in routers if r is not holder)
    assert handled(other, "asked again; another router answers it", task_id)
    assert await count_events(nc, task_id, "submitted") == 1
    assert await count_events(nc, task_id, "started") == 1


async def test_an_ask_that_crosses_the_answer_gets_none_and_a_later_one_gets_it_again(
    nats_server: NatsServer,
    nc: Client,
    ollama: FakeOllama,
    runner: ServiceRunner,
    processes: Processes,
) -> None:
    routers = [start_router(processes, nats_server) for _ in range(2)]
    for router in routers:
        await router.wait_for("router ready")
    runner.worker(nats_server.url, ollama.url, "cpu-1")
    await workers_live(nc, 1, timeout_s=30)
    task_id = new_task_id()
    body = msgspec.json.encode({"prompt": "1+1", "model": MODEL, "wait": True, "task_id": task_id})
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)

    async def ask_and_listen(listen_s: float, *, until_one: bool = False) -> list[RouteReply]:
        await nc.publish(ROUTE, body, reply=inbox)
        finals: list[RouteReply] = []
        deadline = time.monotonic() + listen_s
        while (left := deadline - time.monotonic()) > 0 and not (until_one and finals):
            try:
                msg = await sub.next_msg(timeout=left)
            except TimeoutError:
                break
            finals.append(msgspec.json.decode(msg.data, type=RouteReply))
        return finals

    first = await ask_and_listen(30.0, until_one=True)
    # Asked again the moment the answer came, as a client does whose timer fired while the
    # answer was on its way: whichever router takes it, silence (nor a second answer to the
    # first ask).
    crossed = await ask_and_listen(1.0)
    # Asked again later, as a client does whose answer was lost: answered, once.
    await asyncio.sleep(ANSWERED_HOLD_S)
    later = await ask_and_listen(LISTEN_AFTER_S)
    await sub.unsubscribe()

    assert [(r.task_id, r.status, r.response) for r in first] == [(task_id, "done", "2")]
    assert crossed == []
    assert [(r.task_id, r.status, r.response) for r in later] == [(task_id, "done", "2")]
    assert await count_events(nc, task_id, "started") == 1


async def test_a_cancel_works_whichever_router_takes_it(
    nats_server: NatsServer,
    nc: Client,
    ollama: FakeOllama,
    runner: ServiceRunner,
    processes: Processes,
) -> None:
    first = start_router(processes, nats_server)
    await first.wait_for("router ready")
    runner.worker(nats_server.url, ollama.url, "cpu-1")
    await workers_live(nc, 1, timeout_s=30)
    ollama.delay_s = 6.0
    busy, _ = await request(nc, "coordinator.route", {"prompt": "1+1", "model": MODEL})

    async def busy_runs() -> bool:
        return await started(nc, busy["task_id"])

    await eventually(busy_runs, timeout_s=15)
    # Queued behind it, both routed by the first router: one a client waits on without its
    # id, one by id, routed before the second router started.
    waiting = WaitingClient(nc, {"prompt": "2+2", "model": MODEL, "wait": True}, reask_s=60.0)
    answering = asyncio.create_task(waiting.answer())
    queued, _ = await request(nc, "coordinator.route", {"prompt": "3+3", "model": MODEL})
    await eventually(lambda: _routed_twice(first), timeout_s=10)
    waited_on = next(
        line["task_id"]
        for line in first.events("routed")
        if line["task_id"] != busy["task_id"] and line["task_id"] != queued["task_id"]
    )
    second = start_router(processes, nats_server)
    await second.wait_for("router ready")

    # Each cancel reaches either router; every one of them is taken, until the second
    # router has taken one of each kind.
    for cancel, task_id in (
        ({"reply_to": waiting.inbox}, waited_on),
        ({"task_id": queued["task_id"]}, queued["task_id"]),
    ):
        for _ in range(30):
            body, headers = await request(
                nc, "coordinator.cancel", {**cancel, "reason": "test"}, timeout_s=5
            )
            assert "Nats-Service-Error-Code" not in headers, body
            assert body == {"task_id": task_id, "status": "cancelling"}
            if handled(second, "cancel requested", task_id):
                break
        assert handled(second, "cancel requested", task_id)

    reply = await asyncio.wait_for(answering, 30)
    assert reply.status == "failed" and reply.failure is not None
    assert reply.failure.code == "cancelled"
    for task_id in (waited_on, queued["task_id"]):
        assert await count_events(nc, task_id, "started") == 0

    # A task that has ended is refused by whichever router takes the cancel.
    for _ in range(6):
        body, headers = await request(
            nc, "coordinator.cancel", {"task_id": busy["task_id"]}, timeout_s=5
        )
        assert headers.get("Nats-Service-Error-Code") == "not_found", body


async def _routed_twice(router: ProcessLog) -> bool:
    return router.count("routed") >= 3


async def test_a_router_started_while_tasks_run_counts_them_as_the_other_does(
    nats_server: NatsServer,
    nc: Client,
    ollama: FakeOllama,
    runner: ServiceRunner,
    processes: Processes,
) -> None:
    first = start_router(processes, nats_server)
    await first.wait_for("router ready")
    runner.worker(nats_server.url, ollama.url, "cpu-1")
    await workers_live(nc, 1, timeout_s=30)
    ollama.delay_s = 10.0
    for prompt in ("1+1", "2+2"):  # one running, one queued behind it
        await request(nc, "coordinator.route", {"prompt": prompt, "model": MODEL})
    second = start_router(processes, nats_server)
    read_back = await second.wait_for("tasks under way read back")
    await second.wait_for("router ready")
    assert read_back["events"] >= 2  # the two routed

    # Either router answers; both count the two tasks ahead of the worker.
    for _ in range(12):
        body, _ = await request(nc, "coordinator.workers", {}, timeout_s=5)
        [worker] = body["workers"]
        assert worker.get("queue_depth", 0) == 2, body


async def test_a_task_is_held_from_its_requests_arrival_and_asked_about_with_no_worker_at_all(
    nats_server: NatsServer, nc: Client, processes: Processes
) -> None:
    """The same, where the registry holds no worker at all (its entries expired while its
    leader was elected) and the router asked first has stored nothing yet (its reads of the
    log wait out an election too): it holds the task from the moment the request arrived.
    The other router here is the real `Peers` on a connection of its own, handling a request
    for the task; the router under test answers its own question too, and must not take its
    own request for the holder."""
    router = start_router(processes, nats_server)
    await router.wait_for("router ready")
    other_nc = await nats.connect(nats_server.url)
    other = Peers(other_nc, {}, {})
    await other.start()
    await flush_written(other_nc)
    held = new_task_id()
    inbox = nc.new_inbox()
    replies = await nc.subscribe(inbox)
    request = msgspec.json.encode({"prompt": "1+1", "model": MODEL, "wait": True, "task_id": held})
    try:
        with other.arrived(held):
            await nc.publish(ROUTE, request, reply=inbox)
            with pytest.raises(TimeoutError):
                await replies.next_msg(timeout=3.0)
            assert handled(router, "asked again; another router holds the task", held)
        # Its request answered elsewhere, the other router holds nothing: refused as ever.
        await nc.publish(ROUTE, request, reply=inbox)
        refusal = await replies.next_msg(timeout=5.0)
        assert b"no_worker" in refusal.data
    finally:
        await other.stop()
        await other_nc.close()


async def test_a_router_with_no_worker_for_a_task_another_router_holds_stays_silent(
    nats_server: NatsServer, nc: Client, processes: Processes
) -> None:
    """A client asked again, of this router, while the router it asked first is still storing
    the task (an election holds its writes) and this one sees no live worker (the registry's
    leader is being elected too). Refusing would tell the client ``no_worker`` for a task
    that then runs: the router stays silent, and the client asks again later. Here the other
    router is played by a subscriber that answers the routers' question for one task."""
    router = start_router(processes, nats_server)
    await router.wait_for("router ready")
    await no_live_worker_serving(nc, MODEL)
    held = new_task_id()

    async def holder(msg: Msg) -> None:
        if msgspec.json.decode(msg.data, type=HoldsQuery).task_id == held:
            await msg.respond(msgspec.json.encode(HoldsReply(task_id=held)))

    holds = await nc.subscribe(ROUTER_HOLDS, cb=holder)
    try:
        inbox = nc.new_inbox()
        replies = await nc.subscribe(inbox)
        body = {"prompt": "1+1", "model": MODEL, "wait": True}
        await nc.publish(ROUTE, msgspec.json.encode({**body, "task_id": held}), reply=inbox)
        with pytest.raises(TimeoutError):
            await replies.next_msg(timeout=3.0)
        assert handled(router, "asked again; another router holds the task", held)
        # A task nobody holds is refused as ever.
        await nc.publish(
            ROUTE, msgspec.json.encode({**body, "task_id": new_task_id()}), reply=inbox
        )
        refusal = await replies.next_msg(timeout=5.0)
        assert b"no_worker" in refusal.data
    finally:
        await holds.unsubscribe()


async def test_a_refusal_stands_for_the_request_asked_again_once_a_worker_is_back(
    nats_server: NatsServer,
    nc: Client,
    ollama: FakeOllama,
    runner: ServiceRunner,
    processes: Processes,
) -> None:
    """A request naming its task that no router holds and no worker can take is refused, and
    the refusal is stored: the same request asked again (the client checks a refusal on a
    fresh reply subject; the router that held it, its connection moving to another server,
    may store it later) gets the same answer, never a run, even with a worker back by then."""
    router = start_router(processes, nats_server)
    await router.wait_for("router ready")
    await no_live_worker_serving(nc, MODEL)
    refused = new_task_id()
    body = {"prompt": "1+1", "model": MODEL, "wait": True}

    async def ask(task_id: str) -> bytes:
        inbox = nc.new_inbox()
        replies = await nc.subscribe(inbox)
        try:
            await nc.publish(ROUTE, msgspec.json.encode({**body, "task_id": task_id}), reply=inbox)
            return (await replies.next_msg(timeout=30.0)).data
        finally:
            await replies.unsubscribe()

    first = await ask(refused)
    assert b"no_worker" in first
    runner.worker(nats_server.url, ollama.url, "cpu-1")
    await workers_live(nc, 1, timeout_s=30)

    again = await ask(refused)

    assert again == first
    assert await count_events(nc, refused, "failed") == 1
    assert await count_events(nc, refused, "submitted") == 0
    assert not await started(nc, refused)
    # The worker is there: a task of another id runs.
    done = msgspec.json.decode(await ask(new_task_id()), type=RouteReply)
    assert (done.status, done.response) == ("done", "2")
