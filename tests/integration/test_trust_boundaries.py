"""Each role against the shipped NATS configuration, trying what it must not do: read another
user's replies, inject a reply or a streamed piece, reconfigure a pool, change fleet-wide
state, read prompts from the event log. Every attempt is refused by the server; what the role
is there for still works."""

from __future__ import annotations

import asyncio
from contextlib import suppress

import httpx
import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.api import ConsumerConfig
from structlog.testing import capture_logs

from devtools.fakes.ollama import FakeOllama
from devtools.servers import NatsServer
from schemas.events import Durations, TaskCompleted, encoder
from schemas.route import StreamChunk
from schemas.subjects import (
    ALIAS_ADD,
    ALIASES,
    EVENTS_STREAM,
    GATEWAY_KEYS_BUCKET,
    ROUTE,
    SHARED_CPU,
    STATS_EXCLUDE,
    STATS_REBUILD,
    TASK,
    TASKS_STREAM,
    WORKERS_BUCKET,
    chunk_subject,
    task_event,
)
from schemas.workers import worker_record_decoder
from services.cli.permissions import EXAMPLE_WEB_WORKERS
from services.runtime.bus import flush_written
from services.runtime.request import stream_call
from tests.harness import ServiceRunner, eventually, request, workers_live
from tests.integration.test_gateway import start_gateway
from tests.integration.test_nats_permissions import (
    WORKER,
    Violations,
    admin,
    connect_as,
    password,
    run_fleet,
    secured,
)

__all__ = ["admin", "secured"]  # fixtures, used by name

MODEL = "qwen2.5:0.5b"


async def refused(nc: Client, errors: Violations, subject: str) -> bool:
    """Did the server report a permissions violation naming ``subject``?"""
    await nc.flush()
    for _ in range(20):
        if errors.about(subject):
            return True
        await asyncio.sleep(0.05)
    return False


async def test_nobody_reads_another_users_replies(secured: NatsServer, admin: Client) -> None:
    errors = Violations()
    nc = await connect_as(secured, "client", errors)
    try:
        for other in ("_INBOX.>", "_INBOX_gateway.>", "_INBOX_router.>", ">"):
            await nc.subscribe(other)
            assert await refused(nc, errors, f'subscription to "{other}"'), (other, errors.seen)
        # Its own inbox works: a request gets its answer.

        async def answer(msg: Msg) -> None:
            await msg.respond(b'{"workers": []}')

        await admin.subscribe("coordinator.workers", cb=answer)
        await flush_written(admin)
        body, _ = await request(nc, "coordinator.workers", {}, timeout_s=2.0)
        assert body == {"workers": []}
    finally:
        await nc.close()


async def test_a_worker_cannot_inject_a_reply_or_a_streamed_piece_nor_reconfigure_a_pool(
    secured: NatsServer, admin: Client
) -> None:
    errors = Violations()
    nc = await connect_as(secured, f"worker-{WORKER}", errors)
    js = nc.jetstream(timeout=1.0)
    try:
        await nc.publish("_INBOX_client.abc.1", b"INJECTED")
        assert await refused(nc, errors, "_INBOX_client.abc.1")
        await nc.publish(chunk_subject("cpu2", "t1"), b"FORGED")
        assert await refused(nc, errors, "coordinator.chunk.cpu2.t1")
        await nc.publish(chunk_subject(WORKER, "t1"), b"{}")  # its own: allowed
        await nc.flush()
        # The pools' consumers are setup's: a worker binds them as they are.
        result = await asyncio.gather(
            js.add_consumer(
                TASKS_STREAM,
                ConsumerConfig(
                    name=SHARED_CPU.consumer,
                    durable_name=SHARED_CPU.consumer,
                    filter_subject="tasks.cpu.shared",
                    ack_wait=1.0,
                    max_deliver=1,
                ),
            ),
            return_exceptions=True,
        )
        assert isinstance(result[0], Exception)
        assert await refused(nc, errors, "$JS.API.CONSUMER.CREATE.TASKS.cpu-shared")
        info = await admin.jetstream().consumer_info(TASKS_STREAM, SHARED_CPU.consumer)
        assert info.config.ack_wait == 30.0 and info.config.max_deliver in (None, -1)
        assert not errors.about(f"coordinator.chunk.{WORKER}.t1")
    finally:
        await nc.close()


async def test_only_the_operator_changes_fleet_wide_state(
    secured: NatsServer, admin: Client
) -> None:
    errors = Violations()
    client = await connect_as(secured, "client", errors)
    try:
        for subject in (ALIAS_ADD, STATS_EXCLUDE, STATS_REBUILD):
            await client.publish(subject, b"{}")
            assert await refused(client, errors, subject), subject
        await client.publish(ALIASES, b"{}")  # reading the aliases is fine
        await client.flush()
        assert not errors.about(ALIASES + '"')
    finally:
        await client.close()
    errors = Violations()
    operator = await connect_as(secured, "operator", errors)
    try:
        for subject in (ALIAS_ADD, STATS_EXCLUDE, STATS_REBUILD):
            await operator.publish(subject, b"{}")
        await operator.publish("events.task.t1.completed", b"{}")  # but no events
        await operator.flush()
        await asyncio.sleep(0.2)
        assert [e for e in errors.seen if "coordinator.stats" in e] == []
        assert await refused(operator, errors, "events.task.t1.completed")
    finally:
        await operator.close()


async def test_the_jobs_user_reads_answers_but_no_prompt(
    secured: NatsServer, admin: Client
) -> None:
    errors = Violations()
    nc = await connect_as(secured, "jobs", errors)
    js = nc.jetstream(timeout=1.0)
    try:
        results = await asyncio.gather(
            js.get_last_msg(EVENTS_STREAM, "events.task.t1.submitted", direct=True),
            js.get_last_msg(EVENTS_STREAM, "events.task.t1.submitted"),
            return_exceptions=True,
        )
        assert all(isinstance(r, Exception) for r in results), results
        assert await refused(nc, errors, "$JS.API.DIRECT.GET.EVENTS.events.task.t1.submitted")
        assert await refused(nc, errors, "$JS.API.STREAM.MSG.GET.EVENTS")
    finally:
        await nc.close()


async def test_a_streamed_answer_reaches_its_client_through_the_router_and_nobody_else(
    secured: NatsServer, admin: Client, ollama: FakeOllama, runner: ServiceRunner
) -> None:
    run_fleet(runner, secured.url, ollama.url)
    client = await connect_as(secured, "client")
    eve_errors = Violations()
    eve = await connect_as(secured, "gateway", eve_errors)  # another role, same machine
    try:
        await workers_live(client, 1)
        await eve.subscribe("_INBOX_client.>")
        ollama.chunk_delay_s = 0.02
        body = msgspec.json.encode({"prompt": "tell me a story", "model": MODEL, "stream": True})
        chunks: list[StreamChunk] = []
        final = b""
        async for item in stream_call(client, ROUTE, body, timeout_s=20):
            if isinstance(item, bytes):
                final = item
            else:
                chunks.append(item)
        reply = msgspec.json.decode(final)
        assert reply["status"] == "done" and reply["worker"] == WORKER
        assert len(chunks) > 2
        assert "".join(c.response for c in chunks) == reply["response"]
        assert await refused(eve, eve_errors, 'subscription to "_INBOX_client.>"')
    finally:
        await eve.close()
        await client.close()


async def test_the_gateway_reads_the_api_keys_and_only_the_operator_writes_them(
    secured: NatsServer, admin: Client, runner: ServiceRunner
) -> None:
    """Under its own user the gateway starts and follows the keys bucket; a client cannot
    write a key in, the operator can."""
    url = await start_gateway(
        runner, secured.url, nats_user="gateway", nats_password=password("gateway")
    )
    async with httpx.AsyncClient(base_url=url, timeout=5) as http:
        assert (await http.get("/api/version")).status_code == 200
    errors = Violations()
    client = await connect_as(secured, "client", errors)
    operator = await connect_as(secured, "operator")
    try:
        await client.publish(f"$KV.{GATEWAY_KEYS_BUCKET}.mine", b"{}")
        assert await refused(client, errors, f"$KV.{GATEWAY_KEYS_BUCKET}.mine")
        keys = await operator.jetstream().key_value(GATEWAY_KEYS_BUCKET)
        await keys.put("ops", b"{}")  # the operator may (a real key is `coordinator keys add`)
        await keys.delete("ops")
    finally:
        await client.close()
        await operator.close()


async def test_a_worker_cannot_forge_another_workers_outcome(
    secured: NatsServer, admin: Client, ollama: FakeOllama, runner: ServiceRunner, pg_dsn: str
) -> None:
    """The attack: a worker reads another's running task from the registry and publishes its
    outcome. On the other worker's subject the server refuses it; on its own subject it is
    stored but nobody takes it: the client, the router's lookups and the statistics keep the
    real answer, and the router and the stats service log the refusal."""
    forger_id = EXAMPLE_WEB_WORKERS[0]  # another worker user of the shipped configuration
    with capture_logs() as logs:
        run_fleet(runner, secured.url, ollama.url, pg_dsn=pg_dsn)
        client = await connect_as(secured, "client")
        errors = Violations()
        forger = await connect_as(secured, f"web-{forger_id}", errors)
        try:
            await workers_live(client, 1)
            ollama.delay_s = 1.5  # the real answer takes a while: time to forge
            asked = asyncio.create_task(
                request(client, ROUTE, {"prompt": "1+1?", "model": MODEL, "wait": True}, 20.0)
            )
            registry = await forger.jetstream().key_value(WORKERS_BUCKET)

            async def running() -> str | None:
                entry = await registry.get(WORKER)
                return worker_record_decoder.decode(entry.value or b"").current_task

            task_id = await eventually(running, timeout_s=10.0, interval_s=0.05)

            def forged(worker: str) -> bytes:
                return encoder.encode(
                    TaskCompleted(
                        at=1.0,
                        task_id=task_id,
                        attempt=1,
                        worker=worker,
                        model=MODEL,
                        response="FORGED",
                        durations=Durations(total_ms=1.0),
                    )
                )

            js = forger.jetstream(timeout=2.0)
            # On the routed worker's subject, or as the router: refused by the server.
            for subject in (
                task_event(task_id, "completed", WORKER),
                f"events.task.{task_id}.failed",
            ):
                await forger.publish(subject, forged(WORKER))
                assert await refused(forger, errors, subject), (subject, errors.seen)
            # On its own subject, naming either worker: stored, and taken by nobody.
            for named in (WORKER, forger_id):
                await js.publish(task_event(task_id, "completed", forger_id), forged(named))

            reply, _ = await asked
            assert reply["status"] == "done" and reply["worker"] == WORKER
            assert reply["response"] != "FORGED"

            async def projected() -> dict[str, object] | None:
                with suppress(Exception):
                    body, _ = await request(client, TASK, {"task_id": task_id}, 2.0)
                    return body if body.get("status") == "done" else None
                return None

            task = await eventually(projected, timeout_s=10.0)
            assert task["worker"] == WORKER and task["response"] == reply["response"]
        finally:
            await forger.close()
            await client.close()
    refusals = [e for e in logs if e.get("task_id") == task_id and "refused" in e["event"]]
    assert {e["event"] for e in refusals} >= {"outcome refused", "task event refused"}, logs
    assert all(forger_id in e["problem"] for e in refusals)
