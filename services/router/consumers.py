"""The ``coordinator.consumer.own`` endpoint: a worker's own consumer, made by the router.

A worker with credentials may pull its own consumer and read its info, never make or change
it: made by the worker, its limits would be the worker's to choose (a ``max_ack_pending`` of
50 lifts one task at a time). It asks the router, which makes it as the fleet fixes it (one
task in flight, the worker's queues as its filter), or sets it back so, for that worker only;
the worker's ack wait is taken within bounds.
"""

from __future__ import annotations

from typing import Final

from nats.js import JetStreamContext

from schemas.events import encoder
from schemas.queries import OwnConsumer, OwnConsumerQuery
from schemas.subjects import InvalidId, check_worker_id
from services.errors import BadRequest, Forbidden
from services.fleet.identity import asker_of, is_operator, worker_of
from services.runtime.consumers import own_queue, set_consumer
from services.runtime.endpoints import decode_body, reply_subject

# The ack waits a worker may ask for: a few heartbeats at least, an hour at most.
MIN_ACK_WAIT_S: Final = 2.0
MAX_ACK_WAIT_S: Final = 3600.0


async def own_consumer(js: JetStreamContext, body: bytes) -> bytes:
    """Make (or set back) the asking worker's own consumer; `Forbidden` for anyone else's."""
    query = decode_body(body, OwnConsumerQuery, "own consumer query")
    try:
        check_worker_id(query.worker_id)
    except InvalidId as exc:
        raise BadRequest(str(exc)) from None
    if not MIN_ACK_WAIT_S <= query.ack_wait_s <= MAX_ACK_WAIT_S:
        raise BadRequest(
            f"ack_wait_s must be {MIN_ACK_WAIT_S:g} to {MAX_ACK_WAIT_S:g}, not {query.ack_wait_s}"
        )
    asker = asker_of(reply_subject.get())
    if not (asker is None or is_operator(asker) or worker_of(asker) == ("worker", query.worker_id)):
        raise Forbidden(f"worker {query.worker_id}'s consumer is for worker {query.worker_id}")
    queue = own_queue(query.worker_id)
    await set_consumer(js, queue, query.ack_wait_s)
    return encoder.encode(OwnConsumer(consumer=queue.consumer, ack_wait_s=query.ack_wait_s))
