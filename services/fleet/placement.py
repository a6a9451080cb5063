"""Where models should live (`coordinator models advise`): placements proposed from the demand
the event log recorded over a window and the machines the router lists. Pure: no I/O, no clock
(the window is given). It changes nothing: it says what to pull where and what to remove.

What it reads:

- the task events of the window: each task's model, type and submission time
  (``submitted``), when it first started (``started``), and each done attempt's worker, load
  time, tokens and generation time (``completed``). Web-search and model-change tasks are no
  demand for a model and are left out;
- the workers' ``asleep`` and ``registered`` events: when a machine slept;
- the live workers (`WorkerView`, the router's list) and the sleeping ones (the ``asleep``
  bucket's records): the models each holds, their sizes, its memory;
- the stats service's figures when it answers: a model's generation speed on a worker over
  all its history (else the window's completions give it).

Per model and per day of the window it counts requests, tokens (prompt and generated) and the
cold loads on each worker (a done attempt whose load took `COLD_LOAD_MIN_MS` or more, the
project's one test of a cold load), and takes the p50 wait (``submitted`` to first
``started``).

The rules, each in one function, in order of priority:

1. ``cold_loads`` (`_cold_loads`): a model loaded cold on machines that cannot keep it in
   memory beside their other hot models (those that ran there `HOT_TASKS_PER_DAY` or more):
   its size and theirs over the machine's ``memory_bytes`` (a machine that does not say it is
   taken at its cold loads' word). When a model kept in memory would load cold at least
   `MIN_AVOIDED_COLD_LOADS_PER_DAY` fewer times a day → pull it onto a target.
2. ``asleep_when_asked`` (`_asleep_when_asked`): a model only sleeping machines hold, asked
   for `MIN_ASKED_ASLEEP_PER_DAY` or more a day while every one of them slept → pull it onto a
   target.
3. ``unused`` (`_unused`): a model no task asked for in the window → remove it from each
   machine that holds it (it takes disk; the lowest priority). Never said of a window without
   a single request (a log that does not reach back that far says nothing of use).

A target (`_target`) is a live, healthy machine that did not sleep in the window, does not
hold the model, says how much memory its backend holds, has room for the model beside its own
hot models (less what earlier pulls took there), and runs it fast enough:
at least `FAST_ENOUGH` of the model's speed where it ran, estimated from the target's speeds
on its own models scaled by their sizes (generating a token reads every weight, so a model
twice the size runs about half as fast); where a speed is not known, a machine of the same
tier or better. The fastest target wins, then the roomiest, then the first by id.

A model gets one pull at most (rule 2 before rule 1). Pulls are placed in order of what they
avoid a day (cold loads and requests that found every holder asleep, together; a tie goes to
the larger model, which frees more room), each taking its room on its target. A pull also
makes room where the model was: a ``cold_loads`` model that then fits beside what stays on
every machine it loaded cold on gets a note, not a pull (`_room_made`); so does a model no
target can take.

The expected effect of a pull, before → after: the model's cold loads a day on the machines
concerned → those that keeping it in memory leaves (a request that starts `KEEP_ALIVE_S`
or more after the previous one ended: Ollama unloads a model idle that long); its
requests a day that found every holder asleep → 0; the p50 wait of the requests concerned →
the target's p50 wait over the window (None where it ran nothing).

Limits: sizes are the files' (a loaded model takes more: its context cache); which model a
backend unloads first is its own choice and is not modelled; the after-figures assume routing
sends the model's requests to the target; a speed scaled by size ignores a small model's fixed
costs (it flatters a target that ran only small models); a machine slept from its ``asleep``
event to its next ``registered`` (from the window's start when it sleeps now or registered
first), and one able to sleep that did not in the window counts as always on; room is
counted in bytes only (``max_resident`` is the most models a worker has seen loaded at once,
not a limit, and Ollama's own cap, ``OLLAMA_MAX_LOADED_MODELS``, is not known here).
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final, Literal

import msgspec

from schemas.events import (
    AnyEvent,
    TaskCompleted,
    TaskStarted,
    TaskSubmitted,
    WorkerAsleep,
    WorkerRegistered,
)
from schemas.models import facts_in
from schemas.queries import WorkerView
from schemas.stats import COLD_LOAD_MIN_MS, FigureView
from schemas.workers import WorkerRecord
from services.fleet.policy import tier_label

DAY_S: Final = 86_400.0
# Ollama unloads a model idle this long (its default keep_alive): a request after such a gap
# loads cold wherever the model lives.
KEEP_ALIVE_S: Final = 300.0
# A model that ran this often a day on a machine is one of its hot models (it wants to stay).
HOT_TASKS_PER_DAY: Final = 1.0
# Rule 1 proposes a pull from this many cold loads a day avoided.
MIN_AVOIDED_COLD_LOADS_PER_DAY: Final = 3.0
# Rule 2 proposes a pull from this many requests a day that found every holder asleep.
MIN_ASKED_ASLEEP_PER_DAY: Final = 1.0
# A target is fast enough at this share of the model's speed where it ran.
FAST_ENOUGH: Final = 0.5
# Task types that are no demand for their model: a web search's summary model is called by
# the web-search worker, a model change moves a model rather than running it.
NOT_DEMAND: Final = frozenset({"web_search", "model_change"})
# A note when the first event read is this long after the window's start.
LATE_START_S: Final = DAY_S
_TIER_RANK: Final = {"cpu": 1, "gpu": 2}

Action = Literal["pull", "remove"]
Rule = Literal["cold_loads", "asleep_when_asked", "unused"]


class Measure(msgspec.Struct, frozen=True, kw_only=True):
    """One side of a pull's expected effect: the model on the machines concerned."""

    cold_loads_per_day: float
    asked_asleep_per_day: float = 0.0
    """Requests a day that found every machine holding the model asleep."""
    wait_p50_s: float | None = None
    """From submission to start, p50 (None: not measured)."""


class Proposal(msgspec.Struct, frozen=True, kw_only=True):
    action: Action
    model: str
    worker: str
    """The machine to pull the model onto, or to remove it from."""
    rule: Rule
    reason: str
    sources: list[str] = msgspec.field(default_factory=list)
    """The machines whose cold loads or sleep the pull answers."""
    before: Measure | None = None
    after: Measure | None = None
    """The expected effect of a pull (None for a removal)."""
    frees_bytes: int = 0
    """The disk a removal frees (the file's size; 0: not known)."""


class Demand(msgspec.Struct, frozen=True, kw_only=True):
    """What the window asked of one model, per day."""

    model: str
    requests_per_day: float
    tokens_per_day: float
    wait_p50_s: float | None
    cold_loads_per_day: dict[str, float]
    """Per worker, where it loaded cold at least once."""
    holders: list[str]
    """The machines that hold it (live or asleep), by id."""


class Advice(msgspec.Struct, frozen=True, kw_only=True):
    """What ``coordinator models advise --json`` prints."""

    since: float
    until: float
    days: float
    demand: list[Demand]
    proposals: list[Proposal]
    """Pulls first, by what they avoid; then removals, the largest first."""
    notes: list[str]
    figures: bool
    """Whether speeds came from the stats service (else from the window's completions)."""


# -- the log, folded -----------------------------------------------------------------------------


@dataclass(slots=True)
class _Task:
    model: str | None = None
    demand: bool = True
    submitted_at: float | None = None
    started_at: float | None = None
    started_on: str | None = None


@dataclass(frozen=True, slots=True)
class _Run:
    """A done attempt: where, when (its start estimated from its end less its duration)."""

    model: str
    worker: str
    start: float
    end: float
    cold: bool
    tokens: int
    eval_tokens: int | None
    eval_ms: float | None


@dataclass(slots=True)
class _Log:
    tasks: dict[str, _Task] = field(default_factory=dict)
    runs: dict[tuple[str, int], _Run] = field(default_factory=dict)
    marks: dict[str, list[tuple[float, bool]]] = field(default_factory=dict)
    """Per worker, (time, went asleep) for its ``asleep`` (True) and ``registered`` events."""
    first_at: float | None = None

    def fold(self, events: Iterable[AnyEvent], since: float, until: float) -> None:
        for event in events:
            if not since <= event.at <= until:
                continue
            self.first_at = event.at if self.first_at is None else min(self.first_at, event.at)
            if isinstance(event, TaskSubmitted):
                task = self.tasks.setdefault(event.task_id, _Task())
                task.model = event.model
                task.demand = event.work.task_type not in NOT_DEMAND
                task.submitted_at = event.at
            elif isinstance(event, TaskStarted):
                task = self.tasks.setdefault(event.task_id, _Task())
                if task.started_at is None or event.at < task.started_at:
                    task.started_at, task.started_on = event.at, event.worker
            elif isinstance(event, TaskCompleted):
                load = event.durations.load_ms
                self.runs[(event.task_id, event.attempt)] = _Run(
                    model=event.model,
                    worker=event.worker,
                    start=event.at - event.durations.total_ms / 1000,
                    end=event.at,
                    cold=load is not None and load >= COLD_LOAD_MIN_MS,
                    tokens=(event.tokens.prompt or 0) + (event.tokens.eval or 0),
                    eval_tokens=event.tokens.eval,
                    eval_ms=event.durations.eval_ms,
                )
            elif isinstance(event, WorkerAsleep | WorkerRegistered):
                asleep = isinstance(event, WorkerAsleep)
                self.marks.setdefault(event.worker_id, []).append((event.at, asleep))

    def demand_runs(self) -> list[_Run]:
        """The done attempts of tasks that are demand, by their end."""
        runs = [
            run
            for (task_id, _), run in self.runs.items()
            if (task := self.tasks.get(task_id)) is None or task.demand
        ]
        return sorted(runs, key=lambda r: (r.end, r.worker))

    def asked(self) -> list[_Task]:
        """The tasks submitted in the window that are demand for their model."""
        return [t for t in self.tasks.values() if t.demand and t.submitted_at is not None]


def _sleep_spans(
    marks: Mapping[str, list[tuple[float, bool]]],
    asleep_now: Iterable[str],
    since: float,
    until: float,
) -> dict[str, list[tuple[float, float]]]:
    """When each machine that sleeps slept: from an ``asleep`` event to its next
    ``registered``; from ``since`` when it sleeps now or its first event is ``registered``;
    to ``until`` when no ``registered`` follows."""
    now = set(asleep_now)
    spans: dict[str, list[tuple[float, float]]] = {}
    for worker_id in sorted(now | set(marks)):
        seen = sorted(marks.get(worker_id, ()))
        if worker_id not in now and not any(asleep for _, asleep in seen):
            continue  # it never slept: an always-on machine that restarted
        start: float | None = since if not seen or not seen[0][1] else None
        own: list[tuple[float, float]] = []
        for at, asleep in seen:
            if asleep and start is None:
                start = at
            elif not asleep and start is not None:
                own.append((start, at))
                start = None
        if start is not None:
            own.append((start, until))
        spans[worker_id] = own
    return spans


# -- the machines --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Machine:
    worker_id: str
    tier: str
    models: tuple[str, ...]
    sizes: Mapping[str, int]
    memory_bytes: int | None
    always_on: bool
    """Live, healthy and not asleep in the window: a machine a model can be pulled onto."""
    sleeps: bool


def _machines(
    workers: Sequence[WorkerView], sleepers: Sequence[WorkerRecord], slept: Iterable[str]
) -> dict[str, _Machine]:
    slept_ids = set(slept)
    found: dict[str, _Machine] = {}
    for record in sleepers:
        if tier_label(record) != "web":
            found[record.worker_id] = _Machine(
                worker_id=record.worker_id,
                tier=tier_label(record),
                models=tuple(record.models),
                sizes={m: record.facts_of(m).size for m in record.models},
                memory_bytes=record.memory_bytes,
                always_on=False,
                sleeps=True,
            )
    for view in workers:  # a live worker's own word over a stale sleeper's entry
        if view.tier == "web":
            continue
        sleeps = view.worker_id in slept_ids or view.state == "asleep"
        found[view.worker_id] = _Machine(
            worker_id=view.worker_id,
            tier=view.tier,
            models=tuple(view.models),
            sizes={m: facts_in(view.facts, m).size for m in view.models},
            memory_bytes=view.memory_bytes,
            always_on=not sleeps and view.health == "healthy",
            sleeps=sleeps,
        )
    return dict(sorted(found.items()))


def _size_of(model: str, machines: Mapping[str, _Machine]) -> int:
    """The model's file size on the first machine that says it (0: none does)."""
    return next((m.sizes[model] for m in machines.values() if m.sizes.get(model)), 0)


# -- the figures the rules share -----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Fleet:
    """What the rules read: the window, the machines, the demand and the measures."""

    days: float
    machines: Mapping[str, _Machine]
    runs: Mapping[str, list[_Run]]
    """Per model, its done attempts by their end."""
    asked: Mapping[str, list[_Task]]
    """Per model, its tasks submitted in the window."""
    spans: Mapping[str, list[tuple[float, float]]]
    speeds: Mapping[tuple[str, str], float]
    """Tokens a second generated, per (model, worker)."""
    hot: Mapping[str, set[str]]
    """Per worker, the models that ran there `HOT_TASKS_PER_DAY` or more."""

    @classmethod
    def of(
        cls,
        log: _Log,
        machines: Mapping[str, _Machine],
        spans: Mapping[str, list[tuple[float, float]]],
        figures: Sequence[FigureView] | None,
        days: float,
    ) -> _Fleet:
        runs = log.demand_runs()
        by_model: dict[str, list[_Run]] = {}
        counts: dict[tuple[str, str], int] = {}
        for run in runs:
            by_model.setdefault(run.model, []).append(run)
            counts[(run.worker, run.model)] = counts.get((run.worker, run.model), 0) + 1
        asked: dict[str, list[_Task]] = {}
        for task in log.asked():
            asked.setdefault(task.model or "", []).append(task)
        hot: dict[str, set[str]] = {}
        for (worker_id, model), count in counts.items():
            if count / days >= HOT_TASKS_PER_DAY:
                hot.setdefault(worker_id, set()).add(model)
        return cls(
            days=days,
            machines=machines,
            runs=by_model,
            asked=asked,
            spans=spans,
            speeds=_speeds(runs, figures),
            hot=hot,
        )

    def hot_on(self, worker_id: str) -> set[str]:
        return self.hot.get(worker_id, set())

    def asleep_at(self, worker_id: str, at: float) -> bool:
        return any(start <= at < end for start, end in self.spans.get(worker_id, ()))

    def started_on(self, worker_id: str) -> list[_Task]:
        """The tasks of the window that first started on the machine."""
        return [t for tasks in self.asked.values() for t in tasks if t.started_on == worker_id]

    def bytes_per_s(self, worker_id: str) -> float | None:
        """The machine's generation speed in weights read a second: the median over its models
        of tokens a second times the model's size (None: none measured with a known size)."""
        machine = self.machines[worker_id]
        rates = [
            speed * size
            for (model, worker), speed in self.speeds.items()
            if worker == worker_id and (size := machine.sizes.get(model, 0)) > 0
        ]
        return statistics.median(rates) if rates else None


def _wait_p50_s(tasks: Iterable[_Task]) -> float | None:
    """From submission to first start, p50 (None: none of them started)."""
    waits = [
        t.started_at - t.submitted_at
        for t in tasks
        if t.started_at is not None and t.submitted_at is not None
    ]
    return statistics.median(waits) if waits else None


def _speeds(
    runs: Iterable[_Run], figures: Sequence[FigureView] | None
) -> dict[tuple[str, str], float]:
    """Tokens a second per (model, worker): the figures' (weighted by their counts), else the
    window's completions (generated tokens over generation time)."""
    tokens: dict[tuple[str, str], float] = {}
    seconds: dict[tuple[str, str], float] = {}
    for run in runs:
        if run.eval_tokens and run.eval_ms:
            key = (run.model, run.worker)
            tokens[key] = tokens.get(key, 0.0) + run.eval_tokens
            seconds[key] = seconds.get(key, 0.0) + run.eval_ms / 1000
    speeds = {key: tokens[key] / seconds[key] for key in tokens}
    weighted: dict[tuple[str, str], tuple[float, int]] = {}
    for f in figures or ():
        if f.tokens_per_s is not None and f.count > 0:
            total, count = weighted.get((f.model, f.worker), (0.0, 0))
            weighted[(f.model, f.worker)] = (total + f.tokens_per_s * f.count, count + f.count)
    speeds.update({key: total / count for key, (total, count) in weighted.items()})
    return speeds


def _fits(machine: _Machine, model: str, beside: set[str], size: int) -> bool | None:
    """Can the machine keep ``model`` (``size`` bytes) in memory beside ``beside``? None: not
    known (it does not say how much memory it has, or the model's size is not known)."""
    if machine.memory_bytes is None or not size:
        return None
    return size + sum(machine.sizes.get(m, 0) for m in beside - {model}) <= machine.memory_bytes


def _reloads(runs: Sequence[_Run]) -> int:
    """The loads the model kept in memory would still take over ``runs`` (by their end): one
    per run that starts `KEEP_ALIVE_S` or more after the previous one ended. The first run is
    not counted: what came before it is not known."""
    ordered = sorted(runs, key=lambda r: r.end)
    return sum(
        1 for before, run in itertools.pairwise(ordered) if run.start - before.end >= KEEP_ALIVE_S
    )


# -- the rules -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Need:
    """A model that should be pulled somewhere, as a rule found it."""

    model: str
    rule: Rule
    sources: tuple[str, ...]
    before: Measure
    after_cold_loads_per_day: float
    why: str
    source_speed: float | None
    """The model's best speed on ``sources`` (tokens a second; None: not measured)."""
    source_tier: str

    @property
    def avoided_per_day(self) -> float:
        """Cold loads and requests that found every holder asleep, a day."""
        cold = self.before.cold_loads_per_day - self.after_cold_loads_per_day
        return cold + self.before.asked_asleep_per_day


def _cold_loads(fleet: _Fleet, model: str) -> _Need | None:
    """Rule 1: cold loads on machines that cannot keep the model beside their hot models."""
    size = _size_of(model, fleet.machines)
    runs = fleet.runs.get(model, [])
    sources: list[str] = []
    why: list[str] = []
    for worker_id, machine in fleet.machines.items():
        if not any(r.cold and r.worker == worker_id for r in runs):
            continue
        hot = fleet.hot_on(worker_id) - {model}
        fits = _fits(machine, model, hot, size)
        if fits:
            continue  # its cold loads are idle unloads, not a lack of room
        sources.append(worker_id)
        if fits is None:
            why.append(f"{worker_id} does not say what its memory holds")
        else:
            beside = ", ".join(f"{m} ({_gb(machine.sizes.get(m, 0))})" for m in sorted(hot))
            why.append(
                f"{worker_id} cannot keep it ({_gb(size)}) beside {beside or 'nothing'} "
                f"in {_gb(machine.memory_bytes or 0)}"
            )
    if not sources:
        return None
    concerned = [r for r in runs if r.worker in sources]
    before = sum(1 for r in concerned if r.cold) / fleet.days
    after = _reloads(concerned) / fleet.days
    if before - after < MIN_AVOIDED_COLD_LOADS_PER_DAY:
        return None
    asked = [t for t in fleet.asked.get(model, ()) if t.started_on in sources]
    return _Need(
        model=model,
        rule="cold_loads",
        sources=tuple(sources),
        before=Measure(cold_loads_per_day=before, wait_p50_s=_wait_p50_s(asked)),
        after_cold_loads_per_day=after,
        why=f"{_count(before)} cold loads a day on {' and '.join(sources)}: " + "; ".join(why),
        source_speed=_best_speed(fleet, model, sources),
        source_tier=_best_tier(fleet, sources),
    )


def _asleep_when_asked(fleet: _Fleet, model: str) -> _Need | None:
    """Rule 2: only sleeping machines hold the model, and it was asked for while they slept."""
    sources = [w for w, m in fleet.machines.items() if model in m.models]
    if not sources or not all(fleet.machines[w].sleeps for w in sources):
        return None
    asleep = [
        t
        for t in fleet.asked.get(model, ())
        if t.submitted_at is not None and all(fleet.asleep_at(w, t.submitted_at) for w in sources)
    ]
    per_day = len(asleep) / fleet.days
    if per_day < MIN_ASKED_ASLEEP_PER_DAY:
        return None
    runs = [r for r in fleet.runs.get(model, ()) if r.worker in sources]
    one = len(sources) == 1
    return _Need(
        model=model,
        rule="asleep_when_asked",
        sources=tuple(sources),
        before=Measure(
            cold_loads_per_day=sum(1 for r in runs if r.cold) / fleet.days,
            asked_asleep_per_day=per_day,
            wait_p50_s=_wait_p50_s(asleep),
        ),
        after_cold_loads_per_day=_reloads(runs) / fleet.days,
        why=f"only {' and '.join(sources)} {'holds' if one else 'hold'} it, and "
        f"{_count(per_day)} requests a day found {'it' if one else 'them'} asleep",
        source_speed=_best_speed(fleet, model, sources),
        source_tier=_best_tier(fleet, sources),
    )


def _unused(fleet: _Fleet) -> list[Proposal]:
    """Rule 3: a model no task asked for in the window, on each machine that holds it."""
    found = [
        Proposal(
            action="remove",
            model=model,
            worker=machine.worker_id,
            rule="unused",
            reason=f"no request in {_days(fleet.days)}"
            + (f"; it takes {_gb(size)} of disk there" if size else ""),
            frees_bytes=size,
        )
        for machine in fleet.machines.values()
        for model in machine.models
        if model not in fleet.asked
        for size in (machine.sizes.get(model, 0),)
    ]
    return sorted(found, key=lambda p: (-p.frees_bytes, p.model, p.worker))


def _target(
    fleet: _Fleet, need: _Need, size: int, taken: Mapping[str, int]
) -> tuple[_Machine, float | None] | None:
    """The machine to pull the model onto (the module's docstring says which), with its
    estimated speed for it; ``taken``: the bytes earlier pulls put on each."""
    fitting: list[tuple[float, int, str, _Machine, float | None]] = []
    for machine in fleet.machines.values():
        if not machine.always_on or need.model in machine.models:
            continue
        if machine.memory_bytes is None:
            continue  # no word on its room: nothing is promised of it
        hot = fleet.hot_on(machine.worker_id)
        room = (
            machine.memory_bytes
            - taken.get(machine.worker_id, 0)
            - sum(machine.sizes.get(m, 0) for m in hot)
        )
        if size > room:
            continue
        rate = fleet.bytes_per_s(machine.worker_id)
        speed = rate / size if rate is not None else None
        if speed is not None and need.source_speed is not None:
            if speed < FAST_ENOUGH * need.source_speed:
                continue
        elif _TIER_RANK.get(machine.tier, 0) < _TIER_RANK.get(need.source_tier, 0):
            continue
        fitting.append((-(speed or 0.0), -room, machine.worker_id, machine, speed))
    if not fitting:
        return None
    best = min(fitting, key=lambda c: c[:3])
    return best[3], best[4]


def _room_made(fleet: _Fleet, need: _Need, size: int, moved: Mapping[str, set[str]]) -> str | None:
    """The models earlier pulls take off the machines of a ``cold_loads`` need, when that
    leaves room there for its model on every one of them (its cold loads then end without a
    pull of its own); None otherwise."""
    gone = sorted({m for w in need.sources for m in moved.get(w, ())})
    if not gone:
        return None
    for worker_id in need.sources:
        beside = fleet.hot_on(worker_id) - moved.get(worker_id, set())
        if not _fits(fleet.machines[worker_id], need.model, beside, size):
            return None
    return " and ".join(gone)


def _best_speed(fleet: _Fleet, model: str, sources: Iterable[str]) -> float | None:
    speeds = [s for w in sources if (s := fleet.speeds.get((model, w))) is not None]
    return max(speeds) if speeds else None


def _best_tier(fleet: _Fleet, sources: Iterable[str]) -> str:
    return max((fleet.machines[w].tier for w in sources), key=lambda t: _TIER_RANK.get(t, 0))


# -- the advice ----------------------------------------------------------------------------------


def advise(
    events: Iterable[AnyEvent],
    workers: Sequence[WorkerView],
    figures: Sequence[FigureView] | None = None,
    *,
    sleepers: Sequence[WorkerRecord] = (),
    since: float,
    until: float,
) -> Advice:
    """The demand of the window [``since``, ``until``] and the placements it calls for (the
    rules: the module's docstring). ``events``: the task and worker events read from the log
    (others, and those outside the window, are passed over); ``workers``: the live ones as the
    router lists them; ``sleepers``: the ``asleep`` bucket's records; ``figures``: the stats
    service's, None when it did not answer."""
    if until <= since:
        raise ValueError(f"the window must end after it starts: {since} to {until}")
    log = _Log()
    log.fold(events, since, until)
    spans = _sleep_spans(log.marks, (r.worker_id for r in sleepers), since, until)
    machines = _machines(workers, sleepers, spans)
    fleet = _Fleet.of(log, machines, spans, figures, (until - since) / DAY_S)
    notes: list[str] = []
    if log.first_at is not None and log.first_at - since > LATE_START_S:
        notes.append(
            f"the first event read is {_days((log.first_at - since) / DAY_S)} after the "
            "window's start (a shorter event log, or a quiet fleet): figures a day count "
            "the whole window"
        )
    models = sorted(set(fleet.asked) | {m for machine in machines.values() for m in machine.models})
    needs = [
        need
        for model in models
        if (need := _asleep_when_asked(fleet, model) or _cold_loads(fleet, model)) is not None
    ]
    needs.sort(key=lambda n: (-n.avoided_per_day, -_size_of(n.model, machines), n.model))
    proposals: list[Proposal] = []
    taken: dict[str, int] = {}
    moved: dict[str, set[str]] = {}
    said: dict[int, str] = {}
    unplaced: list[tuple[int, _Need, int]] = []
    for index, need in enumerate(needs):
        size = _size_of(need.model, machines)
        if need.rule == "cold_loads" and (made_room := _room_made(fleet, need, size, moved)):
            said[index] = f"{need.model}: {need.why}; pulling {made_room} off makes room for it"
            continue
        found = _target(fleet, need, size, taken) if size else None
        if found is None:
            unplaced.append((index, need, size))
            continue
        machine, speed = found
        taken[machine.worker_id] = taken.get(machine.worker_id, 0) + size
        for source in need.sources:
            moved.setdefault(source, set()).add(need.model)
        pace = f" at about {speed:.0f} tok/s" if speed is not None else ""
        proposals.append(
            Proposal(
                action="pull",
                model=need.model,
                worker=machine.worker_id,
                rule=need.rule,
                reason=f"{need.why}; {machine.worker_id} is always on, has room for it and "
                f"should run it{pace}",
                sources=list(need.sources),
                before=need.before,
                after=Measure(
                    cold_loads_per_day=need.after_cold_loads_per_day,
                    wait_p50_s=_wait_p50_s(fleet.started_on(machine.worker_id)),
                ),
            )
        )
    # A model no target took may yet be helped by a pull placed after it.
    for index, need, size in unplaced:
        made_room = _room_made(fleet, need, size, moved) if need.rule == "cold_loads" else None
        if made_room:
            problem = f"pulling {made_room} off makes room for it"
        else:
            problem = "its size is not known" if not size else "no always-on machine can take it"
        said[index] = f"{need.model}: {need.why}; {problem}"
    notes.extend(note for _, note in sorted(said.items()))
    if fleet.asked:
        proposals.extend(_unused(fleet))
    else:
        notes.append("no request in the window: no model is called unused")
    return Advice(
        since=since,
        until=until,
        days=fleet.days,
        demand=[_demand(fleet, model) for model in sorted(fleet.asked)],
        proposals=proposals,
        notes=notes,
        figures=figures is not None,
    )


def _demand(fleet: _Fleet, model: str) -> Demand:
    days = fleet.days
    runs = fleet.runs.get(model, [])
    cold: dict[str, float] = {}
    for run in runs:
        if run.cold:
            cold[run.worker] = cold.get(run.worker, 0.0) + 1
    asked = fleet.asked.get(model, [])
    return Demand(
        model=model,
        requests_per_day=len(asked) / days,
        tokens_per_day=sum(r.tokens for r in runs) / days,
        wait_p50_s=_wait_p50_s(asked),
        cold_loads_per_day={w: n / days for w, n in sorted(cold.items())},
        holders=[w for w, m in fleet.machines.items() if model in m.models],
    )


def encode(advice: Advice) -> bytes:
    """``advice`` as ``coordinator models advise --json`` prints it."""
    return msgspec.json.encode(advice)


def _count(value: float) -> str:
    """A count a day for people: whole from 10 up, one decimal below (``38``, ``2.5``)."""
    return f"{value:.0f}" if value >= 10 or value == int(value) else f"{value:.1f}"


def _days(days: float) -> str:
    return f"{_count(days)} day" if days == 1 else f"{_count(days)} days"


def _gb(size: int) -> str:
    return f"{size / 1e9:.1f} GB"
