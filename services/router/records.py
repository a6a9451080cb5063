"""What the router records and queues for a task, and what it answers. Pure: no I/O.

The events (``submitted``, the ``failed`` of a task the router could not queue or whose woken
worker never started it, or refused before any routing; an attempt's ``routed`` event and
task message are `services.fleet.dispatch`'s), and the route reply built from a task's
outcome, with its failure as data (``failure``: code and reason apart).
"""

from __future__ import annotations

from collections.abc import Iterable

from schemas.events import TaskCompleted, TaskFailed, TaskSubmitted
from schemas.route import ErrorDetail, RouteReply
from services.errors import CoordinatorError, Unavailable, WakeTimeout
from services.fleet.policy import Decision
from services.router.decide import Submission


def submitted_event(task: Submission) -> TaskSubmitted:
    request = task.request
    return TaskSubmitted(
        at=task.submitted_at,
        task_id=task.task_id,
        model=request.model,
        requested_worker=request.worker,
        requested_model=task.requested_model,
        timeout_s=task.timeout_s,
        client=request.client,
        asker=task.asker,
        work=task.work,
    )


def unqueued_failure(task_id: str, decision: Decision, reason: str, at: float) -> TaskFailed:
    """The end of a task that was recorded but could not be queued: retryable (the bus)."""
    return TaskFailed(
        at=at,
        task_id=task_id,
        attempt=1,
        worker=decision.worker_id,
        code=Unavailable.code,
        reason=reason,
        retryable=True,
    )


REFUSED_ATTEMPT = 0
"""The attempt a refusal's ``failed`` names: none ran, nor was routed (the first is 1)."""


def refusal_event(task_id: str, refused: CoordinatorError, at: float) -> TaskFailed:
    """A refusal of a request that named its task, as the log keeps it (`services.router.
    submit.record_refusal`): its code and message are what the client is told."""
    return TaskFailed(
        at=at,
        task_id=task_id,
        attempt=REFUSED_ATTEMPT,
        worker=None,
        code=refused.code,
        reason=str(refused),
    )


def is_refusal(event: object) -> bool:
    """Is ``event``, stored on the task's router subject, a recorded refusal?"""
    return isinstance(event, TaskFailed) and event.attempt == REFUSED_ATTEMPT


def wake_failure(task_id: str, worker_id: str, wake_wait_s: float, at: float) -> TaskFailed:
    """The end of a task whose sleeping worker was woken but did not start it in time."""
    return TaskFailed(
        at=at,
        task_id=task_id,
        attempt=1,
        worker=worker_id,
        code=WakeTimeout.code,
        reason=(
            f"worker '{worker_id}' was woken but did not start the task within "
            f"{wake_wait_s:g} s (WAKE_WAIT_S)"
        ),
    )


def latest_outcome(
    ended: Iterable[TaskCompleted | TaskFailed],
) -> TaskCompleted | TaskFailed | None:
    """The outcome that answers the client of a task that may have been moved on: the
    latest attempt's, a completion before a failure of the same attempt."""
    return max(ended, key=lambda e: (e.attempt, isinstance(e, TaskCompleted)), default=None)


def queued_reply(task: Submission) -> RouteReply:
    """The answer to a client that does not wait."""
    decision = task.decision
    return RouteReply(
        task_id=task.task_id, status="queued", queue=decision.queue, worker=decision.worker_id
    )


def outcome_reply(task: Submission, outcome: TaskCompleted | TaskFailed) -> RouteReply:
    """The answer to a client that waited: the task's output, or why it failed."""
    return ended_reply(task.task_id, task.decision.queue, task.decision.worker_id, outcome)


def ended_reply(
    task_id: str, queue: str, routed_to: str, outcome: TaskCompleted | TaskFailed
) -> RouteReply:
    """The answer for a task that ended (``queue``, ``routed_to``: where it was routed)."""
    if isinstance(outcome, TaskCompleted):
        return RouteReply(
            task_id=task_id,
            status="done",
            queue=queue,
            worker=outcome.worker,
            response=outcome.response,
            thinking=outcome.thinking,
            model=outcome.model,
            host=outcome.host,
            sources=outcome.sources,
            note=outcome.note,
            durations=outcome.durations,
            tokens=outcome.tokens,
            tool_calls=outcome.tool_calls,
            done_reason=outcome.done_reason,
            embeddings=outcome.embeddings,
        )
    failure = ErrorDetail(code=outcome.code, message=outcome.reason)
    return RouteReply(
        task_id=task_id,
        status="failed",
        queue=queue,
        worker=outcome.worker or routed_to,
        error=failure.summary,
        failure=failure,
    )
