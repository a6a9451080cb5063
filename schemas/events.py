"""Facts in the ``EVENTS`` stream, as tagged unions per subject family.

``events.task.<task_id>.<kind>`` carries `TaskEvent`; ``events.worker.<worker_id>.<kind>``
carries `WorkerEvent`. The tag (``type``) equals the subject's last token.
"""

from __future__ import annotations

from typing import Any, Final, assert_never

import msgspec

from schemas.base import Event, Wire
from schemas.route import TaskType
from schemas.subjects import task_event, worker_event


class Durations(Wire, frozen=True, kw_only=True):
    """Milliseconds, as the backend reported them; ``total_ms`` includes thinking and load."""

    total_ms: float
    load_ms: float | None = None
    prompt_eval_ms: float | None = None
    eval_ms: float | None = None
    first_token_ms: float | None = None
    """From sending the prompt to the first token (or thinking) arriving."""


class Tokens(Wire, frozen=True, kw_only=True):
    prompt: int | None = None
    eval: int | None = None


class TaskSubmitted(Event, frozen=True, kw_only=True, tag="submitted"):
    task_id: str
    model: str
    prompt: str
    task_type: TaskType = "inference"
    domain: str | None = None
    options: dict[str, Any] | None = None
    requested_worker: str | None = None
    timeout_s: float


class TaskRouted(Event, frozen=True, kw_only=True, tag="routed"):
    task_id: str
    attempt: int
    worker: str
    queue: str
    reason: str = ""


class TaskStarted(Event, frozen=True, kw_only=True, tag="started"):
    task_id: str
    attempt: int
    worker: str
    host: str


class TaskCompleted(Event, frozen=True, kw_only=True, tag="completed"):
    task_id: str
    attempt: int
    worker: str
    model: str
    response: str
    thinking: str | None = None
    durations: Durations
    tokens: Tokens = Tokens()


class TaskFailed(Event, frozen=True, kw_only=True, tag="failed"):
    task_id: str
    attempt: int
    worker: str | None = None
    code: str
    reason: str
    retryable: bool = False
    durations: Durations | None = None


TaskEvent = TaskSubmitted | TaskRouted | TaskStarted | TaskCompleted | TaskFailed


class WorkerRegistered(Event, frozen=True, kw_only=True, tag="registered"):
    worker_id: str
    host: str
    instance_id: str
    models: list[str]
    supports: list[str]
    version: str


class WorkerStopped(Event, frozen=True, kw_only=True, tag="stopped"):
    worker_id: str
    instance_id: str
    reason: str


WorkerEvent = WorkerRegistered | WorkerStopped


class AliasSet(Event, frozen=True, kw_only=True, tag="alias_set"):
    """From now on ``alias`` names the model whose statistics key is ``canonical`` (lesson 6)."""

    alias: str
    canonical: str


class AliasRemoved(Event, frozen=True, kw_only=True, tag="alias_removed"):
    alias: str


# Operator decisions about the statistics, on ``events.stats.<family>.<kind>``.
StatsEvent = AliasSet | AliasRemoved

ALIAS_EVENTS: Final = "events.stats.alias.>"

AnyEvent = TaskEvent | WorkerEvent | StatsEvent

TERMINAL_KINDS = frozenset({"completed", "failed"})

task_event_decoder = msgspec.json.Decoder(TaskEvent)
any_event_decoder = msgspec.json.Decoder(AnyEvent)
encoder = msgspec.json.Encoder()


def kind_of(event: Event) -> str:
    """The event's tag, which is also the last token of its subject."""
    return str(type(event).__struct_config__.tag)


def subject_for(event: AnyEvent) -> str:
    """The ``EVENTS`` subject an event is published on."""
    match event:
        case TaskSubmitted() | TaskRouted() | TaskStarted() | TaskCompleted() | TaskFailed():
            return task_event(event.task_id, kind_of(event))
        case WorkerRegistered() | WorkerStopped():
            return worker_event(event.worker_id, kind_of(event))
        case AliasSet():
            return "events.stats.alias.set"
        case AliasRemoved():
            return "events.stats.alias.removed"
        case _:
            assert_never(event)
