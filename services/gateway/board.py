"""The dashboard's view of the tasks, folded from the event log: what is queued and running
now, the recent ends and failures, the reaper's actions, and one sample per done attempt for
the charts. Pure: no I/O, no clock (every time is an event's).

Each event is taken as the router and the stats projection take it (`services.fleet.binding`:
a worker's start or outcome only for an attempt routed to it or to its pool; an older
attempt's outcome is stale and changes nothing), and only the first outcome of an attempt
counts. What the board took is also returned as `Change` values, which the metrics
(`services.gateway.metrics`) count, so both read the log by the same rules.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Final, Literal

import msgspec

from schemas.events import (
    AnyEvent,
    Durations,
    TaskCompleted,
    TaskFailed,
    TaskRouted,
    TaskStarted,
    TaskSubmitted,
    Tokens,
    WorkerDuplicate,
)
from schemas.stats import COLD_LOAD_MIN_MS
from schemas.subjects import task_event_source
from services.errors import Unavailable, WakeTimeout
from services.fleet.binding import Supports, refusal, routed_to_of_queue

Status = Literal["queued", "running", "done", "failed"]

# How many of each kept: the failures and actions shown, the tasks remembered after they end
# (a moved task's next attempt needs its model), the samples behind the charts.
RECENT_FAILURES: Final = 30
RECENT_ACTIONS: Final = 30
RECENT_DONE: Final = 20
REMEMBERED_TASKS: Final = 20_000
SAMPLES: Final = 2_000
# The p50 and p95 at each sample are over the key's latest this many done attempts.
WINDOW: Final = 20
# Failures the router records itself (a task it could not queue, a sleeping worker that did
# not wake); every other failure on the router's and reaper's subject is the reaper's.
ROUTER_FAILURES: Final = frozenset({Unavailable.code, WakeTimeout.code})
UNKNOWN: Final = "unknown"


@dataclass(slots=True)
class TaskLine:
    """One task as the board knows it."""

    task_id: str
    model: str
    kind: str
    submitted_at: float
    client: str | None = None
    attempt: int = 0
    routed_to: str | None = None
    """The worker (or pool) the current attempt was routed to."""
    status: Status = "queued"
    worker: str | None = None
    """The worker running (or that ran) the current attempt."""
    started_at: float | None = None
    ended_attempt: int = 0
    """The latest attempt whose outcome was taken (0: none)."""


@dataclass(frozen=True, slots=True)
class Ended:
    """An attempt ended: ``outcome`` is ``done`` or the failure's code."""

    task_id: str
    attempt: int
    model: str
    kind: str
    worker: str
    outcome: str
    at: float
    message: str = ""
    retryable: bool = False
    durations: Durations | None = None
    tokens: Tokens | None = None


@dataclass(frozen=True, slots=True)
class ReaperAction:
    """The reaper moved a task (``moved``, the finding as ``reason``), failed it (``failed``,
    the code), or reported a duplicate worker (``duplicate``)."""

    action: Literal["moved", "failed", "duplicate"]
    reason: str
    at: float
    task_id: str | None = None
    attempt: int = 0
    worker: str | None = None
    """Where a task was moved to, the worker a failure or duplicate is about."""


@dataclass(frozen=True, slots=True)
class Submitted:
    task_id: str
    model: str
    kind: str


Change = Ended | ReaperAction | Submitted


class Sample(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """A done attempt, for the charts: its duration and speed, and the key's p50/p95 then.
    Sent to the page as an array (they are many): ``[index, at, model, worker, total_ms,
    p50_ms, p95_ms, tokens_per_s, first_token_ms, load_ms]``."""

    index: int
    at: float
    model: str
    worker: str
    total_ms: float
    p50_ms: float
    p95_ms: float
    tokens_per_s: float | None
    first_token_ms: float | None
    load_ms: float | None


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0-1) of ``values`` (not empty), interpolated between the closest
    ranks, as PostgreSQL's ``percentile_cont`` (the stats service's) computes it."""
    ordered = sorted(values)
    rank = q * (len(ordered) - 1)
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def tokens_per_s(durations: Durations, tokens: Tokens) -> float | None:
    """Generation speed: tokens generated over the time spent generating them."""
    if tokens.eval and durations.eval_ms:
        return tokens.eval / (durations.eval_ms / 1000.0)
    return None


def is_cold(durations: Durations) -> bool:
    """Did the attempt load its model (`schemas.stats.COLD_LOAD_MIN_MS`)?"""
    return durations.load_ms is not None and durations.load_ms >= COLD_LOAD_MIN_MS


@dataclass
class TaskBoard:
    """Tasks under way and recent ends, folded from the event log in its order."""

    supports: Supports
    """What a worker supports (from the registry): who belongs to a pool."""
    open: dict[str, TaskLine] = field(default_factory=dict)
    failures: deque[Ended] = field(default_factory=lambda: deque(maxlen=RECENT_FAILURES))
    done: deque[Ended] = field(default_factory=lambda: deque(maxlen=RECENT_DONE))
    actions: deque[ReaperAction] = field(default_factory=lambda: deque(maxlen=RECENT_ACTIONS))
    samples: deque[Sample] = field(default_factory=lambda: deque(maxlen=SAMPLES))
    cold_loads: dict[tuple[str, str], int] = field(default_factory=dict)
    """Cold loads per (model, worker) among the done attempts read."""
    refused: int = 0
    """Worker events not taken (`services.fleet.binding`)."""
    _known: OrderedDict[str, TaskLine] = field(default_factory=OrderedDict)
    _windows: dict[tuple[str, str], deque[float]] = field(default_factory=dict)
    _next_sample: int = 1

    def apply(self, event: AnyEvent, subject: str) -> list[Change]:
        """Fold one event (stored on ``subject``) in; what it changed."""
        match event:
            case TaskSubmitted():
                self._remember(
                    TaskLine(
                        task_id=event.task_id,
                        model=event.model,
                        kind=event.work.task_type,
                        submitted_at=event.at,
                        client=event.client,
                    )
                )
                return [Submitted(event.task_id, event.model, event.work.task_type)]
            case TaskRouted():
                return self._routed(event)
            case TaskStarted() | TaskCompleted() | TaskFailed():
                return self._attempt(event, task_event_source(subject))
            case WorkerDuplicate():
                action = ReaperAction("duplicate", event.reason, event.at, worker=event.worker_id)
                self.actions.append(action)
                return [action]
            case _:
                return []

    def prune(self, before: float) -> int:
        """Forget open tasks submitted before ``before`` (their end was never seen: a task
        from before the log's retention, say); how many."""
        stale = [t for t, line in self.open.items() if line.submitted_at < before]
        for task_id in stale:
            del self.open[task_id]
        return len(stale)

    def line(self, task_id: str) -> TaskLine | None:
        return self._known.get(task_id)

    def _remember(self, line: TaskLine) -> TaskLine:
        known = self._known.get(line.task_id)
        if known is not None:
            return known
        self._known[line.task_id] = line
        self.open[line.task_id] = line
        while len(self._known) > REMEMBERED_TASKS:
            old, _ = self._known.popitem(last=False)
            self.open.pop(old, None)
        return line

    def _routed(self, event: TaskRouted) -> list[Change]:
        line = self._known.get(event.task_id) or self._remember(
            TaskLine(
                task_id=event.task_id,
                model=event.model or UNKNOWN,
                kind=UNKNOWN,
                submitted_at=event.at,
            )
        )
        if event.attempt < line.attempt:
            return []  # an older attempt's, arriving late
        line.attempt = event.attempt
        line.routed_to = routed_to_of_queue(event.queue)
        line.status, line.worker, line.started_at = "queued", None, None
        self.open[line.task_id] = line
        if event.attempt <= 1:
            return []
        # Only the reaper routes a task again.
        action = ReaperAction(
            "moved",
            event.reason,
            event.at,
            task_id=event.task_id,
            attempt=event.attempt,
            worker=event.worker,
        )
        self.actions.append(action)
        return [action]

    def _attempt(
        self, event: TaskStarted | TaskCompleted | TaskFailed, source: str | None
    ) -> list[Change]:
        line = self._known.get(event.task_id)
        routed = (line.attempt, line.routed_to) if line is not None and line.attempt else None
        if refusal(event, source, routed, self.supports) is not None:
            self.refused += 1
            return []
        if line is None:
            # Routed before what was read of the log: the attempt is taken as it says.
            model = event.model if isinstance(event, TaskCompleted) else UNKNOWN
            line = self._remember(
                TaskLine(task_id=event.task_id, model=model, kind=UNKNOWN, submitted_at=event.at)
            )
            line.attempt = event.attempt
        if event.attempt < line.attempt or event.attempt <= line.ended_attempt:
            return []  # stale, or this attempt has already ended
        line.attempt = event.attempt
        if isinstance(event, TaskStarted):
            line.status, line.worker, line.started_at = "running", event.worker, event.at
            return []
        return self._ended(line, event, source)

    def _ended(
        self, line: TaskLine, event: TaskCompleted | TaskFailed, source: str | None
    ) -> list[Change]:
        line.ended_attempt = event.attempt
        self.open.pop(line.task_id, None)
        worker = event.worker or line.worker or line.routed_to or UNKNOWN
        changes: list[Change] = []
        if isinstance(event, TaskCompleted):
            line.status, line.worker = "done", event.worker
            if line.model == UNKNOWN:
                line.model = event.model
            ended = Ended(
                task_id=line.task_id,
                attempt=event.attempt,
                model=line.model,
                kind=line.kind,
                worker=worker,
                outcome="done",
                at=event.at,
                durations=event.durations,
                tokens=event.tokens,
            )
            self.done.append(ended)
            self._sample(ended, event.durations, event.tokens)
        else:
            line.status = "failed"
            ended = Ended(
                task_id=line.task_id,
                attempt=event.attempt,
                model=line.model,
                kind=line.kind,
                worker=worker,
                outcome=event.code,
                at=event.at,
                message=event.reason,
                retryable=event.retryable,
                durations=event.durations,
            )
            self.failures.append(ended)
            if source is None and event.code not in ROUTER_FAILURES:
                action = ReaperAction(
                    "failed",
                    event.code,
                    event.at,
                    task_id=line.task_id,
                    attempt=event.attempt,
                    worker=event.worker,
                )
                self.actions.append(action)
                changes.append(action)
        changes.insert(0, ended)
        return changes

    def _sample(self, ended: Ended, durations: Durations, tokens: Tokens) -> None:
        key = (ended.model, ended.worker)
        window = self._windows.setdefault(key, deque(maxlen=WINDOW))
        window.append(durations.total_ms)
        if is_cold(durations):
            self.cold_loads[key] = self.cold_loads.get(key, 0) + 1
        self.samples.append(
            Sample(
                index=self._next_sample,
                at=ended.at,
                model=ended.model,
                worker=ended.worker,
                total_ms=durations.total_ms,
                p50_ms=percentile(window, 0.5),
                p95_ms=percentile(window, 0.95),
                tokens_per_s=tokens_per_s(durations, tokens),
                first_token_ms=durations.first_token_ms,
                load_ms=durations.load_ms,
            )
        )
        self._next_sample += 1

    def samples_after(self, index: int) -> list[Sample]:
        """The samples newer than ``index`` (0: all kept), oldest first."""
        return [s for s in self.samples if s.index > index]

    def open_lines(self) -> Iterable[TaskLine]:
        """The tasks queued or running, oldest first."""
        return sorted(self.open.values(), key=lambda line: line.submitted_at)
