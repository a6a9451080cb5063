"""A worker's queues: the durable pull consumers it binds, made the same way for every kind."""

from __future__ import annotations

from dataclasses import dataclass

import structlog
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import BadRequestError

from schemas.subjects import TASKS_STREAM

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


async def bind(
    js: JetStreamContext, queue: Queue, ack_wait_s: float
) -> JetStreamContext.PullSubscription:
    """Create (or find) the queue's consumer and bind to it."""
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
    return await js.pull_subscribe_bind(durable=queue.consumer, stream=TASKS_STREAM)
