"""Routing policy: which worker gets a task. Pure: no I/O, no clock, no randomness.

Lesson 1 of the design: the tier is not a property of the model name. It is decided here, from
who is live: a model listed in ``GPU_MODELS`` (every model, when the list is empty) goes to a
GPU worker when a live GPU worker has it, else to a CPU worker that has it, else the request is
refused with an error that names the model and why.

It is given the live workers (`services.fleet.liveness.live`); the router applies it to route,
the reaper to re-route a dead worker's task, with the same answer for the same state. A worker
whose own probe says its backend is degraded (`services.fleet.health.routable`) gets nothing:
it is no candidate, and a request that names it is refused with the reason (lesson 13).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from schemas.models import DEFAULT_CAPABILITIES, does_not_support, missing
from schemas.subjects import SHARED_CPU_QUEUE, WEB_POOL, WEB_QUEUE, Tier, worker_queue
from schemas.workers import INFERENCE_CAPABILITIES, WorkerRecord
from services.fleet.health import degraded_reason, routable
from services.runtime.errors import NoWorker, UnsupportedCapability, WorkerUnavailable

# The worker name a task on the shared CPU queue is routed to.
SHARED_WORKER = "shared"


# Typical duration (ms) assumed when no worker has figures for the model yet; only the ratio
# between candidates matters, so any positive constant gives "least loaded first".
PRIOR_TYPICAL_MS = 1_000.0

# A failure rate is capped so that a worker with a bad spell is avoided, not banished: at the
# cap its expected time is ten times its typical one.
MAX_FAILURE_RATE = 0.9


@dataclass(frozen=True, slots=True)
class Decision:
    worker_id: str
    tier: Tier | None
    queue: str
    reason: str


def tier_of(record: WorkerRecord) -> Tier:
    """A worker that can run on a GPU is a GPU worker; its CPU is the fallback elsewhere."""
    return "gpu" if "gpu_inference" in record.supports else "cpu"


def tier_label(record: WorkerRecord) -> str:
    """What ``coordinator workers`` shows: gpu, cpu, or web for a web-search-only worker."""
    return tier_of(record) if INFERENCE_CAPABILITIES.intersection(record.supports) else "web"


def lacks(record: WorkerRecord, model: str, needs: Sequence[str]) -> list[str]:
    """What ``record``'s copy of ``model`` lacks of ``needs`` (lesson 12: a request goes only
    to a copy that can do all of it, never to one that would drop the tools or images)."""
    return missing(needs, record.facts_of(model).capabilities)


def can_serve(record: WorkerRecord, model: str, needs: Sequence[str]) -> bool:
    """Does ``record`` serve ``model`` with every capability in ``needs``?"""
    return model in record.models and not lacks(record, model, needs)


def expected_completion_ms(
    depth: int, typical_ms: float = PRIOR_TYPICAL_MS, failure_rate: float = 0.0
) -> float:
    """(tasks queued or running on the worker + 1) × its typical duration, penalised by its
    recent failure rate: a task fails with probability p and is then run again elsewhere, so
    on average it costs 1 / (1 - p) runs."""
    return (depth + 1) * typical_ms / (1.0 - min(max(failure_rate, 0.0), MAX_FAILURE_RATE))


def choose(
    model: str,
    workers: Collection[WorkerRecord],
    *,
    designated: str | None = None,
    gpu_models: Collection[str] = (),
    depth: Mapping[str, int] | None = None,
    typical_ms: Mapping[str, float] | None = None,
    failure_rate: Mapping[str, float] | None = None,
    needs: Sequence[str] = DEFAULT_CAPABILITIES,
) -> Decision:
    """Pick the worker for one task among live ``workers``, or raise `NoWorker`.

    Only workers whose copy of the model has every capability in ``needs`` are candidates;
    when the model is served but no copy has them, `UnsupportedCapability` names what lacks.

    ``depth`` is the number of tasks queued or running per worker id; ``typical_ms`` and
    ``failure_rate`` are each worker's figures for this model and domain (`PRIOR_TYPICAL_MS`
    and 0 where absent). Among the candidates the least expected completion time wins; ties
    go to the smallest worker id, so the same state always gives the same answer. When every
    CPU candidate is busy and every live CPU worker serves the model, the task goes to the
    shared CPU queue instead, where whichever worker frees up first takes it.
    """
    depths = depth or {}
    typical = typical_ms or {}
    failures = failure_rate or {}
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

    prefer_gpu = not gpu_models or model in gpu_models
    gpu = [w for w in serving if tier_of(w) == "gpu"]
    if prefer_gpu and gpu:
        pool, why = gpu, "gpu worker live with the model"
    elif prefer_gpu:
        pool, why = serving, "no live gpu worker has the model; cpu fallback"
    else:
        pool, why = serving, "least expected completion time"

    def expected(w: WorkerRecord) -> float:
        return expected_completion_ms(
            depths.get(w.worker_id, 0),
            typical.get(w.worker_id, PRIOR_TYPICAL_MS),
            failures.get(w.worker_id, 0.0),
        )

    best = min(pool, key=lambda w: (expected(w), w.worker_id))
    tier = tier_of(best)
    if tier == "cpu" and _shared_fits(model, pool, workers, depths, needs):
        return Decision(SHARED_WORKER, "cpu", SHARED_CPU_QUEUE, "every cpu worker busy; shared")
    return Decision(best.worker_id, tier, worker_queue(tier, best.worker_id), why)


def _shared_fits(
    model: str,
    pool: Collection[WorkerRecord],
    workers: Collection[WorkerRecord],
    depths: Mapping[str, int],
    needs: Sequence[str],
) -> bool:
    """The shared queue helps only when more than one CPU worker could take the task, all of
    them are busy, and every CPU worker that pulls the shared queue serves the model with
    what the task needs."""
    cpu_pool = [w for w in pool if tier_of(w) == "cpu"]
    # A degraded worker pulls no queue, the shared one included.
    cpu_all = [w for w in _inference(workers) if tier_of(w) == "cpu" and routable(w)]
    return (
        len(cpu_pool) > 1
        and all(depths.get(w.worker_id, 0) > 0 for w in cpu_pool)
        and all(can_serve(w, model, needs) for w in cpu_all)
    )


def choose_web(workers: Collection[WorkerRecord]) -> Decision:
    """Web-search tasks go to the shared ``tasks.web`` queue while a web-search worker is live."""
    if not any("web_search" in w.supports for w in workers):
        raise NoWorker("no live web-search worker: start one with `coordinator web-search`")
    return Decision(WEB_POOL, None, WEB_QUEUE, "shared web-search queue")


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
