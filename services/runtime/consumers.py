"""A worker's queues: the durable pull consumers it binds, made the same way for every kind."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

import msgspec
import structlog
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import BadRequestError, NotFoundError

from schemas.queries import OwnConsumerQuery
from schemas.subjects import (
    OWN_CONSUMER,
    SHARED_CPU,
    TASKS_STREAM,
    WEB,
    worker_consumer,
    worker_queue_filter,
)
from services.errors import CoordinatorError
from services.runtime.request import call

log = structlog.get_logger("consumers")


@dataclass(frozen=True, slots=True)
class Queue:
    """One durable consumer on ``TASKS`` that a worker pulls."""

    consumer: str
    subject: str
    # 1 on a worker's own queue: the server hands out one task at a time. A queue shared by
    # several workers allows the pool's; each worker still holds one message at a time.
    max_ack_pending: int
    # Its tasks may be for models this worker lacks (a shared queue): looked at before running.
    checked: bool = False

    @property
    def one_at_a_time(self) -> bool:
        """Does the server hand out one message at a time on it (a worker's own queue)? Then a
        message in flight that the worker does not hold was lost on its way."""
        return self.max_ack_pending == 1


def own_queue(worker_id: str) -> Queue:
    """A worker's own queues (every tier), one task in flight, enforced by the server."""
    return Queue(worker_consumer(worker_id), worker_queue_filter(worker_id), 1)


# The pools several workers share. `coordinator setup` makes their consumers, so a worker's
# NATS user needs no right to create (or reconfigure) them; without setup, the first worker
# to bind makes one.
CPU_POOL: Final = Queue(SHARED_CPU.consumer, SHARED_CPU.queue, 1_000, checked=True)
# Each web worker holds at most one task (or two for a moment, when a pull's message arrives
# just after the pull gave up), so this allows dozens of them.
WEB_POOL: Final = Queue(WEB.consumer, WEB.queue, 64)
POOL_QUEUES: Final = (CPU_POOL, WEB_POOL)


async def bind(
    js: JetStreamContext, queue: Queue, ack_wait_s: float
) -> JetStreamContext.PullSubscription:
    """Bind to the queue's consumer as it is; make it first if it does not exist.

    An existing consumer is never changed here: a worker cannot reconfigure a pool that
    others pull from (its ack wait, its limits).
    """
    try:
        await js.consumer_info(TASKS_STREAM, queue.consumer)
    except NotFoundError:
        await ensure_consumer(js, queue, ack_wait_s)
    return await js.pull_subscribe_bind(durable=queue.consumer, stream=TASKS_STREAM)


async def ensure_consumer(js: JetStreamContext, queue: Queue, ack_wait_s: float) -> None:
    """Create the queue's consumer (kept as it is when it exists with other settings)."""
    try:
        await js.add_consumer(TASKS_STREAM, consumer_config(queue, ack_wait_s))
    except BadRequestError as exc:
        # Exists with other settings (an older version, another worker's ACK_WAIT_S): keep it
        # rather than deleting a consumer another instance may be bound to.
        log.warning(
            "consumer exists with other settings; binding to it",
            consumer=queue.consumer,
            error=str(exc),
        )


async def set_consumer(js: JetStreamContext, queue: Queue, ack_wait_s: float) -> None:
    """Make the queue's consumer, or set an existing one back to these settings (its
    ``max_ack_pending`` included, whatever changed it): a create with a name updates what
    may change (nats-server 2.10 and newer)."""
    await js.add_consumer(TASKS_STREAM, consumer_config(queue, ack_wait_s))


# How long a worker with credentials waits for a router to make its consumer (routers start
# beside it): then it gives up, and its service manager starts it again.
OWN_CONSUMER_WAIT_S: Final = 300.0


async def own_consumer(nc: Client, worker_id: str, ack_wait_s: float) -> None:
    """Have the router make this worker's own consumer as the fleet fixes it (a worker with
    credentials may not: `services.router.consumers`), waiting for a router to answer."""

    def waiting(exc: CoordinatorError, within_s: float) -> None:
        log.warning("no router makes this worker's consumer yet; asking again", error=str(exc))

    query = msgspec.json.encode(OwnConsumerQuery(worker_id=worker_id, ack_wait_s=ack_wait_s))
    await call(nc, OWN_CONSUMER, query, 10.0, unserved_s=OWN_CONSUMER_WAIT_S, on_unserved=waiting)


def consumer_config(queue: Queue, ack_wait_s: float) -> ConsumerConfig:
    return ConsumerConfig(
        # With a name, the create request names the filter in its subject
        # ($JS.API.CONSUMER.CREATE.TASKS.<name>.<filter>), which NATS permissions can pin.
        name=queue.consumer,
        durable_name=queue.consumer,
        filter_subject=queue.subject,
        ack_policy=AckPolicy.EXPLICIT,
        deliver_policy=DeliverPolicy.ALL,
        max_ack_pending=queue.max_ack_pending,
        ack_wait=ack_wait_s,
    )
