"""What is wrong right now, from one snapshot of the reaper's view. Pure: no I/O, no clock.

Each detector has its threshold (`Thresholds`, from ``ReaperSettings``):

- **dead worker** (``dead_worker``): a task is queued on or running at a worker whose lease is
  gone, whose heartbeat is older than ``WORKER_TTL_S``, or whose fresh heartbeat says it is no
  longer running the task it started (it was restarted);
- **degraded worker** (``degraded_worker``): a task queued (not yet running) on the own queue
  of a live worker whose own probe says its backend is degraded: it pulls nothing until the
  backend works again, so the task is moved on like a dead worker's;
- **stuck task** (``stuck_task``): running longer than its own timeout plus ``STUCK_GRACE_S``;
- **ghost queue** (``ghost_pending``): queued for ``GHOST_AFTER_S`` on a queue where nothing
  has been delivered or acknowledged for as long while its worker is live and idle (registered
  but not pulling, pulling something else, or its one task in flight handed to a process that
  is gone, for longer than the consumer's ack wait plus ``GHOST_AFTER_S``: the server hands
  such a task out again after its ack wait); on a pool queue no live worker can pull; or whose
  message is missing; and a task submitted that long ago that was never routed;
- **retryable failure** (the failure's own code, e.g. ``backend_unavailable``): the worker that
  ran the attempt reported a failure another worker may not have;
- **duplicate consumer** (``duplicate_consumer``): more than one pull waiting on a worker's
  ``max_ack_pending=1`` consumer for ``DUPLICATE_SAMPLES`` looks in a row, or two instances of
  one worker id heartbeating within one TTL of each other.

A task gets at most one finding per look, in the order above (a dead worker's running task is
not also called stuck). Nothing here acts: `decisions.decide` says what to do with a finding.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Final

from schemas.subjects import POOL_NAMES, WEB, queue_consumer, worker_consumer
from schemas.workers import WorkerRecord
from services.fleet.health import degraded_reason, routable
from services.fleet.liveness import is_live, live
from services.reaper.view import ConsumerHistory, Instance, TaskTrack

DEAD_WORKER: Final = "dead_worker"
DEGRADED_WORKER: Final = "degraded_worker"
STUCK_TASK: Final = "stuck_task"
GHOST_PENDING: Final = "ghost_pending"
DUPLICATE_CONSUMER: Final = "duplicate_consumer"


@dataclass(frozen=True, slots=True)
class Thresholds:
    dead_after_s: float
    """``WORKER_TTL_S``: a heartbeat older than this is a dead worker's."""
    stuck_grace_s: float
    ghost_after_s: float
    duplicate_samples: int


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The view at one moment."""

    now: float
    tasks: Mapping[str, TaskTrack]
    workers: Mapping[str, WorkerRecord]
    asleep: Collection[str] = ()
    consumers: Mapping[str, ConsumerHistory] = field(default_factory=dict)
    instances: Mapping[str, Mapping[str, Instance]] = field(default_factory=dict)
    settling: bool = False
    """The registry is being read (again, after a reconnect to NATS) and has not settled
    (`services.fleet.settling`): heartbeats from before the outage would make live workers
    look dead, so no verdict that a worker is not live is made (no dead worker, no ghost
    queue)."""


@dataclass(frozen=True, slots=True)
class TaskFinding:
    """A task the reaper must move on or fail."""

    task_id: str
    attempt: int
    reason: str
    """``dead_worker``, ``stuck_task``, ``ghost_pending``, or a retryable failure's code."""
    worker: str | None
    """The worker the task must not go back to (None: any will do)."""
    detail: str
    """What was seen, for the log and the failure's reason."""
    if_missing: bool = False
    """Act only if the task's message is not in its queue (looked up before acting): a busy
    worker's queue holds fewer messages than the tasks waiting on it, so some are missing,
    and which ones only the queue can tell."""


@dataclass(frozen=True, slots=True)
class DuplicateFinding:
    """More than one process serves one worker id (lesson 2)."""

    worker_id: str
    detail: str
    num_waiting: int | None = None
    instances: tuple[str, ...] = ()
    hosts: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Findings:
    tasks: list[TaskFinding]
    duplicates: list[DuplicateFinding]


def detect(snapshot: Snapshot, thresholds: Thresholds) -> Findings:
    """Every finding of this snapshot: at most one per open task, one per duplicated worker."""
    found: list[TaskFinding] = []
    waiting = waiting_by_consumer(snapshot, thresholds)
    for task in sorted(snapshot.tasks.values(), key=lambda t: (t.since, t.task_id)):
        if not task.open:
            continue
        finding = (
            retryable_failure(task)
            or dead_worker(task, snapshot, thresholds)
            or degraded_worker(task, snapshot, thresholds)
            or stuck_task(task, snapshot, thresholds)
            or ghost_pending(task, snapshot, thresholds, waiting)
        )
        if finding is not None:
            found.append(finding)
    return Findings(tasks=found, duplicates=duplicates(snapshot, thresholds))


def retryable_failure(task: TaskTrack) -> TaskFinding | None:
    """The worker that ran the current attempt failed it, and another worker may not."""
    if task.status != "retry":
        return None
    return TaskFinding(
        task_id=task.task_id,
        attempt=task.attempt,
        reason=task.failure_code or "failed",
        worker=task.runner,
        detail=f"worker '{task.runner}' failed attempt {task.attempt} ({task.failure_code})",
    )


def dead_worker(task: TaskTrack, snap: Snapshot, th: Thresholds) -> TaskFinding | None:
    """Queued on or running at a worker that is gone (or came back without the task)."""
    holder = task.holder
    if (
        task.status not in ("queued", "running")
        or holder is None
        or holder in POOL_NAMES
        or holder in snap.asleep
        or snap.settling
    ):
        return None
    record = snap.workers.get(holder)
    if record is None:
        if snap.now - task.since <= th.dead_after_s:
            return None  # just routed: the registry's news may still be on its way
        detail = f"worker '{holder}' holds no lease (stopped, or its entry expired)"
    elif not is_live(record, snap.now, th.dead_after_s):
        age = snap.now - record.heartbeat_at
        detail = (
            f"worker '{holder}' is stopping"
            if record.state == "stopping"
            else f"worker '{holder}' last heartbeat {age:.1f} s ago (over {th.dead_after_s:g} s)"
        )
    elif (
        task.status == "running"
        and record.heartbeat_at > task.since
        and record.current_task != task.task_id
    ):
        # It set `current_task` before it emitted `started`, so a heartbeat written after the
        # start that names another task (or none) comes from a process that lost this one.
        detail = (
            f"worker '{holder}' (instance {record.instance_id}, started "
            f"{snap.now - record.started_at:.1f} s ago) is not running the task it started"
        )
    else:
        return None
    return TaskFinding(task.task_id, task.attempt, DEAD_WORKER, holder, detail)


def degraded_worker(task: TaskTrack, snap: Snapshot, th: Thresholds) -> TaskFinding | None:
    """Queued on the own queue of a live worker whose backend is degraded (it pulls nothing
    meanwhile)."""
    if task.status != "queued" or task.worker is None or task.worker in POOL_NAMES:
        return None
    record = snap.workers.get(task.worker)
    if record is None or not is_live(record, snap.now, th.dead_after_s) or routable(record):
        return None
    detail = f"queued on {task.queue}; {degraded_reason(record)}"
    return TaskFinding(task.task_id, task.attempt, DEGRADED_WORKER, task.worker, detail)


def stuck_task(task: TaskTrack, snap: Snapshot, th: Thresholds) -> TaskFinding | None:
    """Running past its own timeout plus the grace: the worker's backend call never ended."""
    if task.status != "running" or task.runner is None:
        return None
    running_s = snap.now - task.since
    if running_s <= task.timeout_s + th.stuck_grace_s:
        return None
    detail = (
        f"running on '{task.runner}' for {running_s:.0f} s, past its timeout of "
        f"{task.timeout_s:g} s and a grace of {th.stuck_grace_s:g} s"
    )
    return TaskFinding(task.task_id, task.attempt, STUCK_TASK, task.runner, detail)


def waiting_by_consumer(snap: Snapshot, th: Thresholds) -> Counter[str]:
    """How many messages the queue of each consumer should hold at least: one per task running
    from it (in flight), one per task queued on it for over ``GHOST_AFTER_S`` (younger ones
    may not be queued yet)."""
    return Counter(
        queue_consumer(t.queue)
        for t in snap.tasks.values()
        if t.open and t.queue is not None
        if t.status == "running" or (t.status == "queued" and snap.now - t.since > th.ghost_after_s)
    )


def ghost_pending(
    task: TaskTrack, snap: Snapshot, th: Thresholds, waiting: Counter[str]
) -> TaskFinding | None:
    """Waiting where nothing will ever take it. ``waiting``: `waiting_by_consumer`."""
    waited_s = snap.now - task.since
    if waited_s <= th.ghost_after_s:
        return None
    if task.status == "unrouted":
        detail = f"submitted {waited_s:.0f} s ago and never routed (its router stopped midway?)"
        return TaskFinding(task.task_id, task.attempt, GHOST_PENDING, None, detail)
    if task.status != "queued" or task.queue is None or task.worker is None or snap.settling:
        return None  # while settling, "nobody pulls it" may be a worker not yet heard again
    history = snap.consumers.get(queue_consumer(task.queue))
    if history is None:
        return None  # not looked at yet
    idle_s = snap.now - history.last_progress
    missing = history.exists and history.num_pending == 0 and history.num_ack_pending == 0
    if task.worker in POOL_NAMES:
        pullers = _pool_pullers(task, snap, th)
        if not pullers:
            why = "no live worker that could pull it"
        elif idle_s <= th.ghost_after_s:
            return None
        elif not history.exists:
            why = f"{len(pullers)} live worker(s) could pull it but none ever has"
        elif missing:
            why = "its message is missing from the queue"
        elif history.num_waiting == 0 and not any(w.state == "busy" for w in pullers):
            why = f"{len(pullers)} live worker(s) could pull it, are idle, and none does"
        else:
            return None  # the pool is busy: the task waits its turn
        detail = f"queued on {task.queue} for {waited_s:.0f} s; {why}"
        return TaskFinding(task.task_id, task.attempt, GHOST_PENDING, None, detail)
    record = snap.workers.get(task.worker)
    if record is None or not is_live(record, snap.now, th.dead_after_s):
        return None  # a dead worker's task is `dead_worker`'s
    if record.state == "busy":
        # A busy worker gets to its queue in turn, unless the queue holds fewer messages than
        # the tasks running from it and waiting on it: then some message is missing, and the
        # task would wait for as long as the worker stays busy.
        held = history.num_pending + history.num_ack_pending
        if not history.exists or waiting[queue_consumer(task.queue)] <= held:
            return None
        detail = (
            f"queued on {task.queue} for {waited_s:.0f} s; worker '{task.worker}' is busy, "
            f"but its queue holds {held} message(s) for "
            f"{waiting[queue_consumer(task.queue)]} task(s) running or waiting over "
            f"{th.ghost_after_s:g} s: its message is missing from the queue"
        )
        # Any worker will do, this one included: only the message is lost.
        return TaskFinding(task.task_id, task.attempt, GHOST_PENDING, None, detail, if_missing=True)
    if idle_s <= th.ghost_after_s:
        return None
    if not history.exists:
        why = f"its consumer {queue_consumer(task.queue)} does not exist"
    elif history.num_ack_pending > 0:
        if idle_s <= history.ack_wait_s + th.ghost_after_s:
            # The server hands a message in flight that nobody settles (its acknowledgement,
            # or its delivery, lost in a reconnect) out again after the ack wait, and the live
            # worker settles it then: no ghost before that.
            return None
        why = "the task in flight on its consumer is held by no process that works on it"
    elif missing:
        why = "its message is missing from the queue"
    elif history.num_waiting == 0:
        why = "nothing pulls its queue"
    else:
        why = "its queue's consumer delivers nothing (pulling another queue?)"
    detail = (
        f"queued on {task.queue} for {waited_s:.0f} s; worker '{task.worker}' is live and idle "
        f"but {why}"
    )
    return TaskFinding(task.task_id, task.attempt, GHOST_PENDING, task.worker, detail)


def _pool_pullers(task: TaskTrack, snap: Snapshot, th: Thresholds) -> list[WorkerRecord]:
    """Live workers that could take a task from its pool queue."""
    alive = live(snap.workers.values(), snap.now, th.dead_after_s)
    if task.worker == WEB.name:
        return [w for w in alive if "web_search" in w.supports]
    # Every worker that can run on its CPU binds the shared consumer (services/worker); a
    # degraded one pulls nothing.
    return [
        w for w in alive if "cpu_inference" in w.supports and task.model in w.models and routable(w)
    ]


def duplicates(snap: Snapshot, th: Thresholds) -> list[DuplicateFinding]:
    """Worker ids served by more than one process right now."""
    found: list[DuplicateFinding] = []
    ids = sorted(set(snap.workers) | set(snap.instances))
    for worker_id in ids:
        history = snap.consumers.get(worker_consumer(worker_id))
        crowded = history is not None and history.crowded >= th.duplicate_samples
        fresh = sorted(
            (
                i
                for i in snap.instances.get(worker_id, {}).values()
                if snap.now - i.seen_at < th.dead_after_s
            ),
            key=lambda i: i.instance_id,
        )
        details: list[str] = []
        if crowded and history is not None:
            details.append(
                f"{history.num_waiting} pulls wait on {worker_consumer(worker_id)}, which "
                "serves one process"
            )
        if len(fresh) > 1:
            named = ", ".join(f"{i.instance_id} on {i.host}" for i in fresh)
            details.append(f"instances {named} heartbeat within {th.dead_after_s:g} s")
        if not details:
            continue
        found.append(
            DuplicateFinding(
                worker_id=worker_id,
                detail=(
                    f"worker '{worker_id}' runs more than once: {'; '.join(details)}. Stop the "
                    "extra process (two units starting one worker make every task slower)."
                ),
                num_waiting=history.num_waiting if crowded and history is not None else None,
                instances=tuple(i.instance_id for i in fresh),
                hosts=tuple(sorted({i.host for i in fresh})),
            )
        )
    return found
