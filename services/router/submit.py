"""Recording and queueing a task: its ``submitted`` and ``routed`` events, then its message on
the worker's queue (`services.runtime.dispatch`, as the reaper's moves); a task routed by this
request but not queued is recorded as failed.

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

import time
from contextlib import suppress

import structlog
from nats.js import JetStreamContext

from schemas import message_ids
from schemas.events import TaskRouted
from schemas.subjects import task_event
from services.errors import CoordinatorError, Unavailable
from services.fleet.dispatch import routed_event
from services.fleet.policy import Decision
from services.router.decide import Submission
from services.router.records import refusal_event, submitted_event, unqueued_failure
from services.runtime.bus import is_wrong_last_sequence, publish_event
from services.runtime.dispatch import NotQueued, RoutedElsewhere, dispatch

log = structlog.get_logger("router")


class AlreadySubmitted(Exception):
    """A task of this id was routed by another request (two routers took one request that a
    client asked twice), or refused by another router (`record_refusal`): that stands, and
    this request follows it."""


async def submit(js: JetStreamContext, task: Submission, *, fences: bool) -> int:
    """Record and queue the task; returns its message's sequence in ``TASKS``. Raises
    `AlreadySubmitted` when another request routed a task of this id first. ``fences``: the
    server takes a fence on another subject (`fences_by_subject`)."""
    task_id, decision = task.task_id, task.decision
    event = submitted_event(task)
    first = routed_event(
        event, 1, decision, reason=decision.reason, domain=task.plan.domain, at=time.time()
    )

    def ours(stored: TaskRouted) -> bool:
        # Sent again through an outage, the stored routing is this very one; another
        # request's (a client that asked twice) was made at another time.
        return stored.at == first.at

    try:
        return await dispatch(
            js,
            event,
            first,
            ours=ours,
            # The routing only while no router has recorded a refusal of this task.
            fence=(task_event(task_id, "failed"), 0) if fences else None,
            with_submission=True,
        )
    except RoutedElsewhere as exc:
        raise AlreadySubmitted(task_id) from exc
    except NotQueued as exc:
        # This request's routing must end: the reaper would otherwise look for it.
        routed_seq = exc.routed_seq if fences else None
        await fail_unqueued(js, task_id, decision, exc.reason, routed_seq)
        raise Unavailable(f"task {task_id}: {exc.reason}") from exc
    except Exception as exc:
        if is_wrong_last_sequence(exc):
            # A router refused the request, asked again, first: the refusal stands.
            raise AlreadySubmitted(task_id) from exc
        # Whose routing the stream holds, if any, is unknown: nothing is failed (see above).
        raise Unavailable(f"could not record the task: {exc or type(exc).__name__}") from exc


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
