"""Routing decision time against the number of registered workers (pure, in-process).

    .venv/bin/python -m benchmarks.routing [--sizes 10,50,200,500,1000]

Times what the router does for each request between parsing it and publishing (the
sequence of `services.router.service.Router.handle_route`): forget stale in-flight tasks,
keep the live workers, and `services.router.decide.decide`: list the candidates, make each
one's estimates from the fleet view (the work queued on it, its typical and warm durations,
cold-load time and failure rate: `Figures.estimates`), and `policy.choose`. The fleet is
synthetic and on the heavy side of real: every worker serves the requested model and two of
nine others; one in four is a GPU worker; each has figures for its three models in three of
the four domains (for half of them the request's domain is the one missing, which sends
the lookups to their fallbacks), says which two of its models are in memory, what each takes
and how much memory its backend holds (too little for the third: loading the requested model
where it is not in memory pushes one out), and has one task of another model in flight.

Prints the median time per decision for each size, with the parts it is made of, and the
largest number of workers whose decision stays within 1 ms (found by doubling, then
bisection). `benchmarks.scaling` runs this as its second half and writes the JSON.

Target: a decision ≤ 1 ms with 200 registered workers on the project's 2-core machines.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import Any, Final

import msgspec

from schemas.route import RouteRequest
from schemas.workers import Capability, WorkerRecord
from services.fleet import liveness, policy
from services.fleet.figures import Figure
from services.router import decide as router_decide
from services.router.view import FleetView

TARGET_MS: Final = 1.0
TARGET_WORKERS: Final = 200
MODEL: Final = "qwen2.5:7b"
DOMAIN: Final = "code"
DOMAINS: Final = ("general", "code", "math", "japanese")
OTHER_MODELS: Final = tuple(f"model-{i}:1b" for i in range(9))
NOW: Final = 1_750_000_000.0
TTL_S: Final = 15.0
MAX_AGE_S: Final = 330.0
SAMPLE_S: Final = 0.3


def worker_record(
    worker_id: str,
    models: list[str],
    *,
    gpu: bool,
    heartbeat_at: float,
    resident: list[str] | None = None,
) -> WorkerRecord:
    """A registered worker as a benchmark's synthetic fleet needs one."""
    supports: list[Capability] = ["gpu_inference"] if gpu else ["cpu_inference"]
    return WorkerRecord(
        worker_id=worker_id,
        host=f"host-{worker_id}",
        instance_id=f"i-{worker_id}",
        pid=1000,
        version="0.1.0",
        supports=supports,
        models=models,
        started_at=heartbeat_at - 3600,
        heartbeat_at=heartbeat_at,
        state="idle",
        resident=resident,
    )


def fleet(size: int) -> FleetView:
    """A view of ``size`` live workers with figures and one task in flight each."""
    view = FleetView()
    for i in range(size):
        worker_id = f"worker-{i:05d}"
        models = [MODEL, OTHER_MODELS[i % 9], OTHER_MODELS[(i + 4) % 9]]
        # Half of them hold the requested model in memory; none can hold all three.
        resident = models[:2] if i % 2 else models[1:]
        record = worker_record(
            worker_id, models, gpu=i % 4 == 0, heartbeat_at=NOW - (i % 5), resident=resident
        )
        view.put_worker(
            msgspec.structs.replace(
                record,
                model_memory={MODEL: 5_000_000_000} | dict.fromkeys(models[1:], 1_000_000_000),
                memory_bytes=6_500_000_000,
                max_resident=3,
            )
        )
        missing = DOMAIN if i % 2 else DOMAINS[i % 4 if i % 4 != 1 else 0]
        for model in models:
            for domain in DOMAINS:
                if domain != missing:
                    typical = 500.0 + (i * 37) % 900
                    figure = Figure(
                        typical_ms=typical,
                        recent_failure_rate=0.01,
                        warm_ms=typical - 40.0,
                        cold_load_ms=3_000.0 + (i * 53) % 4_000,
                    )
                    view.figures.put(model, domain, worker_id, figure)
        view.routed(f"task-{i}", worker_id, NOW - 10, models[1], DOMAINS[i % 4])
    return view


REQUEST: Final = RouteRequest(prompt="def fib(n):", model=MODEL, domain=DOMAIN)


def parts(view: FleetView) -> dict[str, Callable[[], Any]]:
    """Each step of one decision, as the router runs them (the later ones on fixed inputs)."""
    live = liveness.live(view.workers.values(), NOW, TTL_S)
    candidates = [w.worker_id for w in live if MODEL in w.models]
    estimates = view.figures.estimates(MODEL, DOMAIN, candidates, view.queued())
    return {
        "expire": lambda: view.expire(NOW, MAX_AGE_S),
        "live": lambda: liveness.live(view.workers.values(), NOW, TTL_S),
        "candidates": lambda: [w.worker_id for w in live if MODEL in w.models],
        "estimates": lambda: view.figures.estimates(MODEL, DOMAIN, candidates, view.queued()),
        "choose": lambda: policy.choose(MODEL, live, estimates=estimates),
    }


def decide(view: FleetView) -> policy.Decision:
    """One whole decision, as `Router.handle_route` makes it."""
    view.expire(NOW, MAX_AGE_S)
    live = liveness.live(view.workers.values(), NOW, TTL_S)
    return router_decide.decide(REQUEST, live, (), view, gpu_models=()).decision


def time_ms(fn: Callable[[], Any], budget_s: float = SAMPLE_S) -> float:
    """Median milliseconds per call of ``fn``, over batches filling about ``budget_s``."""
    fn()
    started = time.perf_counter()
    fn()
    once = max(time.perf_counter() - started, 1e-7)
    per_batch = max(1, int(budget_s / 9 / once))
    batches: list[float] = []
    for _ in range(9):
        started = time.perf_counter()
        for _ in range(per_batch):
            fn()
        batches.append((time.perf_counter() - started) / per_batch * 1000)
    return statistics.median(batches)


def decision_ms(size: int) -> float:
    view = fleet(size)
    return time_ms(lambda: decide(view))


def limit(target_ms: float = TARGET_MS, ceiling: int = 200_000) -> int:
    """The largest fleet whose decision takes at most ``target_ms`` (doubling, then bisection
    to within 2 %)."""
    low, high = 0, 10
    while decision_ms(high) <= target_ms:
        low, high = high, high * 2
        if high > ceiling:
            return ceiling
    while high - low > max(1, low // 50):
        middle = (low + high) // 2
        if decision_ms(middle) <= target_ms:
            low = middle
        else:
            high = middle
    return low


def measure(sizes: list[int]) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    for size in sizes:
        view = fleet(size)
        rows.append(
            {
                "workers": size,
                "decision_ms": round(time_ms(partial(decide, view)), 4),
                "parts_ms": {
                    name: round(time_ms(fn, SAMPLE_S / 3), 4) for name, fn in parts(view).items()
                },
            }
        )
    within = limit()
    at_target = next(
        (float(r["decision_ms"]) for r in rows if r["workers"] == TARGET_WORKERS),
        None,
    )
    if at_target is None:
        at_target = decision_ms(TARGET_WORKERS)
    return {
        "sizes": rows,
        "workers_within_1ms": within,
        "target": {"workers": TARGET_WORKERS, "decision_ms": TARGET_MS},
        "met": at_target <= TARGET_MS,
    }


def print_table(figure: dict[str, Any]) -> None:
    from benchmarks.stack import table

    names = list(figure["sizes"][0]["parts_ms"])
    rows = [
        [r["workers"], r["decision_ms"], *(r["parts_ms"][n] for n in names)]
        for r in figure["sizes"]
    ]
    print("routing decision, ms (median)")
    print(table(["workers", "decision", *names], rows))
    print(
        f"a decision stays within {TARGET_MS:g} ms up to {figure['workers_within_1ms']} "
        f"registered workers; target ≤ {TARGET_MS:g} ms at {TARGET_WORKERS} "
        f"({'met' if figure['met'] else 'NOT met'})"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.routing", description=__doc__)
    parser.add_argument("--sizes", default="10,50,200,500,1000")
    args = parser.parse_args(argv)
    print_table(measure([int(s) for s in args.sizes.split(",")]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
