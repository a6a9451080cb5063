"""Backend health: what a worker's own probes and tasks say of its model server. Pure: no I/O,
no clock (``now`` is given).

Lesson 13: a model server can answer its model list in milliseconds while every generation
hangs. Only the worker beside it can tell, so the worker says it in its heartbeat
(`schemas.workers.WorkerRecord.health`), and routing believes it (`routable`).

The worker (`services.worker.probe`) asks `due` between tasks, never while one runs (one
generation at a time per worker), runs the probe it names and folds the result in with
`probed`; each task's end is folded in with `task_ended`:

- healthy and idle: the model list (``list``) every ``interval_s``; once idle for
  ``idle_probe_s`` since the last generation that worked, a one-token generation per served
  model (``generate``) instead;
- right after a task's backend failure: ``generate``;
- degraded: ``generate`` every ``interval_s`` until one passes.

A failed probe, and a task whose backend could not be reached, sent no first token in time or
stalled mid-stream, make the worker ``degraded`` with the reason. Only a passed generation (a
probe's or a task's) makes it ``healthy`` again: a model list that answers is not the work.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from schemas.workers import HealthStatus, WorkerRecord

ProbeKind = Literal["list", "generate"]
"""``list``: the backend's model list. ``generate``: the list, then a one-token generation
(an embedding, for an embedding-only model) per served model."""


@dataclass(frozen=True, slots=True)
class HealthPolicy:
    """When to probe (``HEALTH_INTERVAL_S``, ``HEALTH_IDLE_PROBE_S``)."""

    interval_s: float
    """Between two probes while idle, healthy or degraded."""
    idle_probe_s: float | None
    """Idle this long since the last generation that worked: a generation probe. None: never
    (only the model list, and generations after failures)."""


@dataclass(frozen=True, slots=True)
class Failure:
    """A task's backend failure, as `task_ended` takes it."""

    reason: str
    degrades: bool
    """True when it shows the backend not working (unreachable, no first token in time, a
    stalled stream); False for one that may be the task's own (an error answer, the task's
    whole timeout): then a generation probe decides."""


@dataclass(frozen=True, slots=True)
class Health:
    """A worker's view of its backend."""

    status: HealthStatus
    reason: str | None
    """Why it is degraded; None when healthy."""
    since: float
    """When ``status`` last changed."""
    probed_at: float
    """The last probe or task end: what the backend was last seen doing."""
    worked_at: float
    """The last generation that worked (a probe's or a task's)."""
    recheck: bool = False
    """A generation probe is due at once (a task's backend failure)."""


def start(now: float) -> Health:
    """A worker whose models have just passed their sanity runs."""
    return Health(status="healthy", reason=None, since=now, probed_at=now, worked_at=now)


def due(health: Health, policy: HealthPolicy, now: float) -> ProbeKind | None:
    """The probe to run now, between tasks; None: none yet."""
    if health.recheck:
        return "generate"
    if now - health.probed_at < policy.interval_s:
        return None
    if health.status == "degraded":
        return "generate"
    if policy.idle_probe_s is not None and now - health.worked_at >= policy.idle_probe_s:
        return "generate"
    return "list"


def probed(health: Health, kind: ProbeKind, failure: str | None, now: float) -> Health:
    """After a probe of ``kind``: ``failure`` is what went wrong (None: it passed)."""
    if failure is not None:
        return dataclasses.replace(_degraded(health, failure, now), probed_at=now, recheck=False)
    if kind == "generate":
        return dataclasses.replace(_healthy(health, now), probed_at=now, worked_at=now)
    return dataclasses.replace(health, probed_at=now)


def task_ended(health: Health, failure: Failure | None, now: float) -> Health:
    """After a task's backend call: it worked (``failure`` None) or failed how."""
    if failure is None:
        return dataclasses.replace(_healthy(health, now), probed_at=now, worked_at=now)
    after = _degraded(health, failure.reason, now) if failure.degrades else health
    return dataclasses.replace(after, probed_at=now, recheck=True)


def _healthy(health: Health, now: float) -> Health:
    since = health.since if health.status == "healthy" else now
    return dataclasses.replace(health, status="healthy", reason=None, since=since, recheck=False)


def _degraded(health: Health, reason: str, now: float) -> Health:
    since = health.since if health.status == "degraded" else now
    return dataclasses.replace(health, status="degraded", reason=reason, since=since)


def routable(record: WorkerRecord) -> bool:
    """May work be routed to ``record``'s worker? Not while it says its backend is degraded."""
    return record.health != "degraded"


def degraded_reason(record: WorkerRecord) -> str:
    """How a degraded worker's state reads in an error or a finding."""
    return f"worker '{record.worker_id}' is degraded: {record.health_reason or 'no reason given'}"
