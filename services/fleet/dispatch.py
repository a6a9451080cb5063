"""What an attempt goes out with: its ``routed`` event and its task message (pure).

The router dispatches attempt 1 of a task it submits, the reaper attempt N+1 of a task it
moves; both build them here from the task as it was submitted, so every attempt carries
everything the client asked (its `Work`), whoever routed it, and both send them out with
`services.runtime.dispatch.dispatch`.
"""

from __future__ import annotations

from schemas.events import TaskRouted, TaskSubmitted
from schemas.tasks import TaskMessage
from services.fleet.policy import Decision


def routed_event(
    submitted: TaskSubmitted,
    attempt: int,
    decision: Decision,
    *,
    reason: str,
    domain: str | None,
    at: float,
) -> TaskRouted:
    """Attempt ``attempt`` of ``submitted`` routed where ``decision`` says, for ``reason``."""
    return TaskRouted(
        at=at,
        task_id=submitted.task_id,
        attempt=attempt,
        worker=decision.worker_id,
        queue=decision.queue,
        reason=reason,
        model=submitted.model,
        domain=domain,
    )


def task_message(submitted: TaskSubmitted, attempt: int, routed_seq: int) -> TaskMessage:
    """The message on the worker's queue; ``routed_seq`` is the sequence of the attempt's
    ``routed`` event (a worker's fence)."""
    return TaskMessage(
        task_id=submitted.task_id,
        attempt=attempt,
        model=submitted.model,
        timeout_s=submitted.timeout_s,
        submitted_at=submitted.at,
        work=submitted.work,
        routed_seq=routed_seq,
    )
