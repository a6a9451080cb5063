"""Routing policy: which worker gets a task. Pure: no I/O, no clock, no randomness.

Lesson 1 of the design: the tier is not a property of the model name. It is decided here, from
who is live: a model listed in ``GPU_MODELS`` (every model, when the list is empty) goes to a
GPU worker when a live GPU worker has it, unless the best GPU worker would cost it more than
``GPU_PREFERENCE`` times what the best CPU worker would; else to a CPU worker that has it;
else the request is refused with an error that names the model and why.

It is given the live workers (`services.fleet.liveness.live`); the router applies it to route,
the reaper to re-route a dead worker's task, with the same answer for the same state. A worker
whose own probe says its backend is degraded (`services.fleet.health.routable`) gets nothing:
it is no candidate, and a request that names it is refused with the reason (lesson 13).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field

from schemas.models import DEFAULT_CAPABILITIES, can_serve, does_not_support, lacks
from schemas.subjects import SHARED_CPU, WEB, Tier, worker_queue
from schemas.workers import INFERENCE_CAPABILITIES, WorkerRecord
from services.errors import NoWorker, UnsupportedCapability, WorkerUnavailable
from services.fleet.health import degraded_reason, routable
from services.fleet.memory import HeldModels

# Typical duration (ms) assumed when no worker has figures for the model yet: among workers
# that all lack figures, any positive constant gives "least loaded first".
PRIOR_TYPICAL_MS = 1_000.0

# Cold-load time (ms) assumed for a model no worker has loaded yet: what a 7-8B model takes to
# be read into memory from a local disk.
PRIOR_COLD_LOAD_MS = 5_000.0

# A failure rate is capped so that a worker with a bad spell is avoided, not banished: at the
# cap its expected time is ten times its typical one.
MAX_FAILURE_RATE = 0.9

# How much more than the best CPU worker the best GPU worker may cost a GPU-preferred task and
# still get it (``GPU_PREFERENCE``): a GPU frees the CPU boxes for what only they can run.
DEFAULT_GPU_PREFERENCE = 2.0

# What a model pushed out of memory by a load costs, in cold loads of it: the next task of
# it there loads it again, which delays that task and every task queued behind it then.
# benchmarks/fleet_sim measured 2, 4 and 8 (benchmarks/README.md).
EVICTION_WEIGHT = 4.0


@dataclass(frozen=True, slots=True)
class Decision:
    worker_id: str
    tier: Tier | None
    queue: str
    reason: str


@dataclass(frozen=True, slots=True)
class Estimates:
    """What is known of each worker for one task (by worker id; a worker left out gets the
    priors): the inputs of `outlook`.

    Made from the stats service's figures for the task's model and domain
    (`services.fleet.figures.Figures.estimates`).
    """

    queued_ms: Mapping[str, Sequence[float]] = field(default_factory=dict)
    """The typical duration of each task queued or running on the worker: the work ahead."""
    queued_loads: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    """The models of those tasks (where known), each with its cold-load time there
    (`PRIOR_COLD_LOAD_MS` where no figure says)."""
    typical_ms: Mapping[str, float] = field(default_factory=dict)
    """The task's typical duration there, model loads as they happened included (p50)."""
    warm_ms: Mapping[str, float] = field(default_factory=dict)
    """The same without the model's load time (p50); `typical_ms` where absent."""
    cold_load_ms: Mapping[str, float] = field(default_factory=dict)
    """What loading the model costs there (`PRIOR_COLD_LOAD_MS` where absent)."""
    cold_load_of: Callable[[str, str], float] = lambda model, worker_id: PRIOR_COLD_LOAD_MS
    """What loading a model costs on a worker, by (model, worker id): what a load that pushes
    it out of memory costs when it is asked for again (made when asked: that is rare)."""
    failure_rate: Mapping[str, float] = field(default_factory=dict)
    """The worker's recent failure rate for the model and domain (0 where absent)."""


def tier_of(record: WorkerRecord) -> Tier:
    """A worker that can run on a GPU is a GPU worker; its CPU is the fallback elsewhere."""
    return "gpu" if "gpu_inference" in record.supports else "cpu"


def tier_label(record: WorkerRecord) -> str:
    """What ``coordinator workers`` shows: gpu, cpu, or web for a web-search-only worker."""
    return tier_of(record) if INFERENCE_CAPABILITIES.intersection(record.supports) else "web"


@dataclass(frozen=True, slots=True)
class Outlook:
    """What sending one task to a worker would cost (`outlook`)."""

    completion_ms: float
    """When the worker would finish it, in ms from now."""
    eviction_ms: float = 0.0
    """What its cold load would cost the tasks after it: the reloads of the models it
    pushes out of memory."""

    @property
    def cost_ms(self) -> float:
        """What routing compares: completion and eviction."""
        return self.completion_ms + self.eviction_ms


def outlook(
    record: WorkerRecord,
    model: str,
    estimates: Estimates,
    shared_ms: float = 0.0,
    *,
    bound_ms: float = math.inf,
) -> Outlook:
    """What a task of ``model`` sent to the worker now would cost: its expected completion

        (ahead + loads ahead + load + run) / (1 - min(failure rate, 0.9))

    and the eviction its load causes, ``EVICTION_WEIGHT`` × the cold-load times of the
    models that load pushes out of memory (the next task of each there loads it again):

    - ahead: the sum of the typical durations of the tasks queued or running on it; for a
      CPU worker, plus its share of those on the shared CPU queue (``shared_ms``: their sum
      over the CPU workers that pull it), which it runs too, between its own;
    - when the worker says which models its backend holds in memory (``resident``, and the
      model of the task it runs now, ``current_model``):
      loads ahead: the cold-load time of each model of the tasks ahead that is not in
      memory when its turn comes (once per model, in name order: its first task loads it);
      run: the model's warm duration there;
      load: its cold-load time, unless it is in memory when its turn comes: a task of it is
      ahead, or it is in memory now and the loads ahead do not push it out;
      what a load pushes out: `services.fleet.memory.HeldModels` (the worker's
      ``memory_bytes`` and ``max_resident``, each model's ``model_memory``; a limit it does
      not know of holds anything);
    - when the worker does not say: no loads, no eviction, and run is its typical duration
      (a p50 that holds the loads as they happened);
    - a task fails with probability p and is then run again elsewhere, so on average it
      costs 1 / (1 - p) runs.

    Absent figures are the priors: `PRIOR_TYPICAL_MS`, `PRIOR_COLD_LOAD_MS`, no failures.
    A completion over ``bound_ms`` (the best cost found so far) leaves the eviction out: the
    cost is over the bound whatever it is.
    """
    return Outlook(*_costs(record, model, estimates, shared_ms, bound_ms))


def _costs(
    record: WorkerRecord, model: str, estimates: Estimates, shared_ms: float, bound_ms: float
) -> tuple[float, float]:
    """`outlook`'s completion and eviction, without the object (one per candidate)."""
    worker_id = record.worker_id
    typical = estimates.typical_ms.get(worker_id, PRIOR_TYPICAL_MS)
    ahead = sum(estimates.queued_ms.get(worker_id, ()))
    resident = record.resident
    held: HeldModels | None = None
    loads = False
    if resident is None:
        run = typical
    else:
        run = estimates.warm_ms.get(worker_id, typical)
        running = record.current_model
        queued = estimates.queued_loads.get(worker_id)
        loads = model != running and model not in resident
        if queued:
            for queued_model in queued:
                if queued_model != running and queued_model not in resident:
                    held = _play(record, resident, queued)
                    ahead += held.loaded_ms
                    loads = not held.holds(model)
                    break
        if loads:
            run += estimates.cold_load_ms.get(worker_id, PRIOR_COLD_LOAD_MS)
    if tier_of(record) == "cpu":
        ahead += shared_ms
    failure_rate = estimates.failure_rate.get(worker_id, 0.0)
    completion = (ahead + run) / (1.0 - min(max(failure_rate, 0.0), MAX_FAILURE_RATE))
    if not loads or completion > bound_ms or not (record.memory_bytes or record.max_resident):
        return completion, 0.0
    if held is None:
        held = _play(record, resident or (), estimates.queued_loads.get(worker_id) or {})
    reloads = 0.0
    for gone in held.load(model):
        reloads += estimates.cold_load_of(gone, worker_id)
    return completion, EVICTION_WEIGHT * reloads


def _play(record: WorkerRecord, resident: Sequence[str], queued: Mapping[str, float]) -> HeldModels:
    """The worker's memory once the tasks ahead ran, each model of theirs used once (sorted
    by name: the same answer whatever the order they came in), with what their loads cost."""
    held = HeldModels(record, resident)
    for queued_model in sorted(queued):
        held.use(queued_model, queued[queued_model])
    return held


def choose(
    model: str,
    workers: Collection[WorkerRecord],
    *,
    designated: str | None = None,
    gpu_models: Collection[str] = (),
    gpu_preference: float = DEFAULT_GPU_PREFERENCE,
    estimates: Estimates | None = None,
    needs: Sequence[str] = DEFAULT_CAPABILITIES,
) -> Decision:
    """Pick the worker for one task among live ``workers``, or raise `NoWorker`.

    Only workers whose copy of the model has every capability in ``needs`` are candidates;
    when the model is served but no copy has them, `UnsupportedCapability` names what lacks.

    Each candidate's cost (`outlook`: its expected completion and the eviction its load
    causes) comes from ``estimates``. A model that prefers a GPU (in ``gpu_models``, or every
    model when that is empty) goes to the GPU candidate that costs least, unless that is
    more than ``gpu_preference`` times the cost of the CPU candidate that costs least, which
    then gets it; with no GPU candidate, to a CPU one. Any other model goes to the candidate
    of either tier that costs least. Ties go to the smallest worker id, so the same state
    always gives the same answer. When the pick is a CPU worker, every CPU candidate is busy
    and every live CPU worker serves the model, the task goes to the shared CPU queue
    instead, where whichever worker frees up first takes it.
    """
    known = estimates or Estimates()
    if designated is not None:
        return _designated(model, workers, designated, needs)

    having = [w for w in _inference(workers) if model in w.models and routable(w)]
    if not having:
        raise NoWorker(_why_nobody(model, workers))
    serving = [w for w in having if not lacks(w, model, needs)]
    if not serving:
        # The copy that lacks least is named: what no live copy can do.
        fewest = min((lacks(w, model, needs) for w in having), key=len)
        raise UnsupportedCapability(does_not_support(model, fewest))

    # The shared CPU queue's tasks, each CPU worker's share (it pulls them between its own).
    pulling = _pulling_shared(workers)
    shared_ms = sum(known.queued_ms.get(SHARED_CPU.name, ())) / max(pulling, 1)

    def best(pool: Sequence[WorkerRecord]) -> tuple[float, WorkerRecord]:
        found_ms, found = math.inf, pool[0]
        for w in pool:
            completion, eviction = _costs(w, model, known, shared_ms, found_ms)
            ms = completion + eviction
            if ms < found_ms or (ms == found_ms and w.worker_id < found.worker_id):
                found_ms, found = ms, w
        return found_ms, found

    prefer_gpu = not gpu_models or model in gpu_models
    gpu: list[WorkerRecord] = []
    cpu: list[WorkerRecord] = []
    for w in serving:
        (gpu if tier_of(w) == "gpu" else cpu).append(w)
    if prefer_gpu and gpu:
        gpu_ms, pick = best(gpu)
        why = "gpu worker live with the model"
        if cpu:
            cpu_ms, cpu_best = best(cpu)
            if gpu_ms > gpu_preference * cpu_ms:
                pick = cpu_best
                why = (
                    f"gpu workers busy: the best would cost {gpu_ms:.0f} ms, over "
                    f"{gpu_preference:g}x the best cpu worker's {cpu_ms:.0f} ms"
                )
    elif prefer_gpu:
        pick, why = best(serving)[1], "no live gpu worker has the model; cpu fallback"
    else:
        pick, why = best(serving)[1], "least expected cost"

    tier = tier_of(pick)
    if tier == "cpu" and _shared_fits(cpu, pulling, known):
        return Decision(SHARED_CPU.name, "cpu", SHARED_CPU.queue, "every cpu worker busy; shared")
    return Decision(pick.worker_id, tier, worker_queue(tier, pick.worker_id), why)


def _pulling_shared(workers: Collection[WorkerRecord]) -> int:
    """How many live workers pull the shared CPU queue: the CPU workers (a degraded worker
    pulls no queue, the shared one included)."""
    return sum(1 for w in _inference(workers) if tier_of(w) == "cpu" and routable(w))


def _shared_fits(cpu: Collection[WorkerRecord], pulling: int, estimates: Estimates) -> bool:
    """The shared queue helps only when more than one CPU worker could take the task (the
    ``cpu`` candidates), all of them are busy, and every CPU worker that pulls the shared
    queue (``pulling`` of them) serves the model with what the task needs: is one of them."""
    return (
        len(cpu) > 1
        and all(estimates.queued_ms.get(w.worker_id) for w in cpu)
        and pulling == len(cpu)
    )


def choose_web(workers: Collection[WorkerRecord]) -> Decision:
    """Web-search tasks go to the shared ``tasks.web`` queue while a web-search worker is live."""
    if not any("web_search" in w.supports for w in workers):
        raise NoWorker("no live web-search worker: start one with `coordinator web-search`")
    return Decision(WEB.name, None, WEB.queue, "shared web-search queue")


def _inference(workers: Collection[WorkerRecord]) -> list[WorkerRecord]:
    return [w for w in workers if not INFERENCE_CAPABILITIES.isdisjoint(w.supports)]


def _designated(
    model: str, workers: Collection[WorkerRecord], worker_id: str, needs: Sequence[str]
) -> Decision:
    record = next((w for w in _inference(workers) if w.worker_id == worker_id), None)
    if record is None:
        raise WorkerUnavailable(f"worker '{worker_id}' is not live (no fresh registration)")
    if model not in record.models:
        served = ", ".join(sorted(record.models)) or "none"
        raise WorkerUnavailable(
            f"worker '{worker_id}' does not serve model '{model}' (it serves: {served})"
        )
    lacking = lacks(record, model, needs)
    if lacking:
        raise WorkerUnavailable(
            f"worker '{worker_id}': {does_not_support(model, lacking)} on this worker"
        )
    if not routable(record):
        raise WorkerUnavailable(degraded_reason(record))
    tier = tier_of(record)
    return Decision(worker_id, tier, worker_queue(tier, worker_id), "designated worker")


def _why_nobody(model: str, workers: Collection[WorkerRecord]) -> str:
    workers = _inference(workers)
    if not workers:
        return f"no live worker serves model '{model}': no worker is registered and alive"
    degraded = [w for w in workers if model in w.models and not routable(w)]
    if degraded:
        return f"no healthy worker serves model '{model}': " + "; ".join(
            degraded_reason(w) for w in sorted(degraded, key=lambda w: w.worker_id)
        )
    served = sorted({m for w in workers for m in w.models if routable(w)})
    return (
        f"no live worker serves model '{model}' "
        f"(live workers: {len(workers)}; models they serve: {', '.join(served) or 'none'})"
    )


def choose_sleeper(
    model: str,
    sleepers: Collection[WorkerRecord],
    *,
    designated: str | None = None,
    needs: Sequence[str] = DEFAULT_CAPABILITIES,
) -> WorkerRecord | None:
    """A sleeping worker that serves ``model`` with ``needs`` and can be woken (it left a
    MAC), or None.

    Asked only when no live worker can take the task; the smallest id wins, for determinism.
    """
    able = [
        s
        for s in sleepers
        if can_serve(s, model, needs)
        and s.wol_mac
        and (designated is None or s.worker_id == designated)
        and INFERENCE_CAPABILITIES.intersection(s.supports)
    ]
    return min(able, key=lambda s: s.worker_id) if able else None


def decision_for(record: WorkerRecord, reason: str) -> Decision:
    """Route to ``record``'s own queue for its tier."""
    tier = tier_of(record)
    return Decision(record.worker_id, tier, worker_queue(tier, record.worker_id), reason)
