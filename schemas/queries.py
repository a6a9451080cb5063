"""Query endpoints: ``coordinator.task`` and ``coordinator.workers``."""

from __future__ import annotations

import msgspec

from schemas.base import Wire
from schemas.events import Durations, Tokens
from schemas.models import ModelFacts
from schemas.route import ErrorDetail, TaskStatus, TaskType


class TaskQuery(Wire, frozen=True, kw_only=True, forbid_unknown_fields=True):
    task_id: str
    client: str | None = None
    """The gateway key the question came in with: heeded from a gateway only."""


class TaskView(Wire, frozen=True, kw_only=True):
    """A task as the stats read model knows it."""

    task_id: str
    status: TaskStatus
    model: str
    domain: str | None = None
    task_type: str = "inference"
    worker: str | None = None
    queue: str | None = None
    attempts: int = 0
    response: str | None = None
    thinking: str | None = None
    durations: Durations | None = None
    tokens: Tokens | None = None
    created_at: float
    ended_at: float | None = None
    error: str | None = None
    """``failure`` as one line, ``code: message``, for people and for readers that predate
    ``failure``. Never parsed: read ``failure`` (`schemas.route.failure_of`)."""
    failure: ErrorDetail | None = None
    """Why the task's current attempt failed: the ``failed`` event's code and reason."""


class WorkersQuery(Wire, frozen=True, kw_only=True):
    client: str | None = None
    """The gateway key the question came in with: heeded from a gateway only. A running
    task's id shows only to its owner and the operator."""


class WorkerView(Wire, frozen=True, kw_only=True):
    worker_id: str
    host: str
    tier: str
    models: list[str]
    state: str
    current_task: str | None = None
    current_model: str | None = None
    last_heartbeat: float
    queue_depth: int = 0
    problems: list[str] = msgspec.field(default_factory=list)
    """What the reaper found wrong with this worker lately (a duplicate process, say)."""
    facts: list[ModelFacts] = msgspec.field(default_factory=list)
    """Capabilities, digest, size and details of its models, as its backend reports them."""
    health: str = "healthy"
    """``healthy`` or ``degraded``, as the worker's own probe of its backend says (a degraded
    worker gets no task)."""
    health_reason: str | None = None
    """Why it is degraded."""
    health_since: float | None = None
    """When its health last changed (None: a worker that does not probe its backend)."""
    resident: list[str] | None = None
    """The models its backend holds in memory, as it last said (None: it does not say)."""
    memory_bytes: int | None = None
    """How much its backend holds of models before a load pushes one out, as routing counts
    it (`schemas.workers.WorkerRecord.memory_bytes`; None: not known)."""
    max_resident: int | None = None
    """The most models it has seen its backend hold at once (None: not known)."""


class LastEventQuery(Wire, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``coordinator.event.last``: a task's last event on one subject
    (`schemas.subjects.task_of_readable_event`)."""

    subject: str


class LastEvent(Wire, frozen=True, kw_only=True):
    """The event as stored: its subject, its sequence in ``EVENTS``, its bytes."""

    subject: str
    seq: int
    data: bytes


class OwnConsumerQuery(Wire, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``coordinator.consumer.own``: make (or set back as fixed) a worker's own consumer."""

    worker_id: str
    ack_wait_s: float
    """Its ``ACK_WAIT_S``: how long a task it holds waits for a sign of life."""


class OwnConsumer(Wire, frozen=True, kw_only=True):
    consumer: str
    ack_wait_s: float


class AliasMap(Wire, frozen=True, kw_only=True):
    """``coordinator.router.aliases``: every alias with the name it stands for."""

    aliases: dict[str, str]


class WorkersReply(Wire, frozen=True, kw_only=True):
    workers: list[WorkerView]
    aliases: dict[str, str] = msgspec.field(default_factory=dict)
    """The model aliases in force, each to the canonical name a request for it is routed as."""
    settling: bool = False
    """The router is reading the registry again after a reconnect to NATS
    (`services.fleet.settling`): a live worker may be missing from ``workers`` for a moment."""


__all__ = ["TaskQuery", "TaskStatus", "TaskType", "TaskView", "WorkerView", "WorkersReply"]
