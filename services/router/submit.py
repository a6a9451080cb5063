"""Recording and queueing a task: its ``submitted`` and ``routed`` events, then its message on
the worker's queue; a task recorded but not queued is recorded as failed.

Each write rides out a short bus outage (a nats-server restart): one the connection lost, or
the server not ready yet, is sent again for up to `OUTAGE_RETRY_S`. That is safe because each
carries its ``Nats-Msg-Id``, so a write stored before the outage is not stored twice; and it
keeps a task caught by a restart from failing (``unavailable``) when it could be queued a
moment later."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from contextlib import suppress
from typing import Any, Final

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import PubAck

from schemas.events import TaskRouted, encoder, task_event_decoder
from schemas.subjects import task_event
from services.fleet.policy import Decision
from services.router.decide import Submission
from services.router.records import routed_event, submitted_event, task_message, unqueued_failure
from services.runtime.bus import publish_event
from services.runtime.errors import Unavailable
from services.runtime.outcomes import last_on
from services.runtime.tracing import inject_context

# How long a write caught by a bus outage is tried again, and how often.
OUTAGE_RETRY_S: Final = 10.0
# The task message is tried longer: well past a cluster's leader election (4 to 9 s), within
# the stream's window for duplicate message ids (2 minutes), so a try stored with its
# acknowledgement lost is recognised by a later one.
QUEUE_RETRY_S: Final = 60.0
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


async def through_outage(write: Callable[[], Awaitable[Any]], retry_s: float | None = None) -> Any:
    """``write()``, sent again while it fails for a bus outage, for up to ``retry_s``
    (`OUTAGE_RETRY_S` by default)."""
    deadline = time.monotonic() + (OUTAGE_RETRY_S if retry_s is None else retry_s)
    while True:
        try:
            return await write()
        except _OUTAGE_ERRORS:
            if time.monotonic() >= deadline:
                raise
        await asyncio.sleep(OUTAGE_RETRY_EVERY_S)


class AlreadySubmitted(Exception):
    """A task of this id was routed by another request (two routers took one request that a
    client asked twice): its routing stands, and this request follows it."""


async def submit(js: JetStreamContext, task: Submission) -> int:
    """Record and queue the task; returns its message's sequence in ``TASKS``. Raises
    `AlreadySubmitted` when another request routed a task of this id first."""
    task_id, decision = task.task_id, task.decision
    # Both events go out at once and their acknowledgements are awaited together: one
    # round trip instead of two. One connection keeps their order in EVENTS, and the task
    # is queued only once both are stored.
    submitted: object
    routed: PubAck | BaseException
    routed_at = time.time()
    submitted, routed = await asyncio.gather(
        through_outage(
            lambda: publish_event(js, submitted_event(task), msg_id=f"{task_id}:submitted")
        ),
        through_outage(
            lambda: publish_event(js, routed_event(task, routed_at), msg_id=f"{task_id}:routed:1")
        ),
        return_exceptions=True,
    )
    if isinstance(submitted, BaseException):
        if not isinstance(routed, BaseException):
            # A routed task must end: the reaper would otherwise look for it.
            await fail_unqueued(
                js, task_id, decision, f"its submission was not stored ({submitted!r})"
            )
        reason = submitted or type(submitted).__name__
        raise Unavailable(f"could not record the task: {reason}") from submitted
    if not isinstance(routed, BaseException) and routed.duplicate:
        await _check_own_routing(js, task_id, routed_at)
    try:
        if isinstance(routed, BaseException):
            raise routed
        message = encoder.encode(task_message(task, int(routed.seq)))
        # The worker continues this request's trace (traceparent).
        headers = inject_context({"Nats-Msg-Id": f"{task_id}:1"})
        # Tried until the stream says it holds the message (a duplicate of a try that was
        # stored with its acknowledgement lost counts): given up on sooner, a message that
        # was stored would run while its client is told the task failed.
        ack = await through_outage(
            lambda: js.publish(decision.queue, message, headers=headers), QUEUE_RETRY_S
        )
    except Exception as exc:
        reason = f"could not queue the task on {decision.queue}: {exc or type(exc).__name__}"
        await fail_unqueued(js, task_id, decision, reason)
        raise Unavailable(f"task {task_id}: {reason}") from exc
    return int(ack.seq)


async def _check_own_routing(js: JetStreamContext, task_id: str, routed_at: float) -> None:
    """After a ``routed`` the stream took as a duplicate: is the stored one this request's
    (sent again through an outage), or another request's? Raise `AlreadySubmitted` then."""
    data = await last_on(js, task_event(task_id, "routed"))
    stored = task_event_decoder.decode(data) if data is not None else None
    if not isinstance(stored, TaskRouted) or stored.at != routed_at:
        raise AlreadySubmitted(task_id)


async def fail_unqueued(
    js: JetStreamContext, task_id: str, decision: Decision, reason: str
) -> None:
    """Record the end of a task that was recorded but could not be queued (best effort)."""
    with suppress(Exception):
        await publish_event(
            js,
            unqueued_failure(task_id, decision, reason, time.time()),
            msg_id=f"{task_id}:failed:router",
        )
