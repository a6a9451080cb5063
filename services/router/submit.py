"""Recording and queueing a task: its ``submitted`` and ``routed`` events, then its message on
the worker's queue; a task routed by this request but not queued is recorded as failed.

Each write rides out a bus outage (a nats-server restart, a cluster electing a stream's
leader): one the connection lost, or the server not ready yet, is sent again for up to
`OUTAGE_RETRY_S`. That is safe because each carries its ``Nats-Msg-Id``, so a write stored
before the outage (its acknowledgement lost) is not stored twice; and it keeps a task caught
by an outage from failing (``unavailable``) when it could be queued a moment later.

A failure is recorded only for a routing this request stored, and only while that routing is
the task's last (the same fence as a worker's outcome): a routing whose write never got an
answer may be another router's (a client that asked twice) or may have been stored after all,
and that task may be queued and run; a routing that was never stored is found by the reaper
(a task submitted and never routed).

A request that names its task and that a router refuses after checking that no router holds
it and the log has none of it (`record_refusal`) may still be in another router's hands: one
whose connection was moving to another server when asked, whose writes then go through. So
the refusal is stored only while the task has no ``routed``, and its first ``routed`` only
while it has no refusal: one of the two wins, and the client is told what the log says (one
id, one answer; a ``submitted`` stored beside a refusal runs nothing). Each fence names the
other's literal subject: on a replicated stream the leader checks a fence against the writes
it is still proposing on that very subject, and no others (a wildcard fence would miss
them)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from contextlib import suppress
from typing import Any, Final

import nats.errors
import nats.js.errors
import structlog
from nats.js import JetStreamContext
from nats.js.api import PubAck

from schemas import message_ids
from schemas.events import TaskRouted, encoder, task_event_decoder
from schemas.subjects import task_event
from services.errors import CoordinatorError, Unavailable
from services.fleet.dispatch import routed_event, task_message
from services.fleet.policy import Decision
from services.router.decide import Submission
from services.router.records import refusal_event, submitted_event, unqueued_failure
from services.runtime.bus import is_wrong_last_sequence, publish_event
from services.runtime.outcomes import last_on
from services.runtime.tracing import inject_context

log = structlog.get_logger("router")

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


class AlreadySubmitted(Exception):
    """A task of this id was routed by another request (two routers took one request that a
    client asked twice), or refused by another router (`record_refusal`): that stands, and
    this request follows it."""


async def submit(js: JetStreamContext, task: Submission, *, fences: bool) -> int:
    """Record and queue the task; returns its message's sequence in ``TASKS``. Raises
    `AlreadySubmitted` when another request routed a task of this id first. ``fences``: the
    server takes a fence on another subject (`fences_by_subject`)."""
    task_id, decision = task.task_id, task.decision
    # Both events go out at once and their acknowledgements are awaited together: one
    # round trip instead of two. One connection keeps their order in EVENTS, and the task
    # is queued only once both are stored.
    submitted: object
    routed: PubAck | BaseException
    event = submitted_event(task)
    first = routed_event(
        event, 1, decision, reason=decision.reason, domain=task.plan.domain, at=time.time()
    )
    # The routing only while no router has recorded a refusal of this task (`record_refusal`).
    unrefused = (task_event(task_id, "failed"), 0) if fences else None
    submitted, routed = await asyncio.gather(
        through_outage(lambda: publish_event(js, event, msg_id=message_ids.submitted(task_id))),
        through_outage(
            lambda: publish_event(
                js, first, msg_id=message_ids.routed(task_id, 1), expect_last=unrefused
            )
        ),
        return_exceptions=True,
    )
    if isinstance(routed, BaseException) and is_wrong_last_sequence(routed):
        # A router refused the request, asked again, first: the refusal stands.
        raise AlreadySubmitted(task_id)
    if isinstance(routed, BaseException):
        # Whose routing the stream holds, if any, is unknown: nothing is failed (see above).
        failed = submitted if isinstance(submitted, BaseException) else routed
        raise Unavailable(f"could not record the task: {failed or type(failed).__name__}") from (
            failed
        )
    if routed.duplicate:
        await _check_own_routing(js, task_id, first.at)
    if isinstance(submitted, BaseException):
        # This request's routing must end: the reaper would otherwise look for it.
        reason = f"its submission was not stored ({submitted})"
        await fail_unqueued(js, task_id, decision, reason, int(routed.seq) if fences else None)
        raise Unavailable(f"could not record the task: {submitted!r}") from submitted
    message = encoder.encode(task_message(event, 1, int(routed.seq)))
    # The worker continues this request's trace (traceparent).
    headers = inject_context({"Nats-Msg-Id": message_ids.task_message(task_id, 1)})
    try:
        # Tried until the stream says it holds the message (a duplicate of a try that was
        # stored with its acknowledgement lost counts): given up on sooner, a message that
        # was stored would run while its client is told the task failed.
        ack = await through_outage(lambda: js.publish(decision.queue, message, headers=headers))
    except Exception as exc:
        reason = f"could not queue the task on {decision.queue}: {exc or type(exc).__name__}"
        await fail_unqueued(js, task_id, decision, reason, int(routed.seq) if fences else None)
        raise Unavailable(f"task {task_id}: {reason}") from exc
    return int(ack.seq)


async def record_refusal(js: JetStreamContext, task_id: str, refused: CoordinatorError) -> bool:
    """Store the refusal of a request that named its task, only while the task has no
    ``routed`` (needs `services.runtime.bus.fences_by_subject`), once (its message id:
    another router's refusal of the request asked again is the same one). False when the
    fence refused it: a router routed the task meanwhile (or, on a replicated stream, is
    storing its routing or another refusal of it this instant); the request follows what the
    log holds (`services.router.following`). True when the refusal is stored, and when the
    log could not be asked: the request is refused then as it was before refusals were
    stored."""
    try:
        await publish_event(
            js,
            refusal_event(task_id, refused, time.time()),
            msg_id=message_ids.refused(task_id),
            expect_last=(task_event(task_id, "routed"), 0),
        )
    except Exception as exc:
        if is_wrong_last_sequence(exc):
            return False
        log.warning("the refusal was not stored", task_id=task_id, error=repr(exc))
    return True


async def _check_own_routing(js: JetStreamContext, task_id: str, routed_at: float) -> None:
    """After a ``routed`` the stream took as a duplicate: is the stored one this request's
    (sent again through an outage), or another request's? Raise `AlreadySubmitted` then."""
    data = await last_on(js, task_event(task_id, "routed"))
    stored = task_event_decoder.decode(data) if data is not None else None
    if not isinstance(stored, TaskRouted) or stored.at != routed_at:
        raise AlreadySubmitted(task_id)


async def fail_unqueued(
    js: JetStreamContext, task_id: str, decision: Decision, reason: str, routed_seq: int | None
) -> None:
    """Record the end of a task this request routed but could not queue (best effort); with
    ``routed_seq`` (its ``routed``'s sequence), only while that routing is the task's last."""
    log.warning("task not queued; failed", task_id=task_id, queue=decision.queue, reason=reason)
    with suppress(Exception):
        await publish_event(
            js,
            unqueued_failure(task_id, decision, reason, time.time()),
            msg_id=message_ids.failed_before_routing(task_id, "router"),
            expect_last=None if routed_seq is None else (task_event(task_id, "routed"), routed_seq),
        )
