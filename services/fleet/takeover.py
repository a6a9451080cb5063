"""What a web worker does with a task message that was delivered before (pure).

All web workers share one consumer, so when a web worker dies mid-task (or its ``in_progress``
signals stop reaching the server), ``ack_wait`` hands the message to another one. Web-search
tasks are not run twice (lesson 8: their failures surface, never hide), so the other worker
does not simply run it again:

- nobody started it (it sat in a stopped worker's fetch buffer): run it, it is a first run;
- its starter is still alive and still on it (heartbeat fresh, ``current_task`` is this task):
  wait and look again once that heartbeat would be stale;
- otherwise the starter is gone: fail the task, naming the worker and host that lost it.

(A stored outcome is checked before this: then the message is only acknowledged.)
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from schemas.events import TaskStarted
from schemas.workers import WorkerRecord
from services.fleet.liveness import is_live, stale_in

# Shortest wait before looking at a live starter again.
MIN_RECHECK_S = 0.5


@dataclass(frozen=True, slots=True)
class Run:
    """Nobody began the task: run it."""


@dataclass(frozen=True, slots=True)
class Wait:
    """The starter is alive and on the task: return the message and look again later."""

    delay_s: float


@dataclass(frozen=True, slots=True)
class Lost:
    """The starter is gone; ``reason`` names it. Fail the task, do not run it again."""

    reason: str


def on_redelivery(
    started: TaskStarted | None, starter: WorkerRecord | None, *, now: float, ttl_s: float
) -> Run | Wait | Lost:
    """Decide from the attempt's ``started`` event and its starter's registry entry (if any)."""
    if started is None:
        return Run()
    if (
        starter is not None
        and starter.worker_id == started.worker
        and starter.current_task == started.task_id
        and is_live(starter, now, ttl_s)
    ):
        return Wait(delay_s=max(stale_in(starter.heartbeat_at, now, ttl_s), MIN_RECHECK_S))
    return Lost(reason=lost_reason(started))


def lost_reason(started: TaskStarted) -> str:
    """Why the task failed: which worker on which host began it, and when."""
    when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started.at))
    return (
        f"web worker '{started.worker}' on host {started.host} started this task at {when} "
        f"(attempt {started.attempt}) and never recorded its outcome: it stopped, crashed or "
        "lost the bus. Web-search tasks are not run twice; ask again if the question stands."
    )
