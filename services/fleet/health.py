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

The same probes read which models the backend holds in memory (Ollama's ``/api/ps``), which
the worker registers (`schemas.workers.WorkerRecord.resident`) so routing can count a cold
load. Between probes a task's end says it (`resident_after_task`): the model that just ran
is loaded, unless its ``keep_alive`` unloads it at once; when it was not loaded before, its
load may have pushed others out of memory, so the list is read again before the next task.
Each read also says how much memory each loaded model takes; the worker keeps the most it
has seen held at once (`memory_seen`), which routing takes for the backend's limits when
the operator gave none (``WORKER_MEMORY_GB``), to tell what a load would push out.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
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


# A Go duration (what Ollama's ``keep_alive`` string is): numbers with units, signed.
_GO_DURATION = re.compile(r"[+-]?(?:(?:\d+\.?\d*|\.\d+)(?:ns|us|µs|μs|ms|s|m|h))+")
_NUMBER = re.compile(r"\d+\.?\d*|\.\d+")


def unloads_at_once(keep_alive: float | str | None) -> bool:
    """Does ``keep_alive`` (Ollama's: seconds, or a Go duration such as ``"0s"``) unload the
    model as soon as its request is done?"""
    if keep_alive is None:
        return False
    if not isinstance(keep_alive, str):
        return keep_alive == 0
    text = keep_alive.strip()
    if text in ("0", "+0", "-0"):  # Go reads a bare zero without a unit
        return True
    return bool(_GO_DURATION.fullmatch(text)) and all(
        float(number) == 0 for number in _NUMBER.findall(text)
    )


def resident_after_task(
    resident: frozenset[str] | None, model: str, keep_alive: float | str | None
) -> tuple[frozenset[str] | None, bool]:
    """The models in memory after a task of ``model`` worked, given those before (None: not
    known), and whether to read them from the backend again before the next task (True when
    the model had to be loaded: that may have pushed other models out)."""
    loaded = resident is not None and model in resident
    if resident is None:
        return None, True
    after = resident - {model} if unloads_at_once(keep_alive) else resident | {model}
    return after, not loaded


@dataclass(frozen=True, slots=True)
class MemorySeen:
    """What a worker has seen of its backend's memory since it started."""

    sizes: Mapping[str, int] = field(default_factory=dict)
    """The memory (bytes) each model took when last seen loaded, by served name."""
    most_bytes: int = 0
    """The largest total of the models seen loaded at once."""
    most_models: int = 0
    """The most models seen loaded at once."""


def memory_seen(seen: MemorySeen, loaded: Mapping[str, int]) -> MemorySeen:
    """``seen`` after a read of the models in memory: ``loaded`` maps each to the bytes it
    takes (0: the backend did not say). What the backend held at once it can hold: the
    most seen is a floor of its limits, which rises as more is asked of it."""
    sizes = dict(seen.sizes)
    sizes.update((name, size) for name, size in loaded.items() if size > 0)
    return MemorySeen(
        sizes=sizes,
        most_bytes=max(seen.most_bytes, sum(loaded.values())),
        most_models=max(seen.most_models, len(loaded)),
    )
