"""Settling a task message so that the server says it took it: acknowledged, returned or
terminated; and a delivery lost in a reconnect handed out again at once.

A worker's own consumer holds one message at a time (``max_ack_pending=1``): until the server
has taken the settlement of the message in flight, it hands that worker nothing more, for up
to the consumer's ack wait (30 s), while the worker's pulls wait and its next task sits in the
queue. nats.py's ``ack()``, ``nak()`` and ``term()`` are fire-and-forget: one written to a
connection that is going down (a nats-server restart the moment a task ended) is lost without
a word. So each is sent as a request (JetStream's "double ack": the server answers once it has
applied it) and sent again through a bus outage for up to `SETTLE_RETRY_S`. A repeat is
harmless: the server answers a settlement of a message it no longer holds the same way.

A delivery can be lost the other way too: the server hands a message out just as the worker's
connection goes down, counts it in flight, and redelivers it only after the ack wait.
`recover_lost_delivery` looks, after a reconnect, for a message in flight on the worker's own
consumer while the worker holds none, and returns it to the queue at once.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Final

import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from schemas.subjects import TASKS_STREAM

log = structlog.get_logger("taskloop")

ACK: Final = b"+ACK"
NAK: Final = b"-NAK"
TERM: Final = b"+TERM"

# How long a settlement is sent again while the bus is away: past a nats-server restart and a
# cluster's leader election. Beyond it the message comes back after its ack wait, and the
# redelivery is recognised (`services.runtime.redelivery`).
SETTLE_RETRY_S: Final = 60.0
# At a stop, a settlement is tried this long: what is not taken comes back after its ack wait.
STOP_SETTLE_S: Final = 2.0
# How long one try waits for the server's answer, and the pause between tries.
SETTLE_TIMEOUT_S: Final = 1.0
SETTLE_PAUSE_S: Final = 0.25


async def settle(
    nc: Client,
    msg: Msg,
    verb: bytes = ACK,
    *,
    delay_s: float | None = None,
    within_s: float = SETTLE_RETRY_S,
) -> bool:
    """Send ``verb`` (`ACK`, `NAK`, `TERM`) for ``msg`` until the server says it applied it,
    for up to ``within_s``; a `NAK` with ``delay_s`` is redelivered that much later. False
    when it was not taken in time (or the connection was closed for good)."""
    payload = verb
    if verb == NAK and delay_s:
        payload += b" " + json.dumps({"delay": int(delay_s * 1_000_000_000)}).encode()
    deadline = time.monotonic() + within_s
    tries = 0
    while True:
        tries += 1
        try:
            await nc.request(msg.reply, payload, timeout=SETTLE_TIMEOUT_S)
        except Exception as exc:
            if nc.is_closed or time.monotonic() + SETTLE_PAUSE_S >= deadline:
                log.warning(
                    "task message not settled; it comes back after its ack wait",
                    verb=verb.decode(),
                    subject=msg.subject,
                    tries=tries,
                    error=repr(exc),
                )
                return False
            await asyncio.sleep(SETTLE_PAUSE_S)
            continue
        if tries > 1:
            log.info("task message settled after a bus outage", verb=verb.decode(), tries=tries)
        return True


def ack_subject(consumer: str, stream_seq: int, consumer_seq: int) -> str:
    """The reply subject JetStream gives a delivery of message ``stream_seq`` as delivery
    ``consumer_seq`` of ``consumer`` on ``TASKS`` (its settlements go there); the count,
    time and pending tokens are informational to the server."""
    return f"$JS.ACK.{TASKS_STREAM}.{consumer}.1.{stream_seq}.{consumer_seq}.{time.time_ns()}.0"


async def recover_lost_delivery(nc: Client, js: JetStreamContext, consumer: str) -> bool:
    """Return to the queue a message the server counts in flight on ``consumer`` (a worker's
    own, ``max_ack_pending=1``) that the worker does not hold: handed out as its connection
    went down. Call it only while the worker holds no message and has no pull waiting, so that
    nothing in flight can be on its way. True when one was returned."""
    info = await js.consumer_info(TASKS_STREAM, consumer)
    delivered = info.delivered
    if not info.num_ack_pending or delivered is None:
        return False
    # With one message in flight, it is the last one delivered (a redelivery of an older one
    # would name another sequence: the server then ignores this, and the ack wait brings it).
    subject = ack_subject(consumer, delivered.stream_seq or 0, delivered.consumer_seq or 0)
    await nc.request(subject, NAK, timeout=SETTLE_TIMEOUT_S)
    log.warning(
        "a task handed out as the connection went down is returned to the queue",
        consumer=consumer,
        stream_seq=delivered.stream_seq,
    )
    return True
