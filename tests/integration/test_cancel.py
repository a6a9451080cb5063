"""``coordinator.cancel``: a task whose client went away stops, or never runs."""

from __future__ import annotations

import msgspec
from nats.aio.client import Client

from devtools.fakes.ollama import FakeOllama
from devtools.servers import NatsServer
from tests.harness import ServiceRunner, eventually, last_task_event, request, workers_live

MODEL = "qwen2.5:0.5b"


async def outcome(nc: Client, task_id: str) -> dict[str, object]:
    js = nc.jetstream()

    async def check() -> dict[str, object] | None:
        for kind in ("completed", "failed"):
            try:
                msg = await last_task_event(js, task_id, kind)
            except Exception:
                continue
            event: dict[str, object] = msgspec.json.decode(msg.data or b"")
            return event
        return None

    found: dict[str, object] = await eventually(check, timeout_s=10)
    return found


async def test_a_queued_task_that_is_cancelled_is_never_run(
    nats_server: NatsServer, nc: Client, ollama: FakeOllama, runner: ServiceRunner
) -> None:
    runner.router(nats_server.url)
    runner.worker(nats_server.url, ollama.url, "cpu-1")
    await workers_live(nc, 1)
    ollama.delay_s = 1.0
    calls_before = ollama.stats()["generate_calls"]  # the sanity runs

    first, _ = await request(nc, "coordinator.route", {"prompt": "one", "model": MODEL})
    second, _ = await request(
        nc, "coordinator.route", {"prompt": "two", "model": MODEL, "worker": "cpu-1"}
    )
    cancel, headers = await request(
        nc, "coordinator.cancel", {"task_id": second["task_id"], "reason": "changed my mind"}
    )

    assert "Nats-Service-Error-Code" not in headers, cancel
    assert cancel == {"task_id": second["task_id"], "status": "cancelling"}
    ended = await outcome(nc, second["task_id"])
    assert ended["type"] == "failed" and ended["code"] == "cancelled"
    assert ended["reason"] == "changed my mind"
    assert (await outcome(nc, first["task_id"]))["type"] == "completed"
    assert ollama.stats()["generate_calls"] - calls_before == 1  # only the first one ran


async def test_a_running_task_that_is_cancelled_stops_its_backend_call(
    nats_server: NatsServer, nc: Client, ollama: FakeOllama, runner: ServiceRunner
) -> None:
    runner.router(nats_server.url)
    runner.worker(nats_server.url, ollama.url, "cpu-1")
    await workers_live(nc, 1)
    ollama.delay_s = 5.0
    routed, _ = await request(nc, "coordinator.route", {"prompt": "slow", "model": MODEL})
    await eventually(lambda: _in_flight(ollama))

    await request(nc, "coordinator.cancel", {"task_id": routed["task_id"]})

    ended = await outcome(nc, routed["task_id"])
    assert ended["code"] == "cancelled"
    assert await eventually(lambda: _hung_up(ollama))  # the stand-in saw the client go


async def test_a_bad_cancel_is_refused(
    nats_server: NatsServer, nc: Client, ollama: FakeOllama, runner: ServiceRunner
) -> None:
    runner.router(nats_server.url)
    runner.worker(nats_server.url, ollama.url, "cpu-1")
    await workers_live(nc, 1)
    for bad in ({"task_id": "a.b"}, {}, {"task_id": "t", "reply_to": "_INBOX.x"}, {"typo": 1}):
        body, headers = await request(nc, "coordinator.cancel", bad)
        assert headers["Nats-Service-Error-Code"] == "bad_request", body
    body, headers = await request(nc, "coordinator.cancel", {"reply_to": "_INBOX.answered"})
    assert headers["Nats-Service-Error-Code"] == "not_found", body


async def _in_flight(fake: FakeOllama) -> bool:
    return fake.stats()["in_flight"] > 0


async def _hung_up(fake: FakeOllama) -> bool:
    return fake.stats()["cancelled"] > 0


async def test_a_cancel_by_the_reply_subject_of_an_answered_request_is_refused(
    nats_server: NatsServer, nc: Client, ollama: FakeOllama, runner: ServiceRunner
) -> None:
    """The router holds an answered reply subject a moment longer (an ask that crossed the
    answer is told nothing): a cancel naming it meanwhile is still told its task has ended."""
    runner.router(nats_server.url)
    runner.worker(nats_server.url, ollama.url, "cpu-1")
    await workers_live(nc, 1)
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    body = {"prompt": "1+1", "model": MODEL, "wait": True}
    await nc.publish("coordinator.route", msgspec.json.encode(body), reply=inbox)
    answer = msgspec.json.decode((await sub.next_msg(timeout=30)).data)
    assert answer["status"] == "done"

    refused, headers = await request(nc, "coordinator.cancel", {"reply_to": inbox})
    assert headers["Nats-Service-Error-Code"] == "not_found", refused
    assert "it was answered" in refused["error"]["message"], refused
