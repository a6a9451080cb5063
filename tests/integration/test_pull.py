"""`pull_one`: one message from a pull consumer, waiting or not, on a real nats-server."""

from __future__ import annotations

import asyncio
import time

from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig

from schemas.subjects import TASKS_STREAM
from services.runtime.bus import ensure_streams
from services.runtime.pull import pull_one


async def consumer(nc: Client, name: str) -> JetStreamContext.PullSubscription:
    js = nc.jetstream()
    await ensure_streams(js)
    config = ConsumerConfig(
        durable_name=name,
        filter_subject=f"tasks.{name}",
        ack_policy=AckPolicy.EXPLICIT,
        max_ack_pending=1,
    )
    await js.add_consumer(TASKS_STREAM, config)
    return await js.pull_subscribe_bind(durable=name, stream=TASKS_STREAM)


async def test_a_no_wait_pull_answers_at_once_with_nothing_or_the_message(nc: Client) -> None:
    sub = await consumer(nc, "p1")
    started = time.monotonic()
    assert await pull_one(sub, 0) is None
    assert time.monotonic() - started < 1.5  # the server's "no messages", not the bound

    await nc.jetstream().publish("tasks.p1", b"work")
    msg = await pull_one(sub, 0)
    assert msg is not None and msg.data == b"work"
    assert await pull_one(sub, 0) is None  # one held at a time (max_ack_pending=1)
    await msg.ack()


async def test_a_waiting_pull_gets_a_message_published_while_it_waits(nc: Client) -> None:
    sub = await consumer(nc, "p2")
    waiting = asyncio.create_task(pull_one(sub, 5.0))
    await asyncio.sleep(0.2)
    await nc.jetstream().publish("tasks.p2", b"late work")
    msg = await asyncio.wait_for(waiting, timeout=5)
    assert msg is not None and msg.data == b"late work"
    await msg.ack()


async def test_a_waiting_pull_ends_empty_when_its_time_is_up(nc: Client) -> None:
    sub = await consumer(nc, "p3")
    started = time.monotonic()
    assert await pull_one(sub, 0.3) is None
    assert time.monotonic() - started > 0.25  # it waited
    # The expired request delivers nothing later: the next message goes to the next pull.
    await nc.jetstream().publish("tasks.p3", b"next")
    msg = await pull_one(sub, 2.0)
    assert msg is not None and msg.data == b"next"
    await msg.ack()
