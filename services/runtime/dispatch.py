"""Sending an attempt out: its ``routed`` event stored, then its task message queued.

The router sends attempt 1 of a task it submits (with the task's ``submitted`` event), the
reaper attempt N+1 of a task it moves; both with `dispatch`, from the builders of
`services.fleet.dispatch`, so every attempt goes out the same way whoever routed it:

1. ``routed`` is stored (with the ``submitted`` event beside it, their acknowledgements awaited
   together: one round trip, and one connection keeps their order in ``EVENTS``). It is the
   attempt's fence: a worker holding an older attempt finds it moved, and the server refuses
   that attempt's outcome (`services.runtime.outcomes.attempt_fence`).
2. A ``routed`` the stream took as a duplicate (its message id is the attempt's) is read back
   from the stream's leader: one that is not this dispatch's (``ours``) stands, and nothing
   is queued (`RoutedElsewhere`): a copy queued here would run where no outcome of it is taken.
3. What the caller does between the routing and the queue (``before_queue``: the reaper's
   cancel notice and removal of the older copies), which may withdraw the attempt
   (`Withdrawn`: the task ended as it was being moved).
4. The task message goes to the attempt's queue, with the attempt's message id and the
   caller's trace.

Each write rides out a bus outage (a nats-server restart, a cluster electing a stream's
leader): one the connection lost, or the server not ready yet, is sent again for up to
`OUTAGE_RETRY_S`. That is safe because each carries its message id, so a write stored before
the outage (its acknowledgement lost) is not stored twice; and it keeps a task caught by an
outage from failing when it could be queued a moment later.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, Final

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import PubAck

from schemas import message_ids
from schemas.events import TaskRouted, TaskSubmitted, encoder, task_event_decoder
from schemas.subjects import task_event
from services.fleet.dispatch import task_message
from services.runtime.bus import publish_event
from services.runtime.outcomes import last_on
from services.runtime.tracing import inject_context

# How long a write caught by a bus outage is tried again, and how often: well past a
# cluster's leader election (4 to 9 s, and the client's move to another server), within the
# streams' window for duplicate message ids (2 minutes), so a try stored with its
# acknowledgement lost is recognised by a later one.
OUTAGE_RETRY_S: Final = 60.0
OUTAGE_RETRY_EVERY_S: Final = 0.25
# What a write gets while the connection is lost or the server is starting (JetStream not
# ready, the stream not recovered yet, an acknowledgement that never came).
_OUTAGE_ERRORS: Final = (
    nats.errors.TimeoutError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.NoRespondersError,
    nats.errors.OutboundBufferLimitError,
    nats.js.errors.ServiceUnavailableError,
    nats.js.errors.NoStreamResponseError,
)
# JetStream's answers that say "not now": a try with the same message id is still being
# stored (a leader election holds it: 409, 10158), or the server sheds load (429).
_BUSY_CODES: Final = frozenset({409, 429})


def is_outage(exc: BaseException) -> bool:
    """Does ``exc`` say the write may go through if sent again a moment later?"""
    return isinstance(exc, _OUTAGE_ERRORS) or (
        isinstance(exc, nats.js.errors.APIError) and exc.code in _BUSY_CODES
    )


async def through_outage(write: Callable[[], Awaitable[Any]]) -> Any:
    """``write()``, sent again while it fails for a bus outage, for up to `OUTAGE_RETRY_S`."""
    deadline = time.monotonic() + OUTAGE_RETRY_S
    while True:
        try:
            return await write()
        except Exception as exc:
            if not is_outage(exc) or time.monotonic() >= deadline:
                raise
        await asyncio.sleep(OUTAGE_RETRY_EVERY_S)


class RoutedElsewhere(Exception):
    """The stream holds another routing of this attempt (stored first under its message id):
    that one stands, and this dispatch queued nothing."""

    def __init__(self, stored: TaskRouted | None) -> None:
        super().__init__(stored)
        self.stored = stored


class Withdrawn(Exception):
    """``before_queue`` said not to queue the attempt, routed by now."""


class NotQueued(Exception):
    """The attempt is routed (its ``routed`` has sequence ``routed_seq``) but its message was
    not queued: the task's ``submitted`` was not stored, or the queue did not take it. The
    attempt must end, or the reaper would look for it."""

    def __init__(self, routed_seq: int, reason: str) -> None:
        super().__init__(reason)
        self.routed_seq = routed_seq
        self.reason = reason


async def dispatch(
    js: JetStreamContext,
    submitted: TaskSubmitted,
    routed: TaskRouted,
    *,
    ours: Callable[[TaskRouted], bool],
    fence: tuple[str, int] | None = None,
    with_submission: bool = False,
    before_queue: Callable[[], Awaitable[bool]] | None = None,
) -> int:
    """Store ``routed`` (fenced by ``fence``, `services.runtime.bus.publish_event`'s
    ``expect_last``) and, with ``with_submission``, ``submitted`` beside it; then queue the
    attempt's message. Returns the message's sequence in ``TASKS``.

    Raises `RoutedElsewhere` when the stream holds a routing of this attempt that ``ours``
    does not take for this one; `Withdrawn` when ``before_queue()`` said not to queue it;
    `NotQueued` when the attempt was routed but not queued; and
    whatever the routing's write raised (a fence's refusal, an outage that outlasted
    `OUTAGE_RETRY_S`): whose routing the stream holds is unknown then."""
    task_id, attempt = routed.task_id, routed.attempt
    store_routing = through_outage(
        lambda: publish_event(
            js, routed, msg_id=message_ids.routed(task_id, attempt), expect_last=fence
        )
    )
    stored: PubAck
    submission: object = None
    routing: PubAck | BaseException
    if with_submission:
        submission, routing = await asyncio.gather(
            through_outage(
                lambda: publish_event(js, submitted, msg_id=message_ids.submitted(task_id))
            ),
            store_routing,
            return_exceptions=True,
        )
        if isinstance(routing, BaseException):
            raise routing
        stored = routing
    else:
        stored = await store_routing
    routed_seq = int(stored.seq)
    if stored.duplicate:
        data = await last_on(js, task_event(task_id, "routed"), leader=True)
        standing = task_event_decoder.decode(data) if data is not None else None
        if not isinstance(standing, TaskRouted) or not ours(standing):
            raise RoutedElsewhere(standing if isinstance(standing, TaskRouted) else None)
    if isinstance(submission, BaseException):
        raise NotQueued(routed_seq, f"its submission was not stored ({submission!r})")
    if before_queue is not None and not await before_queue():
        raise Withdrawn(task_id)
    message = encoder.encode(task_message(submitted, attempt, routed_seq))
    # The worker continues the caller's trace (traceparent).
    headers = inject_context({"Nats-Msg-Id": message_ids.task_message(task_id, attempt)})
    try:
        # Tried until the stream says it holds the message (a duplicate of a try that was
        # stored with its acknowledgement lost counts): given up on sooner, a message that
        # was stored would run while its client is told the task failed.
        ack = await through_outage(lambda: js.publish(routed.queue, message, headers=headers))
    except Exception as exc:
        reason = f"could not queue the task on {routed.queue}: {exc or type(exc).__name__}"
        raise NotQueued(routed_seq, reason) from exc
    return int(ack.seq)
