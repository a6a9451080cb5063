"""The reaper's in-memory view of tasks, workers and queues. Pure: no I/O, no clock.

Fed like the router's (docs/design.md: router and reaper never query Postgres): the
``workers`` bucket by a KV watch, the tasks by the ``EVENTS`` stream (read back
``REAPER_LOOKBACK_S`` at start, so a restarted reaper knows what is still under way), and the
queues by JetStream's consumer info, sampled at each look.

A task's track follows the same fencing as the stats projection: every event after
``submitted`` names an attempt; one of a lower attempt than the track's is stale and changes
nothing, one of a higher attempt starts that attempt.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from typing import Literal, assert_never

from schemas.events import (
    TaskCompleted,
    TaskEvent,
    TaskFailed,
    TaskRouted,
    TaskStarted,
    TaskSubmitted,
)
from schemas.models import needs_of
from schemas.route import TaskType
from schemas.tasks import is_retryable
from schemas.workers import WorkerRecord
from services.fleet.binding import refusal
from services.fleet.figures import Figures

TaskStatus = Literal["unrouted", "queued", "running", "retry", "ended"]
"""``unrouted``: submitted, never routed. ``retry``: a worker ran the current attempt and
reported a retryable failure (the reaper moves it on or fails it for good)."""

# Ended tasks are kept this long (seconds) so that a late event of theirs is recognised as stale.
ENDED_KEPT_S = 3600.0


@dataclass(frozen=True, slots=True, kw_only=True)
class TaskTrack:
    """What the reaper knows of one task."""

    task_id: str
    model: str = ""
    task_type: TaskType = "inference"
    timeout_s: float = 0.0
    designated: str | None = None
    """The worker the client asked for by name: the task is never moved to another."""
    attempt: int = 0
    status: TaskStatus = "unrouted"
    since: float
    """When the task entered its status (submitted, routed, first started, ended)."""
    worker: str | None = None
    """Where the current attempt was routed: a worker id, or a pool (``shared``, ``web``)."""
    queue: str | None = None
    runner: str | None = None
    """The worker that started the current attempt."""
    failure_code: str | None = None
    """The retryable failure of the current attempt (status ``retry``)."""
    needs: tuple[str, ...] = ()
    """The model capabilities the task needs (`schemas.models.needs_of`); () before its
    submission is seen."""
    domain: str | None = None
    """The domain its routing used (from its ``routed``, else as submitted): which figures
    count for it. None: not known (events that predate it)."""

    @property
    def holder(self) -> str | None:
        """The worker the task waits on: the one running it, else the one it was routed to."""
        return self.runner or self.worker

    @property
    def open(self) -> bool:
        """Not ended: the reaper may have to act on it."""
        return self.status != "ended"


def track(state: TaskTrack | None, event: TaskEvent) -> TaskTrack:
    """The task's track after ``event``; ``state`` is None for a task not seen before."""
    match event:
        case TaskSubmitted():
            if state is None:
                return TaskTrack(
                    task_id=event.task_id,
                    model=event.model,
                    task_type=event.work.task_type,
                    timeout_s=event.timeout_s,
                    designated=event.requested_worker,
                    since=event.at,
                    needs=needs_of(event.work),
                    domain=event.work.domain,
                )
            return dataclasses.replace(
                state,
                model=event.model,
                task_type=event.work.task_type,
                timeout_s=event.timeout_s,
                designated=event.requested_worker,
                needs=needs_of(event.work),
                domain=state.domain or event.work.domain,
            )
        case TaskRouted():
            current = state or TaskTrack(task_id=event.task_id, since=event.at)
            if event.attempt < current.attempt or current.status == "ended":
                return current  # a task's end stands: a move that raced it went no further
            if event.attempt == current.attempt and current.status not in ("unrouted", "queued"):
                return current  # a repeated `routed` of an attempt under way or over
            return dataclasses.replace(
                current,
                attempt=event.attempt,
                status="queued",
                since=event.at,
                worker=event.worker,
                queue=event.queue,
                runner=None,
                failure_code=None,
                domain=event.domain or current.domain,
            )
        case TaskStarted():
            current = state or TaskTrack(task_id=event.task_id, since=event.at)
            if event.attempt < current.attempt:
                return current
            if event.attempt == current.attempt and current.status in ("running", "retry", "ended"):
                return current  # a redelivered message started again: the first start counts
            return dataclasses.replace(
                current,
                attempt=event.attempt,
                status="running",
                since=event.at,
                runner=event.worker,
                worker=current.worker if event.attempt == current.attempt else None,
                queue=current.queue if event.attempt == current.attempt else None,
                failure_code=None,
            )
        case TaskCompleted():
            current = state or TaskTrack(task_id=event.task_id, since=event.at)
            if event.attempt < current.attempt:
                return current
            return dataclasses.replace(
                current, attempt=event.attempt, status="ended", since=event.at, failure_code=None
            )
        case TaskFailed():
            current = state or TaskTrack(task_id=event.task_id, since=event.at)
            if event.attempt < current.attempt:
                return current
            if event.attempt == current.attempt and current.status in ("retry", "ended"):
                return current  # the first outcome of an attempt stands
            if _moves_on(current, event):
                return dataclasses.replace(
                    current, status="retry", since=event.at, failure_code=event.code
                )
            return dataclasses.replace(
                current, attempt=event.attempt, status="ended", since=event.at, failure_code=None
            )
        case _:
            assert_never(event)


def routing(state: TaskTrack | None) -> tuple[int, str | None] | None:
    """The task's latest routed attempt and where to (`services.fleet.binding.refusal`); None
    before any ``routed`` is known."""
    if state is None or state.attempt == 0:
        return None
    return state.attempt, state.worker


def _moves_on(current: TaskTrack, failed: TaskFailed) -> bool:
    """A retryable failure reported by the worker that was running the attempt, of a task kind
    that may run again: the reaper moves it on. (The router's own failures name no runner.)"""
    return (
        failed.retryable
        and failed.attempt == current.attempt
        and current.status == "running"
        and failed.worker is not None
        and failed.worker == current.runner
        and is_retryable(current.task_type)
    )


@dataclass(frozen=True, slots=True)
class ConsumerSample:
    """The parts of one JetStream consumer info the detectors use."""

    num_pending: int
    num_ack_pending: int
    num_waiting: int
    delivered_seq: int
    ack_floor_seq: int
    ack_wait_s: float = 30.0
    """The consumer's ack wait: a message in flight that nobody settles is handed out again
    after it."""


@dataclass(frozen=True, slots=True)
class ConsumerHistory:
    """One queue consumer as seen over the reaper's looks."""

    exists: bool
    num_pending: int
    num_ack_pending: int
    num_waiting: int
    delivered_seq: int
    ack_floor_seq: int
    last_progress: float
    """The last look that saw work move on it: a task delivered or acknowledged since the look
    before. The first look counts (what came before it is unknown). A task merely in flight is
    no progress: the process it was handed to may be gone, and its worker says whether it is
    busy (`detectors.ghost_pending`)."""
    crowded: int
    """Looks in a row that saw more than one pull waiting while no task was in flight. (One
    process pulls one request at a time; while the consumer is at its one task in flight,
    requests can pile up until the server expires them, so those looks do not count.)"""
    ack_wait_s: float = 30.0
    """The consumer's ack wait (`ConsumerSample.ack_wait_s`)."""


def observe(
    before: ConsumerHistory | None, sample: ConsumerSample | None, now: float
) -> ConsumerHistory:
    """The consumer's history after one more look; ``sample`` None: the consumer does not exist."""
    if sample is None:
        last_progress = before.last_progress if before is not None and not before.exists else now
        return ConsumerHistory(
            exists=False,
            num_pending=0,
            num_ack_pending=0,
            num_waiting=0,
            delivered_seq=0,
            ack_floor_seq=0,
            last_progress=last_progress,
            crowded=0,
        )
    moved = before is None or (
        sample.delivered_seq != before.delivered_seq or sample.ack_floor_seq != before.ack_floor_seq
    )
    last_progress = now if moved or before is None else before.last_progress
    crowding = sample.num_waiting > 1 and sample.num_ack_pending == 0
    crowded = ((before.crowded if before is not None else 0) + 1) if crowding else 0
    return ConsumerHistory(
        exists=True,
        num_pending=sample.num_pending,
        num_ack_pending=sample.num_ack_pending,
        num_waiting=sample.num_waiting,
        delivered_seq=sample.delivered_seq,
        ack_floor_seq=sample.ack_floor_seq,
        last_progress=last_progress,
        crowded=crowded,
        ack_wait_s=sample.ack_wait_s,
    )


@dataclass(frozen=True, slots=True)
class Instance:
    """One process seen serving a worker id."""

    instance_id: str
    host: str
    seen_at: float
    """Its latest heartbeat (or registration), by its own clock."""


@dataclass
class ReaperView:
    """Everything the detectors look at, kept up to date by the service's feeds."""

    tasks: dict[str, TaskTrack] = field(default_factory=dict)
    workers: dict[str, WorkerRecord] = field(default_factory=dict)
    asleep: set[str] = field(default_factory=set)
    """Workers whose machine sleeps: the router wakes them and owns their tasks' fate."""
    consumers: dict[str, ConsumerHistory] = field(default_factory=dict)
    instances: dict[str, dict[str, Instance]] = field(default_factory=dict)
    figures: Figures = field(default_factory=Figures)
    """The stats service's routing figures (the ``stats`` bucket), as the router has them."""

    def apply(self, event: TaskEvent, source: str | None = None) -> str | None:
        """Fold one task event, recorded by the worker ``source`` (None: by the router or the
        reaper), into the view. A worker's event it may not record (`services.fleet.binding`)
        changes nothing: returns why."""
        before = self.tasks.get(event.task_id)
        if isinstance(event, TaskStarted | TaskCompleted | TaskFailed):
            problem = refusal(event, source, routing(before), self.supports)
            if problem is not None:
                return problem
        self.tasks[event.task_id] = track(before, event)
        return None

    def supports(self, worker_id: str) -> Collection[str] | None:
        """What a registered worker supports; None for one not registered now."""
        record = self.workers.get(worker_id)
        return None if record is None else record.supports

    def put_worker(self, record: WorkerRecord) -> None:
        self.workers[record.worker_id] = record
        self.seen(record.worker_id, record.instance_id, record.host, record.heartbeat_at)

    def remove_worker(self, worker_id: str) -> None:
        """Its lease was released or expired: it is gone, and so are its instances."""
        self.workers.pop(worker_id, None)
        self.instances.pop(worker_id, None)

    def records(self) -> Iterable[WorkerRecord]:
        return self.workers.values()

    def seen(self, worker_id: str, instance_id: str, host: str, at: float) -> None:
        """A heartbeat or registration of one instance of ``worker_id``."""
        known = self.instances.setdefault(worker_id, {})
        before = known.get(instance_id)
        if before is None or at > before.seen_at:
            known[instance_id] = Instance(instance_id, host, at)

    def stopped(self, worker_id: str, instance_id: str) -> None:
        """An instance said it stopped: a successor is no duplicate of it."""
        self.instances.get(worker_id, {}).pop(instance_id, None)

    def observe(self, name: str, sample: ConsumerSample | None, now: float) -> None:
        self.consumers[name] = observe(self.consumers.get(name), sample, now)

    def prune(self, now: float, kept_s: float = ENDED_KEPT_S) -> None:
        """Forget tasks that ended more than ``kept_s`` ago, and instances long silent."""
        for task_id in [t for t, s in self.tasks.items() if not s.open and now - s.since > kept_s]:
            del self.tasks[task_id]
        for worker_id, known in list(self.instances.items()):
            for instance_id in [i for i, seen in known.items() if now - seen.seen_at > kept_s]:
                del known[instance_id]
            if not known:
                del self.instances[worker_id]

    def queued(self) -> dict[str, Counter[tuple[str | None, str | None]]]:
        """Open tasks per worker they wait on, by model and domain (the work queued ahead of
        a task the routing policy sends there; `services.fleet.figures.Queued`)."""
        counts: dict[str, Counter[tuple[str | None, str | None]]] = {}
        for task in self.tasks.values():
            if task.status in ("queued", "running") and task.holder is not None:
                work = (task.model or None, task.domain)
                counts.setdefault(task.holder, Counter())[work] += 1
        return counts
