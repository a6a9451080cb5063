"""Recording and queueing a task: its ``submitted`` and ``routed`` events, then its message on
the worker's queue; a task recorded but not queued is recorded as failed."""

from __future__ import annotations

import asyncio
import time
from contextlib import suppress

from nats.js import JetStreamContext
from nats.js.api import PubAck

from schemas.events import encoder
from services.fleet.policy import Decision
from services.router.decide import Submission
from services.router.records import routed_event, submitted_event, task_message, unqueued_failure
from services.runtime.bus import publish_event
from services.runtime.errors import Unavailable
from services.runtime.tracing import inject_context


async def submit(js: JetStreamContext, task: Submission) -> int:
    """Record and queue the task; returns its message's sequence in ``TASKS``."""
    task_id, decision = task.task_id, task.decision
    # Both events go out at once and their acknowledgements are awaited together: one
    # round trip instead of two. One connection keeps their order in EVENTS, and the task
    # is queued only once both are stored.
    submitted: object
    routed: PubAck | BaseException
    submitted, routed = await asyncio.gather(
        publish_event(js, submitted_event(task), msg_id=f"{task_id}:submitted"),
        publish_event(js, routed_event(task, time.time()), msg_id=f"{task_id}:routed:1"),
        return_exceptions=True,
    )
    if isinstance(submitted, BaseException):
        if not isinstance(routed, BaseException):
            # A routed task must end: the reaper would otherwise look for it.
            await fail_unqueued(js, task_id, decision, "its submission was not stored")
        reason = submitted or type(submitted).__name__
        raise Unavailable(f"could not record the task: {reason}") from submitted
    try:
        if isinstance(routed, BaseException):
            raise routed
        ack = await js.publish(
            decision.queue,
            encoder.encode(task_message(task, int(routed.seq))),
            # The worker continues this request's trace (traceparent).
            headers=inject_context({"Nats-Msg-Id": f"{task_id}:1"}),
        )
    except Exception as exc:
        reason = f"could not queue the task on {decision.queue}: {exc or type(exc).__name__}"
        await fail_unqueued(js, task_id, decision, reason)
        raise Unavailable(f"task {task_id}: {reason}") from exc
    return int(ack.seq)


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
