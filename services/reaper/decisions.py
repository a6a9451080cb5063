"""What the reaper does about a task finding: move it, or fail it saying why. Pure.

- A task of a kind that is not re-dispatched (``schemas.tasks.is_retryable``: web search)
  fails with the reason (lesson 8: its failures surface, never hide).
- A task the client asked a named worker for fails too: it is never silently rerouted (one
  its router never routed goes to that worker, if it is live).
- A task already tried ``MAX_ATTEMPTS`` times fails (``too_many_attempts``).
- Otherwise the routing policy the router applies (`services.fleet.policy.choose`) picks
  another live worker serving the model, any tier, never the one the finding names, with
  the router's estimates (the stats service's figures for the task's model and domain, and
  the tasks queued on each worker): the task is routed again as attempt N+1. When there is
  none it fails with ``no alternative worker can serve model '<m>' (reason=<reason>); single
  point of failure``.

While the registry is being read again after a reconnect to NATS (``settling``,
`services.fleet.settling`), a failure for want of a live worker (no alternative worker, a
named worker not live) is not made: the decision is to `Wait`, and the next look decides
again. A move to a worker that is live needs no wait.

Which attempt a failure belongs to: the attempt that could not run (N), except after a
retryable failure, whose attempt N already has its outcome; the reaper's verdict is then
attempt N+1, the one it found no worker for. Either way a later, stale outcome cannot win.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from schemas.models import DEFAULT_CAPABILITIES
from schemas.tasks import is_retryable
from schemas.workers import WorkerRecord
from services.errors import (
    NoAlternativeWorker,
    NoWorker,
    TooManyAttempts,
    UnsupportedCapability,
    WorkerLost,
    WorkerUnavailable,
)
from services.fleet.figures import Figures, Queued
from services.fleet.liveness import live
from services.fleet.policy import DEFAULT_GPU_PREFERENCE, Decision, choose
from services.reaper.detectors import DEAD_WORKER, TaskFinding
from services.reaper.view import TaskTrack


@dataclass(frozen=True, slots=True)
class Move:
    """Route the task again, as ``attempt``, where ``decision`` says."""

    task_id: str
    attempt: int
    decision: Decision
    reason: str
    """For the ``routed`` event: why it moved, and why there."""
    domain: str | None = None
    """The domain its routing used (recorded with the ``routed`` event)."""


@dataclass(frozen=True, slots=True)
class Wait:
    """Decide again at a later look: the view is settling, and the verdict would be that no
    live worker can take the task."""

    task_id: str
    attempt: int
    reason: str


@dataclass(frozen=True, slots=True)
class Fail:
    """End the task as failed."""

    task_id: str
    attempt: int
    worker: str | None
    code: str
    reason: str


def single_point_of_failure(model: str, reason: str) -> str:
    """The failure of a task no other worker can take (lesson 4's wording)."""
    return (
        f"no alternative worker can serve model '{model}' (reason={reason}); "
        "single point of failure"
    )


def decide(
    finding: TaskFinding,
    task: TaskTrack,
    workers: Collection[WorkerRecord],
    *,
    now: float,
    ttl_s: float,
    max_attempts: int,
    gpu_models: Collection[str] = (),
    gpu_preference: float = DEFAULT_GPU_PREFERENCE,
    figures: Figures | None = None,
    queued: Queued | None = None,
    settling: bool = False,
) -> Move | Fail | Wait:
    """Move ``task`` to another live worker, or fail it; ``workers`` is the whole registry,
    ``queued`` the open tasks per worker (`services.reaper.view.ReaperView.queued`). While
    ``settling``, `Wait` instead of failing it for want of a live worker."""
    moved_on = task.status == "retry"
    fail_attempt = task.attempt + 1 if moved_on else max(task.attempt, 1)

    def fail(code: str, reason: str) -> Fail:
        return Fail(task.task_id, fail_attempt, finding.worker, code, reason)

    if not is_retryable(task.task_type):
        code = WorkerLost.code if finding.reason == DEAD_WORKER else finding.reason
        return fail(
            code,
            f"{task.task_type} tasks are not re-dispatched (reason={finding.reason}): "
            f"{finding.detail}",
        )
    alive = live(workers, now, ttl_s)
    needs = task.needs or DEFAULT_CAPABILITIES
    if task.designated is not None and (task.status == "unrouted" or finding.if_missing):
        # Never routed (its router stopped midway), or its message lost on the way to a live
        # worker: route it (again) where the client asked.
        if task.attempt + 1 > max_attempts:
            return fail(
                TooManyAttempts.code,
                f"gave up after {task.attempt} attempts (reason={finding.reason}): "
                f"{finding.detail}",
            )
        try:
            decision = choose(task.model, alive, designated=task.designated, needs=needs)
        except (NoWorker, UnsupportedCapability) as exc:
            if settling:
                return Wait(task.task_id, task.attempt, f"{exc.message} (view settling)")
            return fail(WorkerUnavailable.code, f"{exc.message} (reason={finding.reason})")
        reason = f"routed by the reaper ({finding.detail})"
        return Move(task.task_id, task.attempt + 1, decision, reason, task.domain)
    if task.designated is not None:
        return fail(
            WorkerUnavailable.code,
            f"worker '{task.designated}' was asked for by name and cannot run the task "
            f"(reason={finding.reason}): {finding.detail}; a task for a named worker is not "
            "moved to another",
        )
    if not task.model:
        return fail(
            finding.reason,
            f"the task's submission is no longer in the event log, so it cannot be routed again "
            f"(reason={finding.reason}): {finding.detail}",
        )
    if task.attempt + 1 > max_attempts:
        return fail(
            TooManyAttempts.code,
            f"gave up after {task.attempt} attempts (reason={finding.reason}): {finding.detail}",
        )
    others = [w for w in alive if w.worker_id != finding.worker]
    candidates = [w.worker_id for w in others if task.model in w.models]
    domain = task.domain or ""  # unknown: the worker's figures for the model in any domain
    estimates = (figures or Figures()).estimates(task.model, domain, candidates, queued or {})
    try:
        decision = choose(
            task.model,
            others,
            gpu_models=gpu_models,
            gpu_preference=gpu_preference,
            estimates=estimates,
            needs=needs,
        )
    except (NoWorker, UnsupportedCapability) as exc:
        if settling:
            return Wait(task.task_id, task.attempt, f"{exc.message} (view settling)")
        return fail(NoAlternativeWorker.code, single_point_of_failure(task.model, finding.reason))
    return Move(
        task.task_id,
        task.attempt + 1,
        decision,
        f"moved by the reaper ({finding.reason}: {finding.detail}); {decision.reason}",
        task.domain,
    )
