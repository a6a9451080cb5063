"""Facts in the ``EVENTS`` stream, as tagged unions per subject family.

``events.task.<task_id>.<kind>`` (the router's and the reaper's) and
``events.task.<task_id>.<worker>.<kind>`` (a worker's own: `subject_for`) carry `TaskEvent`;
``events.worker.<worker_id>.<kind>`` carries `WorkerEvent`; there the tag (``type``) equals
the subject's last token.
``events.stats.<family>.<kind>`` carries `StatsEvent`, ``events.quality.<task_id>.scored``
`QualityEvent` and ``events.bench.<run_id>.<kind>`` `BenchEvent`; their tags name the family
too (``alias_set``, ``quality_scored``, ``bench_result``), since every tag must be unique
across `AnyEvent`.
"""

from __future__ import annotations

from typing import Final, Literal, assert_never

import msgspec

from schemas.base import Event

# Defined apart so the route reply can carry them too (schemas.route cannot import this module);
# re-exported here, where every reader has always imported them from.
from schemas.measures import Durations as Durations  # noqa: PLC0414
from schemas.measures import Tokens as Tokens  # noqa: PLC0414
from schemas.route import DoneReason, Source, ToolCall
from schemas.subjects import bench_event, quality_event, task_event, worker_event
from schemas.work import BothShapes, ModelOp, Work


class TaskSubmitted(Event, frozen=True, kw_only=True, tag="submitted"):
    """A task as its client asked for it: what every attempt runs (the reaper builds a moved
    attempt's task message from ``work``). Read with `task_event_decoder` or
    `any_event_decoder`, which also read the shape before `Work` (its fields at the top)."""

    task_id: str
    model: str
    work: Work
    requested_worker: str | None = None
    requested_model: str | None = None
    """The name the client used, when an alias mapped it to ``model``."""
    timeout_s: float
    client: str | None = None
    """The gateway key the task came in with (`schemas.route.RouteRequest.client`)."""
    asker: str | None = None
    """The identity that asked: whose inbox the route request's reply subject was
    (`services.fleet.identity.asker_of`); None in a fleet without identities. With ``client``,
    who the task belongs to: who may read, follow and cancel it."""


class TaskRouted(Event, frozen=True, kw_only=True, tag="routed"):
    task_id: str
    attempt: int
    worker: str
    queue: str
    reason: str = ""
    model: str | None = None
    """The task's model (canonical), so every router and the reaper know what waits on each
    worker without reading the larger ``submitted``; None in events that predate this."""
    domain: str | None = None
    """The domain routing used (the request's, else its prompt's)."""


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
    host: str | None = None
    """The host that did the work (``TaskStarted`` has it too; here so a reply needs one event)."""
    sources: list[Source] | None = None
    """Web search: the results ``response`` rests on (``[n]`` in it cites ``sources[n-1]``)."""
    note: str | None = None
    """Done, but not as asked: for a web search, the summary failed (this says why) and
    ``response`` is the plain list of results."""
    tool_calls: list[ToolCall] | None = None
    done_reason: DoneReason | None = None
    embeddings: list[bytes] | None = None
    """An embedding task's vectors, little-endian float32 each (`schemas.vectors`)."""


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


class WorkerAsleep(Event, frozen=True, kw_only=True, tag="asleep"):
    """The worker was idle long enough and is putting its machine to sleep."""

    worker_id: str
    instance_id: str
    models: list[str]
    wol_mac: str | None = None
    idle_s: float


class WakeRequested(Event, frozen=True, kw_only=True, tag="wake_requested"):
    """The router sent a Wake-on-LAN packet because a task needs this sleeping worker."""

    worker_id: str
    mac: str
    task_id: str
    model: str


class WorkerDuplicate(Event, frozen=True, kw_only=True, tag="duplicate"):
    """The reaper saw more than one process serving one worker id (lesson 2): more than one
    pull waiting on its ``max_ack_pending=1`` consumer, or two instances heartbeating."""

    worker_id: str
    reason: str
    """What was seen, for people (``coordinator workers`` shows it)."""
    num_waiting: int | None = None
    """Pulls waiting on the worker's consumer when it was seen that way."""
    instances: list[str] = msgspec.field(default_factory=list)
    hosts: list[str] = msgspec.field(default_factory=list)


class ModelChanged(Event, frozen=True, kw_only=True, tag="model_changed"):
    """A worker changed its machine's models (a ``model_change`` task), on
    ``events.worker.<worker_id>.model_changed``: ``model`` pulled, created (from ``source``),
    copied (from ``source``) or removed, and its digest there after the change ('' once
    removed)."""

    worker_id: str
    task_id: str
    op: ModelOp
    model: str
    source: str | None = None
    digest: str = ""


WorkerEvent = (
    WorkerRegistered | WorkerStopped | WorkerAsleep | WakeRequested | WorkerDuplicate | ModelChanged
)


class AliasSet(Event, frozen=True, kw_only=True, tag="alias_set"):
    """From now on ``alias`` names the model whose statistics key is ``canonical`` (lesson 6)."""

    alias: str
    canonical: str


class AliasRemoved(Event, frozen=True, kw_only=True, tag="alias_removed"):
    alias: str


class ExclusionAdded(Event, frozen=True, kw_only=True, tag="exclusion_added"):
    """Leave out of every figure the outcomes of ``worker`` (of ``model`` only, when given)
    that ended in [``since``, ``until``) (lesson 3). The tasks and their events stay."""

    exclusion_id: str
    worker: str
    model: str | None = None
    """Matches the model as requested or its canonical name; None: every model."""
    since: float
    until: float | None = None
    """None: open-ended, until withdrawn."""
    reason: str


class ExclusionWithdrawn(Event, frozen=True, kw_only=True, tag="exclusion_withdrawn"):
    exclusion_id: str
    reason: str = ""


# Operator decisions about the statistics, on ``events.stats.<family>.<kind>``.
StatsEvent = AliasSet | AliasRemoved | ExclusionAdded | ExclusionWithdrawn

ALIAS_EVENTS: Final = "events.stats.alias.>"
EXCLUSION_EVENTS: Final = "events.stats.exclusion.>"

QualityVerdict = Literal["scored", "malformed"]


class QualityScored(Event, frozen=True, kw_only=True, tag="quality_scored"):
    """The judge's verdict on one done task, on ``events.quality.<task_id>.scored``.

    At most one per task: the judge publishes it expecting no earlier message on that subject.
    A reply the judge's text gives no clear score for is recorded as ``malformed``, never
    guessed.
    """

    task_id: str
    attempt: int
    """The attempt whose response was judged."""
    verdict: QualityVerdict
    score: float | None = None
    """0 (useless) to 1 (excellent); None unless ``verdict`` is ``scored``."""
    rubric: str
    """The domain whose rubric the judge was given."""
    judge_model: str
    judge_host: str
    text: str = ""
    """The judge's reply (truncated), so a malformed verdict can be read later."""
    reason: str = ""
    """Why the verdict is malformed."""


QualityEvent = QualityScored


class BenchStarted(Event, frozen=True, kw_only=True, tag="bench_started"):
    """A benchmark run began, on ``events.bench.<run_id>.started``."""

    run_id: str
    models: list[str]
    workers: list[str]
    prompts: int


class BenchResult(Event, frozen=True, kw_only=True, tag="bench_result"):
    """One prompt of a benchmark run on one worker, on ``events.bench.<run_id>.result``."""

    run_id: str
    index: int
    """Position in the run; with ``run_id`` it names the result."""
    model: str
    worker: str
    """The worker asked to run it; ``''`` when none could be."""
    domain: str
    prompt_key: str
    """A digest of the prompt text: results are compared with earlier ones of the same key."""
    prompt_name: str
    ok: bool
    task_id: str | None = None
    total_ms: float | None = None
    load_ms: float | None = None
    error: str | None = None


class BenchFinished(Event, frozen=True, kw_only=True, tag="bench_finished"):
    run_id: str
    ok: int
    failed: int
    slow: list[str] = msgspec.field(default_factory=list)
    """``model (worker)`` that ran at twice their baseline or worse."""


BenchEvent = BenchStarted | BenchResult | BenchFinished

AnyEvent = TaskEvent | WorkerEvent | StatsEvent | QualityEvent | BenchEvent

TERMINAL_KINDS = frozenset({"completed", "failed"})

# Both read a ``submitted`` event of the shape before `Work` too (`BothShapes`).
task_event_decoder: Final[BothShapes[TaskEvent]] = BothShapes(TaskEvent)
any_event_decoder: Final[BothShapes[AnyEvent]] = BothShapes(AnyEvent)
encoder = msgspec.json.Encoder()


def kind_of(event: Event) -> str:
    """The event's tag, which is also the last token of its subject."""
    return str(type(event).__struct_config__.tag)


def subject_for(event: AnyEvent, by: str | None = None) -> str:
    """The ``EVENTS`` subject an event is published on. A task's ``started`` and ``completed``
    come from the worker they name, on its own subject; a ``failed`` on the subject of the
    worker ``by`` that records it, or (``by`` None) on the router's and reaper's."""
    match event:
        case TaskStarted() | TaskCompleted():
            return task_event(event.task_id, kind_of(event), by or event.worker)
        case TaskFailed():
            return task_event(event.task_id, kind_of(event), by)
        case TaskSubmitted() | TaskRouted():
            return task_event(event.task_id, kind_of(event))
        case (
            WorkerRegistered()
            | WorkerStopped()
            | WorkerAsleep()
            | WakeRequested()
            | WorkerDuplicate()
            | ModelChanged()
        ):
            return worker_event(event.worker_id, kind_of(event))
        case AliasSet():
            return "events.stats.alias.set"
        case AliasRemoved():
            return "events.stats.alias.removed"
        case ExclusionAdded():
            return "events.stats.exclusion.added"
        case ExclusionWithdrawn():
            return "events.stats.exclusion.withdrawn"
        case QualityScored():
            return quality_event(event.task_id, "scored")
        case BenchStarted():
            return bench_event(event.run_id, "started")
        case BenchResult():
            return bench_event(event.run_id, "result")
        case BenchFinished():
            return bench_event(event.run_id, "finished")
        case _:
            assert_never(event)
