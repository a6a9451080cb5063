"""What the dashboard shows, section by section, from what the gateway knows: the registry
(the ``workers`` bucket), the router's listing (queue depths, problems, aliases), the task
board and the bench history (the event log), and the stats service's and the reaper's
answers. Pure: no I/O, no clock (``now`` is given).

A worker is judged by the one rule (`services.fleet.liveness`), and judged not live only once
the gateway's view of the registry has settled (`Known.settled`, `services.fleet.settling`):
until then, after a reconnect, its record may be the one from before the outage, so it shows
its last recorded state rather than ``lost``.

Each section is one JSON document the page renders whole; ``GET /dashboard/state`` is all of
them, ``GET /dashboard/stream`` sends each again when it changes. Nothing of a prompt or an
answer is in any of them: the page shows the fleet, not what people asked it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import msgspec

from schemas.queries import WorkerView
from schemas.stats import Baseline, ExclusionView, FigureView
from schemas.subjects import STATS
from schemas.workers import WorkerRecord
from services.fleet.liveness import is_live
from services.fleet.model_matrix import matrix
from services.fleet.policy import tier_label
from services.gateway.bench_history import BenchHistory, BenchSeries
from services.gateway.board import Ended, ReaperAction, TaskBoard
from services.gateway.metrics import Gauges, WorkerGauge

# Tasks listed as queued or running (the counts cover all of them).
OPEN_SHOWN: Final = 100
# A worker that left (its entry deleted) or went silent stays listed this long.
FORGET_AFTER_S: Final = 600.0


class WorkerRow(msgspec.Struct, frozen=True, kw_only=True):
    worker_id: str
    host: str
    tier: str
    state: str
    """As its heartbeat says (idle, busy, stopping, asleep), or ``lost`` (no heartbeat for
    ``WORKER_TTL_S``, once the view has settled) or ``gone`` (it left the registry)."""
    health: str
    health_reason: str | None = None
    health_since: float | None = None
    models: list[str]
    resident: list[str] | None = None
    """The models its backend holds in memory (None: the worker does not say)."""
    current_model: str | None = None
    current_task: str | None = None
    task_started_at: float | None = None
    queue_depth: int | None = None
    last_heartbeat: float
    problems: list[str] = []
    version: str = ""


class TaskRow(msgspec.Struct, frozen=True, kw_only=True):
    task_id: str
    model: str
    kind: str
    status: str
    attempt: int
    worker: str | None = None
    submitted_at: float
    started_at: float | None = None
    client: str | None = None


class EndRow(msgspec.Struct, frozen=True, kw_only=True):
    task_id: str
    model: str
    kind: str
    worker: str
    attempt: int
    outcome: str
    message: str = ""
    retryable: bool = False
    at: float
    total_ms: float | None = None


class ActionRow(msgspec.Struct, frozen=True, kw_only=True):
    action: str
    reason: str
    at: float
    task_id: str | None = None
    attempt: int = 0
    worker: str | None = None


class ColdLoads(msgspec.Struct, frozen=True, kw_only=True):
    model: str
    worker: str
    count: int


@dataclass
class Known:
    """Everything the sections are made of, as the feed last read it."""

    board: TaskBoard
    bench: BenchHistory
    records: dict[str, WorkerRecord] = field(default_factory=dict)
    gone: dict[str, float] = field(default_factory=dict)
    """Workers that left the registry, with when; their last record stays in ``records``."""
    views: dict[str, WorkerView] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)
    exclusions: list[ExclusionView] = field(default_factory=list)
    figures: list[FigureView] = field(default_factory=list)
    baselines: list[Baseline] = field(default_factory=list)
    reaper: dict[str, Any] | None = None
    event_log: dict[str, int] | None = None
    stats_lag: int | None = None
    projected_seq: int = 0
    unavailable: dict[str, str] = field(default_factory=dict)
    """What could not be read lately, by source, with why (shown as a warning)."""
    settled: bool = True
    """Has the view of the registry settled (`services.fleet.settling`)? While it settles
    (after a reconnect, or while the bucket stores no heartbeats) a stale heartbeat proves
    nothing: the worker's fresh one may not be read yet."""


def forget_departed(known: Known, now: float, ttl_s: float) -> None:
    """Drop workers gone or silent for `FORGET_AFTER_S` (a silent one only once the view has
    settled: until then its silence is not known)."""
    for worker_id, record in list(known.records.items()):
        if worker_id not in known.gone and not known.settled:
            continue
        left = known.gone.get(worker_id, record.heartbeat_at + ttl_s)
        if now - left > FORGET_AFTER_S:
            known.records.pop(worker_id)
            known.gone.pop(worker_id, None)


def _live(known: Known, record: WorkerRecord, now: float, ttl_s: float) -> bool:
    """Is the worker live, as far as the view may tell: by the one rule, but while the view
    settles a stale heartbeat does not count against it (stopping still does)."""
    if not known.settled:
        return record.state != "stopping"
    return is_live(record, now, ttl_s)


def _state(known: Known, record: WorkerRecord, now: float, ttl_s: float) -> str:
    if record.worker_id in known.gone:
        return "gone"
    if record.state != "stopping" and not _live(known, record, now, ttl_s):
        return "lost"
    return record.state


def worker_rows(known: Known, now: float, ttl_s: float) -> list[WorkerRow]:
    """Every worker the registry holds or held lately, by id."""
    rows = []
    for worker_id in sorted(known.records):
        record = known.records[worker_id]
        view = known.views.get(worker_id)
        state = _state(known, record, now, ttl_s)
        running = state in ("busy", "stopping") and record.current_task is not None
        line = known.board.line(record.current_task) if running and record.current_task else None
        rows.append(
            WorkerRow(
                worker_id=worker_id,
                host=record.host,
                tier=tier_label(record),
                state=state,
                health=record.health,
                health_reason=record.health_reason,
                health_since=record.health_since,
                models=record.models,
                resident=record.resident,
                current_model=record.current_model if running else None,
                current_task=record.current_task if running else None,
                task_started_at=line.started_at if line is not None else None,
                queue_depth=view.queue_depth if view is not None else None,
                last_heartbeat=record.heartbeat_at,
                problems=view.problems if view is not None else [],
                version=record.version,
            )
        )
    return rows


def task_rows(board: TaskBoard) -> list[TaskRow]:
    return [
        TaskRow(
            task_id=line.task_id,
            model=line.model,
            kind=line.kind,
            status=line.status,
            attempt=line.attempt,
            worker=line.worker or line.routed_to,
            submitted_at=line.submitted_at,
            started_at=line.started_at,
            client=line.client,
        )
        for line in list(board.open_lines())[:OPEN_SHOWN]
    ]


def end_rows(ends: list[Ended]) -> list[EndRow]:
    """Newest first."""
    return [
        EndRow(
            task_id=e.task_id,
            model=e.model,
            kind=e.kind,
            worker=e.worker,
            attempt=e.attempt,
            outcome=e.outcome,
            message=e.message,
            retryable=e.retryable,
            at=e.at,
            total_ms=e.durations.total_ms if e.durations is not None else None,
        )
        for e in reversed(ends)
    ]


def action_rows(actions: list[ReaperAction]) -> list[ActionRow]:
    """Newest first."""
    return [
        ActionRow(
            action=a.action,
            reason=a.reason,
            at=a.at,
            task_id=a.task_id,
            attempt=a.attempt,
            worker=a.worker,
        )
        for a in reversed(actions)
    ]


def sections(known: Known, now: float, ttl_s: float) -> dict[str, Any]:
    """Every section but the samples (sent apart, as they come), by name."""
    workers = worker_rows(known, now, ttl_s)
    board = known.board
    statuses = [line.status for line in board.open.values()]
    bench: list[BenchSeries] = known.bench.series(known.baselines)
    return {
        "summary": {
            "now": now,
            "workers": len(workers),
            "live": sum(w.state not in ("lost", "gone") for w in workers),
            "degraded": sum(w.health == "degraded" for w in workers),
            "queued": statuses.count("queued"),
            "running": statuses.count("running"),
            "reaper": known.reaper,
            "event_log": known.event_log,
            "stats_lag": known.stats_lag,
            "projected_seq": known.projected_seq,
            "unavailable": known.unavailable,
        },
        "workers": workers,
        "tasks": {
            "open": task_rows(board),
            "done": end_rows(list(board.done)),
            "failures": end_rows(list(board.failures)),
            "actions": action_rows(list(board.actions)),
        },
        "models": matrix(
            [known.views[w] for w in sorted(known.views)],
            None if STATS in known.unavailable else known.figures,
        ),
        "figures": {
            "figures": known.figures,
            "cold_loads": [
                ColdLoads(model=m, worker=w, count=n)
                for (m, w), n in sorted(board.cold_loads.items())
            ],
        },
        "bench": bench,
        "config": {
            "aliases": dict(sorted(known.aliases.items())),
            "exclusions": known.exclusions,
        },
    }


# The sections that name tasks: a key that is not the operator's sees its own tasks' ids only.
TASK_SECTIONS: Final = ("workers", "tasks")
# What a task's id reads as to a key it is not for: present (the worker is busy), not told.
NOT_YOURS: Final = ""


def for_key(built: dict[str, Any], client: str, board: TaskBoard) -> dict[str, Any]:
    """`TASK_SECTIONS` of ``built`` (`sections`) as the key ``client`` sees them: another
    key's (or a person's) task ids blanked, and their keys' names."""

    def mine(task_id: str | None) -> bool:
        line = board.line(task_id) if task_id else None
        return line is not None and line.client == client

    def end(row: EndRow) -> EndRow:
        return row if mine(row.task_id) else msgspec.structs.replace(row, task_id=NOT_YOURS)

    workers: list[WorkerRow] = built["workers"]
    tasks: dict[str, Any] = built["tasks"]
    return {
        "workers": [
            w
            if w.current_task is None or mine(w.current_task)
            else msgspec.structs.replace(w, current_task=NOT_YOURS)
            for w in workers
        ],
        "tasks": {
            "open": [
                t if mine(t.task_id) else msgspec.structs.replace(t, task_id=NOT_YOURS, client=None)
                for t in tasks["open"]
            ],
            "done": [end(e) for e in tasks["done"]],
            "failures": [end(e) for e in tasks["failures"]],
            "actions": [
                a
                if a.task_id is None or mine(a.task_id)
                else msgspec.structs.replace(a, task_id=None)
                for a in tasks["actions"]
            ],
        },
    }


def gauges(known: Known, now: float, ttl_s: float) -> Gauges:
    """The metrics' gauges: workers still in the registry (up while live, a stale heartbeat
    counting only once the view has settled), the open tasks, the log's state."""
    workers = [
        WorkerGauge(
            worker=r.worker_id,
            up=_live(known, r, now, ttl_s),
            healthy=r.health == "healthy",
            in_flight=1 if r.current_task is not None and _live(known, r, now, ttl_s) else 0,
            heartbeat_age_s=max(0.0, now - r.heartbeat_at),
            queue_depth=view.queue_depth if (view := known.views.get(r.worker_id)) else None,
        )
        for r in sorted(known.records.values(), key=lambda r: r.worker_id)
        if r.worker_id not in known.gone
    ]
    statuses: Mapping[str, int] = {
        status: sum(line.status == status for line in known.board.open.values())
        for status in ("queued", "running")
    }
    log = known.event_log or {}
    return Gauges(
        workers=workers,
        open_tasks=statuses,
        event_log_messages=log.get("messages"),
        event_log_bytes=log.get("bytes"),
        event_log_last_seq=log.get("last_seq"),
        stats_lag=known.stats_lag,
        projected_seq=known.projected_seq,
    )
