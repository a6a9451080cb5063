"""Subject names and the checks that keep ids from breaking them.

Every subject the services use is built here, so a malformed id is refused in one place with
one clear error instead of silently addressing the wrong subject (a dot adds a token, ``*`` and
``>`` become wildcards, whitespace ends the subject).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final, Literal

Tier = Literal["gpu", "cpu"]


@dataclass(frozen=True, slots=True)
class Pool:
    """A queue that every worker of one kind pulls, through one durable consumer they all
    bind: its ``name`` stands where a worker id would (a decision's worker, a ``routed``
    event's), so no worker may take it as an id; its subject; its consumer; and what its
    members do (their capability, which lets them record a task's outcome there)."""

    name: str
    queue: str
    consumer: str
    capability: str


# CPU workers with nothing of their own to do take a task that every CPU worker is busy for.
SHARED_CPU: Final = Pool("shared", "tasks.cpu.shared", "cpu-shared", "cpu_inference")
# Every web-search task: they all share one queue.
WEB: Final = Pool("web", "tasks.web", "web", "web_search")
POOLS: Final = (SHARED_CPU, WEB)
# Names that are queue tokens of their own and so cannot be worker ids.
POOL_NAMES: Final = frozenset(pool.name for pool in POOLS)


def pool_of_queue(queue: str) -> Pool | None:
    """The pool whose subject ``queue`` is; None for a worker's own queue."""
    return next((pool for pool in POOLS if pool.queue == queue), None)


TASKS_STREAM: Final = "TASKS"
EVENTS_STREAM: Final = "EVENTS"
WORKERS_BUCKET: Final = "workers"
# Workers that put their machine to sleep, with how to wake them (no TTL: they stay until
# they register again).
ASLEEP_BUCKET: Final = "asleep"

TASKS_SUBJECTS: Final = "tasks.>"
EVENTS_SUBJECTS: Final = "events.>"

# Request/reply endpoints. They must never fall under a stream's subjects, or the stream would
# store (and acknowledge) the requests instead of a service answering them.
ROUTE: Final = "coordinator.route"
CANCEL: Final = "coordinator.cancel"
# A cancel sent on a subject that names its sender (`cancel_from`). A reply subject can name
# anyone's inbox, so a cancel's sender is known only from a subject the server lets nobody
# else publish: each identity may send cancels on its own only (`services.cli.permissions`).
# ``coordinator.cancel`` itself serves a bus without users (and the operator).
CANCELS_FROM: Final = "coordinator.cancel.from.*"
# Routers ask each other (every router listens, none in a queue group; only one that holds
# it answers) which of them holds a waiting route request or a task being submitted: what
# one router knows only in memory, any router can then act on (cancel, follow).
ROUTER_HOLDS: Final = "coordinator.router.holds"
# Where the router passes a cancel on to the workers (core NATS, one subject per task; never
# under a stream: a cancel is a notice, the task's `failed` event is the fact).
CANCEL_NOTICES: Final = "coordinator.cancel.*"
TASK: Final = "coordinator.task"
WORKERS: Final = "coordinator.workers"
# A task's last event of one kind, for a worker that may not read the event log itself (one
# with an identity): the router reads it, for the workers the task was routed to.
LAST_EVENT: Final = "coordinator.event.last"
# A worker with credentials may not make or change its own consumer (its limits, as
# `max_ack_pending`, are the fleet's): the router makes it, as fixed, for that worker only.
OWN_CONSUMER: Final = "coordinator.consumer.own"
# The alias map as the router follows it: what a worker with credentials asks, which may not
# follow the alias events itself (a consumer on `EVENTS` per follow, without bound).
ALIAS_MAP: Final = "coordinator.router.aliases"
# The reaper's NATS micro service (it answers `$SRV.PING.coordinator-reaper`, so the router and
# `coordinator health` can tell it runs) and its status endpoint.
REAPER_SERVICE: Final = "coordinator-reaper"
REAPER_STATUS: Final = "coordinator.reaper.status"
# Served by the stats service (see schemas/stats.py for the bodies).
STATS: Final = "coordinator.stats"
STATS_EXCLUDE: Final = "coordinator.stats.exclude"
STATS_INCLUDE: Final = "coordinator.stats.include"
STATS_EXCLUSIONS: Final = "coordinator.stats.exclusions"
STATS_REBUILD: Final = "coordinator.stats.rebuild"
STATS_BASELINES: Final = "coordinator.stats.baselines"
STATS_PARKED: Final = "coordinator.stats.parked"
ALIAS_ADD: Final = "coordinator.stats.alias.add"
ALIAS_REMOVE: Final = "coordinator.stats.alias.remove"
ALIASES: Final = "coordinator.stats.aliases"
# What only the stats instance that projects answers (``.stats``, ``.rebuild``): any instance
# takes those requests and passes them on here, where only the projecting one listens.
STATS_PROJECTING: Final = "coordinator.stats.projecting"

STATS_BUCKET: Final = "stats"
# Who acts for a role that runs active/standby (key = the role: `REAPER_ROLE`, `STATS_ROLE`;
# value = `schemas.leaders.LeaderRecord`); its TTL is the workers' (``WORKER_TTL_S``).
LEADERS_BUCKET: Final = "leaders"
REAPER_ROLE: Final = "reaper"
STATS_ROLE: Final = "stats"
# The gateway's API keys: key = the key's name, value = its hash and metadata (never the key).
GATEWAY_KEYS_BUCKET: Final = "gateway_keys"

# Streamed answers: a worker publishes a task's chunks on
# ``coordinator.chunk.<its worker id>.<task id>`` (its NATS user may publish under its own id
# only); the router, which holds the client's reply subject, passes on those of the worker the
# attempt runs on. No worker ever publishes to a client's inbox.
CHUNKS: Final = "coordinator.chunk.*.*"
# Every NATS user gets replies on inboxes of its own (``_INBOX_<user>.…``) and may subscribe to
# those only: nobody reads another's replies.
INBOX: Final = "_INBOX"


# Durable consumer names: the services create them, the reaper and `coordinator doctor` look
# them up, and the NATS permissions (`coordinator deploy`) name them.
# The stats service's projection of ``EVENTS``.
STATS_CONSUMER: Final = "stats"
_WORKER_CONSUMER_PREFIX: Final = "worker-"

# fullmatch: with match and "$", a trailing newline would pass ("$" matches before it).
_TOKEN = re.compile(r"[A-Za-z0-9_-]{1,128}")


class InvalidId(ValueError):
    """An id that cannot be used as one subject token. Below the error catalogue
    (`services.errors`), it carries its code and HTTP status itself."""

    code = "invalid_id"
    http_status = 400

    def __init__(self, kind: str, value: str) -> None:
        super().__init__(
            f"invalid {kind} {value!r}: use 1-128 letters, digits, '-' or '_' "
            "(no dots, spaces or wildcards, which would break the NATS subject)"
        )
        self.kind = kind
        self.value = value


def check_token(kind: str, value: str) -> str:
    """Return ``value`` if it is safe as a single subject token, else raise `InvalidId`."""
    if not _TOKEN.fullmatch(value):
        raise InvalidId(kind, value)
    return value


def check_worker_id(worker_id: str) -> str:
    """Like `check_token`, also refusing the names that are queues of their own."""
    check_token("worker id", worker_id)
    if worker_id in POOL_NAMES:
        raise InvalidId("worker id", worker_id)
    return worker_id


def worker_queue(tier: Tier, worker_id: str) -> str:
    """The queue one worker pulls for one tier: ``tasks.<tier>.<worker>``."""
    return f"tasks.{tier}.{check_worker_id(worker_id)}"


def worker_queue_filter(worker_id: str) -> str:
    """The consumer filter covering every tier queue of one worker."""
    return f"tasks.*.{check_worker_id(worker_id)}"


def task_event(task_id: str, kind: str, worker: str | None = None) -> str:
    """``events.task.<task_id>.<kind>``: one subject prefix per task makes its history one read.

    With ``worker``, ``events.task.<task_id>.<worker>.<kind>``: the subject of a worker's own
    events (``started``, ``completed``, ``failed``), which the NATS server lets each worker
    publish only under its own id (`services.fleet.binding`). Without, the router's and the
    reaper's (``submitted``, ``routed``, ``failed``)."""
    task, what = check_token("task id", task_id), check_token("event kind", kind)
    if worker is None:
        return f"events.task.{task}.{what}"
    return f"events.task.{task}.{check_token('worker id', worker)}.{what}"


def workers_task_event(task_id: str, kind: str) -> str:
    """``events.task.<task_id>.*.<kind>``: that kind of the task's events from any worker."""
    return f"events.task.{check_token('task id', task_id)}.*.{check_token('event kind', kind)}"


# What a worker reads of a task it holds: the router's and reaper's ``routed`` and ``failed``,
# and any worker's ``started``, ``completed`` and ``failed`` (never ``submitted``: the prompt).
_READ_OWN: Final = frozenset({"routed", "failed"})
_READ_WORKERS: Final = frozenset({"started", "completed", "failed"})


def task_of_readable_event(subject: str) -> str:
    """The task whose event ``subject`` names, one a worker may ask for (`LAST_EVENT`):
    ``events.task.<id>.routed|failed`` or ``events.task.<id>.<worker or *>.started|completed|
    failed``, the task id a plain token. `InvalidId` for anything else (a wildcard in the
    task's place reads every task's)."""
    parts = subject.split(".")
    if parts[:2] == ["events", "task"] and len(parts) in (4, 5):
        task_id, kind = parts[2], parts[-1]
        readable = kind in _READ_OWN if len(parts) == 4 else kind in _READ_WORKERS
        if readable and (len(parts) == 4 or parts[3] == "*" or _TOKEN.fullmatch(parts[3])):
            return check_token("task id", task_id)
    raise InvalidId("task event a worker reads", subject)


def task_event_source(subject: str) -> str | None:
    """The worker a task event's subject names (`task_event` with a worker), or None for
    the router's and the reaper's subjects."""
    parts = subject.split(".")
    return parts[3] if len(parts) == 5 and parts[:2] == ["events", "task"] else None


def chunk_subject(worker_id: str, task_id: str) -> str:
    """``coordinator.chunk.<worker_id>.<task_id>``: where a worker streams a task's answer."""
    return (
        f"coordinator.chunk.{check_token('worker id', worker_id)}.{check_token('task id', task_id)}"
    )


def chunk_source(subject: str) -> tuple[str, str] | None:
    """The (worker id, task id) of a chunk subject; None for any other subject."""
    parts = subject.split(".")
    if len(parts) != 4 or parts[:2] != ["coordinator", "chunk"]:
        return None
    return parts[2], parts[3]


def inbox_prefix(user: str | None) -> str:
    """The inbox prefix of a NATS user (``_INBOX_<user>``; ``_INBOX`` without a user): the
    services connect with it and the server configuration lets each user read only its own."""
    if user is None:
        return INBOX
    return f"{INBOX}_{check_token('NATS user', user)}"


def cancel_from(identity: str | None) -> str:
    """Where ``identity`` sends a cancel: ``coordinator.cancel.from.<identity>`` (see
    `CANCELS_FROM`); `CANCEL` without one (a bus without users)."""
    if identity is None:
        return CANCEL
    return f"{CANCELS_FROM[:-1]}{check_token('identity', identity)}"


def sender_of_cancel(subject: str) -> str | None:
    """The identity a cancel's subject names (`cancel_from`); None for `CANCEL`."""
    prefix = CANCELS_FROM[:-1]
    return subject.removeprefix(prefix) or None if subject.startswith(prefix) else None


def cancel_notice(task_id: str) -> str:
    """``coordinator.cancel.<task_id>``: the notice workers act on (see `CANCEL_NOTICES`)."""
    return f"coordinator.cancel.{check_token('task id', task_id)}"


def task_events(task_id: str) -> str:
    """Wildcard over every event of one task."""
    return f"events.task.{check_token('task id', task_id)}.>"


def worker_event(worker_id: str, kind: str) -> str:
    """``events.worker.<worker_id>.<kind>``."""
    return f"events.worker.{check_token('worker id', worker_id)}.{check_token('event kind', kind)}"


def quality_event(task_id: str, kind: str) -> str:
    """``events.quality.<task_id>.<kind>``: one subject per task, so "scored once" is checkable."""
    return f"events.quality.{check_token('task id', task_id)}.{check_token('event kind', kind)}"


def bench_event(run_id: str, kind: str) -> str:
    """``events.bench.<run_id>.<kind>``."""
    return f"events.bench.{check_token('run id', run_id)}.{check_token('event kind', kind)}"


def worker_consumer(worker_id: str) -> str:
    """``worker-<id>``: the durable consumer of one inference worker's own queues."""
    return f"{_WORKER_CONSUMER_PREFIX}{worker_id}"


def worker_of_consumer(name: str) -> str | None:
    """The worker id a `worker_consumer` name belongs to; None for any other consumer."""
    return (
        name.removeprefix(_WORKER_CONSUMER_PREFIX)
        if name.startswith(_WORKER_CONSUMER_PREFIX)
        else None
    )


def queue_consumer(queue: str) -> str:
    """The consumer that delivers ``queue``: the shared pools' own, else its worker's."""
    pool = pool_of_queue(queue)
    return pool.consumer if pool is not None else worker_consumer(queue.rsplit(".", 1)[-1])
