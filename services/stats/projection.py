"""The task projection as pure functions: a task's state from its events, and figure deltas.

No I/O here: `store.py` loads a row, calls `evolve`, writes the result and records the
attempt's `outcome_of` in ``outcomes`` (from which the figures are computed), all in one
transaction.

Rules `evolve` follows, so that redelivery, duplicates and retries cannot corrupt a row:

- **Attempts fence stale work.** Every event after ``submitted`` names an attempt. An event of
  an attempt lower than the state's current one is stale (the reaper has moved the task on) and
  changes nothing. An event of a higher attempt starts that attempt: the previous attempt's
  worker, host and outcome are cleared (they stay in the event log and in the figures).
- **The first outcome of an attempt stands.** Once an attempt is done or failed, a later
  ``started``, ``completed`` or ``failed`` of the same attempt changes nothing: a terminal
  state is never downgraded, and a duplicate outcome is not counted twice.
- **Events before ``submitted`` give a best-effort state, never an error.** JetStream keeps a
  task's events in order, so this only happens when the log was cut (max age) or partly
  replayed. The state is a placeholder (model from ``completed`` if known, else ``''``;
  ``created_at`` = the event's time), and a ``submitted`` that arrives later fills in the
  fields it owns without touching status or outcome. Keeping the placeholder loses nothing;
  returning None would drop the outcome.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import assert_never

from schemas.events import (
    Durations,
    TaskCompleted,
    TaskEvent,
    TaskFailed,
    TaskRouted,
    TaskStarted,
    TaskSubmitted,
    Tokens,
)
from schemas.queries import TaskView
from schemas.route import UNKNOWN_FAILURE, ErrorDetail, TaskStatus
from services.errors import Cancelled
from services.fleet.binding import routed_to_of_queue
from services.fleet.domains import classify_domain

TERMINAL_STATUSES: frozenset[TaskStatus] = frozenset({"done", "failed"})


@dataclass(frozen=True, slots=True, kw_only=True)
class TaskState:
    """One task as the ``tasks`` table holds it (timestamps in epoch seconds)."""

    task_id: str
    status: TaskStatus
    model: str
    domain: str | None = None
    task_type: str = "inference"
    prompt: str = ""
    worker: str | None = None
    queue: str | None = None
    host: str | None = None
    attempt: int = 0
    """The current attempt; 0 until the task is first routed."""
    attempts: int = 0
    """The highest attempt number seen."""
    response: str | None = None
    thinking: str | None = None
    total_ms: float | None = None
    load_ms: float | None = None
    prompt_eval_ms: float | None = None
    eval_ms: float | None = None
    first_token_ms: float | None = None
    prompt_tokens: int | None = None
    eval_tokens: int | None = None
    error_code: str | None = None
    error: str | None = None
    created_at: float
    # Who asked (`schemas.events.TaskSubmitted.asker`, ``client``): who may read it.
    asker: str | None = None
    client: str | None = None
    started_at: float | None = None
    ended_at: float | None = None

    @property
    def terminal(self) -> bool:
        """Done or failed."""
        return self.status in TERMINAL_STATUSES


@dataclass(frozen=True, slots=True, kw_only=True)
class Outcome:
    """How one attempt of a task ended: one row of ``outcomes``, the facts figures come from."""

    task_id: str
    attempt: int
    model: str
    """As the task asked for it; the store keys it by its canonical name."""
    domain: str
    """The requested domain, else `classify_domain` of the prompt."""
    worker: str
    """``''`` when a failure named no worker."""
    ok: bool
    total_ms: float | None
    load_ms: float | None
    eval_ms: float | None
    eval_tokens: int | None
    first_token_ms: float | None
    ended_at: float


def routing(state: TaskState | None) -> tuple[int, str | None] | None:
    """The task's current attempt and where it was routed (`services.fleet.binding.refusal`);
    None before its first ``routed``."""
    if state is None or state.attempt == 0:
        return None
    return state.attempt, routed_to_of_queue(state.queue) if state.queue else None


def evolve(state: TaskState | None, event: TaskEvent) -> TaskState:
    """The task's state after ``event``; ``state`` is None for a task not seen before.

    Returns ``state`` itself (the same object) when the event changes nothing, so the caller can
    skip the write. Never returns None: see the module docstring for events before
    ``submitted``. (The result type is narrower than ``TaskState | None`` on purpose.)
    """
    match event:
        case TaskSubmitted():
            return _submitted(state, event)
        case TaskRouted():
            return _routed(state, event)
        case TaskStarted():
            return _started(state, event)
        case TaskCompleted():
            return _completed(state, event)
        case TaskFailed():
            return _failed(state, event)
        case _:
            assert_never(event)


def outcome_of(before: TaskState | None, after: TaskState | None) -> Outcome | None:
    """The attempt outcome the change ``before`` → ``after`` records, or None.

    An attempt has an outcome once, when it first becomes terminal (done or failed); a task
    whose model is still unknown (no ``submitted`` and no ``completed`` seen) has none, since
    the model is the figures' key, nor has a change to a machine's models. Durations are kept
    for failures too (the time they cost); figures take durations from done outcomes only.
    """
    if after is None or not after.terminal or not after.model:
        return None
    if after.error_code == Cancelled.code:
        return None  # the client went away: says nothing of the worker's or the model's speed
    if after.task_type == "model_change":
        return None  # a pull's or a removal's time says nothing of the model's speed
    if before is not None and before.terminal and before.attempt == after.attempt:
        return None
    return Outcome(
        task_id=after.task_id,
        attempt=after.attempt,
        model=after.model,
        domain=after.domain or classify_domain(after.prompt),
        worker=after.worker or "",
        ok=after.status == "done",
        total_ms=after.total_ms,
        load_ms=after.load_ms,
        eval_ms=after.eval_ms,
        eval_tokens=after.eval_tokens,
        first_token_ms=after.first_token_ms,
        ended_at=after.ended_at if after.ended_at is not None else after.created_at,
    )


def to_view(state: TaskState) -> TaskView:
    """The ``coordinator.task`` reply for a task; durations and tokens only when reported."""
    durations = (
        Durations(
            total_ms=state.total_ms,
            load_ms=state.load_ms,
            prompt_eval_ms=state.prompt_eval_ms,
            eval_ms=state.eval_ms,
            first_token_ms=state.first_token_ms,
        )
        if state.total_ms is not None
        else None
    )
    tokens = (
        Tokens(prompt=state.prompt_tokens, eval=state.eval_tokens)
        if state.prompt_tokens is not None or state.eval_tokens is not None
        else None
    )
    failure = None
    if state.error_code is not None or state.error is not None:
        failure = ErrorDetail(code=state.error_code or UNKNOWN_FAILURE, message=state.error or "")
    return TaskView(
        task_id=state.task_id,
        status=state.status,
        model=state.model,
        domain=state.domain,
        task_type=state.task_type,
        worker=state.worker,
        queue=state.queue,
        attempts=state.attempts,
        response=state.response,
        thinking=state.thinking,
        durations=durations,
        tokens=tokens,
        created_at=state.created_at,
        ended_at=state.ended_at,
        error=failure.summary if failure is not None else None,
        failure=failure,
    )


# -- one function per event kind -------------------------------------------------------------


def _placeholder(task_id: str, at: float, model: str = "") -> TaskState:
    """A task whose ``submitted`` has not been seen: queued, model unknown unless given."""
    return TaskState(task_id=task_id, status="queued", model=model, created_at=at)


def _next_attempt(state: TaskState, attempt: int) -> TaskState:
    """Start ``attempt``: what belonged to the previous attempt no longer describes the task."""
    return dataclasses.replace(
        state,
        status="queued",
        attempt=attempt,
        attempts=max(state.attempts, attempt),
        worker=None,
        queue=None,
        host=None,
        response=None,
        thinking=None,
        total_ms=None,
        load_ms=None,
        prompt_eval_ms=None,
        eval_ms=None,
        first_token_ms=None,
        prompt_tokens=None,
        eval_tokens=None,
        error_code=None,
        error=None,
        started_at=None,
        ended_at=None,
    )


def _submitted(state: TaskState | None, event: TaskSubmitted) -> TaskState:
    if state is None:
        return TaskState(
            task_id=event.task_id,
            status="queued",
            model=event.model,
            domain=event.work.domain,
            task_type=event.work.task_type,
            prompt=event.work.prompt,
            created_at=event.at,
            asker=event.asker,
            client=event.client,
        )
    # Late (after a placeholder) or duplicate: fill in what `submitted` owns, nothing else.
    filled = dataclasses.replace(
        state,
        model=event.model,
        domain=event.work.domain,
        task_type=event.work.task_type,
        prompt=event.work.prompt,
        created_at=event.at,
        asker=event.asker,
        client=event.client,
    )
    return state if filled == state else filled


def _routed(state: TaskState | None, event: TaskRouted) -> TaskState:
    current = state if state is not None else _placeholder(event.task_id, event.at)
    if event.attempt < current.attempt or current.status == "done":
        # A task's completion stands: a move that raced it went no further (the reaper
        # queues nothing for it: services/reaper/actions.py).
        return current
    if event.attempt > current.attempt:
        current = _next_attempt(current, event.attempt)
    elif current.status != "queued":
        # A repeated `routed` of an attempt that already started or ended adds nothing.
        return current
    routed = dataclasses.replace(current, worker=event.worker, queue=event.queue)
    return state if routed == state else routed


def _started(state: TaskState | None, event: TaskStarted) -> TaskState:
    current = state if state is not None else _placeholder(event.task_id, event.at)
    if event.attempt < current.attempt:
        return current
    if event.attempt > current.attempt:
        current = _next_attempt(current, event.attempt)
    elif current.terminal:
        return current
    started = dataclasses.replace(
        current,
        status="running",
        worker=event.worker,
        host=event.host,
        # A repeated `started` (redelivered task message) keeps the first start time.
        started_at=current.started_at if current.started_at is not None else event.at,
    )
    return state if started == state else started


def _completed(state: TaskState | None, event: TaskCompleted) -> TaskState:
    current = state if state is not None else _placeholder(event.task_id, event.at, event.model)
    if event.attempt < current.attempt:
        return current
    if event.attempt > current.attempt:
        current = _next_attempt(current, event.attempt)
    elif current.terminal:
        return current
    return dataclasses.replace(
        current,
        status="done",
        model=current.model or event.model,
        worker=event.worker,
        response=event.response,
        thinking=event.thinking,
        total_ms=event.durations.total_ms,
        load_ms=event.durations.load_ms,
        prompt_eval_ms=event.durations.prompt_eval_ms,
        eval_ms=event.durations.eval_ms,
        first_token_ms=event.durations.first_token_ms,
        prompt_tokens=event.tokens.prompt,
        eval_tokens=event.tokens.eval,
        error_code=None,
        error=None,
        ended_at=event.at,
    )


def _failed(state: TaskState | None, event: TaskFailed) -> TaskState:
    current = state if state is not None else _placeholder(event.task_id, event.at)
    if event.attempt < current.attempt:
        return current
    if event.attempt > current.attempt:
        current = _next_attempt(current, event.attempt)
    elif current.terminal:
        return current
    if event.durations is not None:
        # Time a failed attempt spent, when the backend reported it.
        current = dataclasses.replace(
            current,
            total_ms=event.durations.total_ms,
            load_ms=event.durations.load_ms,
            prompt_eval_ms=event.durations.prompt_eval_ms,
            eval_ms=event.durations.eval_ms,
        )
    return dataclasses.replace(
        current,
        status="failed",
        worker=event.worker if event.worker is not None else current.worker,
        error_code=event.code,
        error=event.reason,
        ended_at=event.at,
    )
