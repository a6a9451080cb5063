"""A worker's queues: the durable pull consumers it binds, made the same way for every kind."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

import structlog
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import BadRequestError, NotFoundError

from schemas.subjects import SHARED_CPU, TASKS_STREAM, WEB

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
    config = ConsumerConfig(
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
    try:
        await js.add_consumer(TASKS_STREAM, config)
    except BadRequestError as exc:
        # Exists with other settings (an older version, another worker's ACK_WAIT_S): keep it
        # rather than deleting a consumer another instance may be bound to.
        log.warning(
            "consumer exists with other settings; binding to it",
            consumer=queue.consumer,
            error=str(exc),
        )
