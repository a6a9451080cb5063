"""Runtime pieces every task-running service shares, on a real nats-server."""

from __future__ import annotations

import asyncio

from nats.aio.client import Client
from nats.js.api import AckPolicy, ConsumerConfig

from schemas.events import Durations, TaskCompleted, TaskFailed, TaskStarted
from schemas.subjects import EVENTS_STREAM, TASKS_STREAM, WORKERS_BUCKET
from services.runtime.bus import ensure_bucket, ensure_streams, publish_event
from services.runtime.outcomes import (
    KeepAlive,
    Sourced,
    last_started,
    store_outcome,
    stored_outcome,
)


def completed(attempt: int = 1, response: str = "2") -> TaskCompleted:
    return TaskCompleted(
        at=1.0,
        task_id="t1",
        attempt=attempt,
        worker="w",
        model="m",
        response=response,
        durations=Durations(total_ms=1.0),
    )


def anyone(sourced: Sourced) -> bool:
    return True


async def test_a_recorder_stores_one_outcome_per_attempt_the_first(nc: Client) -> None:
    js = nc.jetstream()
    await ensure_streams(js)
    assert await stored_outcome(js, "t1", 1, anyone) is None

    await store_outcome(js, completed(response="first"), by="w")
    await store_outcome(js, completed(response="second"), by="w")  # a redelivered copy's
    await store_outcome(
        js,
        TaskFailed(at=2.0, task_id="t1", attempt=1, worker="v", code="worker_lost", reason="x"),
        by="v",
    )  # another worker's, on its own subject: it cannot take the place of w's

    assert (await js.stream_info(EVENTS_STREAM)).state.messages == 2
    stored = await stored_outcome(js, "t1", 1, lambda sourced: sourced[1] == "w")
    assert isinstance(stored, TaskCompleted) and stored.response == "first"
    assert await stored_outcome(js, "t1", 1, lambda sourced: False) is None
    assert await stored_outcome(js, "t1", 2, anyone) is None  # a later attempt has not ended


async def test_last_started_is_of_the_attempt_asked_about(nc: Client) -> None:
    js = nc.jetstream()
    await ensure_streams(js)
    assert await last_started(js, "t1", 1) is None
    await publish_event(js, TaskStarted(at=1.0, task_id="t1", attempt=1, worker="a", host="h"))
    found = await last_started(js, "t1", 1)
    assert found is not None
    started, source = found
    assert isinstance(started, TaskStarted) and (started.worker, started.host) == ("a", "h")
    assert source == "a"  # the worker its subject names
    assert await last_started(js, "t1", 2) is None


async def test_keep_alive_holds_a_message_past_its_ack_wait(nc: Client) -> None:
    js = nc.jetstream()
    await ensure_streams(js)
    config = ConsumerConfig(
        durable_name="k", filter_subject="tasks.k", ack_policy=AckPolicy.EXPLICIT, ack_wait=0.6
    )
    await js.add_consumer(TASKS_STREAM, config)
    sub = await js.pull_subscribe_bind(durable="k", stream=TASKS_STREAM)
    await js.publish("tasks.k", b"work")
    [msg] = await sub.fetch(1, timeout=2)

    async with KeepAlive(msg, ack_wait_s=0.6):
        await asyncio.sleep(1.5)  # silent work, longer than ack_wait
        info = await js.consumer_info(TASKS_STREAM, "k")
        assert info.num_redelivered == 0
    await msg.ack()


async def test_a_shorter_registry_ttl_is_applied_to_an_existing_bucket(nc: Client) -> None:
    js = nc.jetstream()
    await ensure_bucket(js, WORKERS_BUCKET, ttl_s=15)
    await ensure_bucket(js, WORKERS_BUCKET, ttl_s=2)  # was refused: duplicate window > max age
    info = await js.stream_info(f"KV_{WORKERS_BUCKET}")
    assert info.config.max_age == 2
