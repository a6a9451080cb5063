"""Cost per task: CPU milliseconds per task across all service processes.

    .venv/bin/python -m benchmarks.cost [--tasks 3000] [--clients 8] [--workers 4] [--runs 3]

Brings up the stack as separate processes (`benchmarks.stack`), sends ``--tasks`` route
requests with ``wait`` from ``--clients`` concurrent clients, waits until the stats service
has projected every event, and divides the CPU time (user + system, from
``/proc/<pid>/stat``) each process spent over that window by the tasks done. "All services"
is the router, every worker and the stats service; nats-server, the PostgreSQL backends
serving the stats service, the Ollama stand-in and the benchmark's own client are reported
apart. The window includes whatever the services do besides tasks (heartbeats, polls): the
idle rate, measured before the run, is reported too.

Results: a table, and ``benchmarks/results/cost-<time>.json``.

Target: ≤ 2 ms of CPU per task across all services on the project's 2-core machines.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any, Final

from benchmarks.stack import (
    CpuSample,
    Stack,
    Standin,
    closed_loop,
    load_average,
    median,
    table,
    write_result,
)

TARGET_SERVICES_MS: Final = 2.0
SERVICE_ROLES: Final = ("router", "workers", "stats")
OTHER_ROLES: Final = ("nats-server", "postgres", "standin", "client")
IDLE_S: Final = 5.0
WARMUP_TASKS: Final = 300


def by_role(after: CpuSample, before: CpuSample) -> dict[str, float]:
    """CPU seconds per role between two samples."""
    roles: dict[str, float] = {}
    for name, seconds in after.minus(before).items():
        roles[after.roles[name]] = roles.get(after.roles[name], 0.0) + seconds
    return roles


async def run_once(stack: Stack, *, tasks: int, clients: int) -> dict[str, Any]:
    assert stack.nc is not None
    await closed_loop(stack.nc, clients=clients, duration_s=60.0, max_requests=WARMUP_TASKS)
    await stack.stats_caught_up()
    idle_before = await stack.cpu()
    await asyncio.sleep(IDLE_S)
    idle_after = await stack.cpu()
    idle = by_role(idle_after, idle_before)
    idle_s = idle_after.at - idle_before.at

    load_before = load_average()
    before = await stack.cpu()
    samples, took = await closed_loop(
        stack.nc, clients=clients, duration_s=600.0, max_requests=tasks
    )
    lag_s = await stack.stats_caught_up()
    after = await stack.cpu()
    done = sum(1 for s in samples if s.ok)
    spent = by_role(after, before)
    per_task = {role: spent.get(role, 0.0) * 1000 / max(done, 1) for role in spent}
    services = sum(per_task.get(role, 0.0) for role in SERVICE_ROLES)
    return {
        "tasks": done,
        "failed": len(samples) - done,
        "seconds": round(took, 2),
        "stats_lag_s": round(lag_s, 2),
        "cpu_ms_per_task": {role: round(v, 3) for role, v in sorted(per_task.items())},
        "services_ms_per_task": round(services, 3),
        "idle_cpu_ms_per_s": {role: round(v * 1000 / idle_s, 2) for role, v in idle.items()},
        "load_average": [load_before, load_average()],
    }


async def measure(
    *, tasks: int, clients: int, workers: int, runs: int, supports: str, standin: Standin
) -> dict[str, Any]:
    results: list[dict[str, Any]] = []
    async with Stack(workers, standin=standin, supports=supports) as stack:
        for run in range(runs):
            result = await run_once(stack, tasks=tasks, clients=clients)
            results.append({"run": run + 1, **result})
            print(
                f"run {run + 1}: {result['services_ms_per_task']} ms of service CPU per task "
                f"(load {result['load_average'][0][0]})",
                file=sys.stderr,
            )
    roles = sorted({role for r in results for role in r["cpu_ms_per_task"]})
    summary = {
        role: round(median([r["cpu_ms_per_task"].get(role, 0.0) for r in results]), 3)
        for role in roles
    }
    services = median([r["services_ms_per_task"] for r in results])
    return {
        "setup": {
            "tasks_per_run": tasks,
            "clients": clients,
            "workers": workers,
            "runs": runs,
            "supports": supports,
            "standin": standin,
        },
        "runs": results,
        "median_of_runs": {"services_ms_per_task": services, "cpu_ms_per_task": summary},
        "target_services_ms_per_task": TARGET_SERVICES_MS,
        "met": services <= TARGET_SERVICES_MS,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cost", description=__doc__)
    parser.add_argument("--tasks", type=int, default=3000, help="per run")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--supports", default="cpu_inference", help="WORKER_SUPPORTS")
    parser.add_argument("--standin", choices=("instant", "fake"), default="instant")
    args = parser.parse_args(argv)
    figure = asyncio.run(
        measure(
            tasks=args.tasks,
            clients=args.clients,
            workers=args.workers,
            runs=args.runs,
            supports=args.supports,
            standin=args.standin,
        )
    )
    path = write_result("cost", figure)
    roles = [*SERVICE_ROLES, *OTHER_ROLES]
    rows: list[list[Any]] = []
    for r in figure["runs"]:
        cpu = r["cpu_ms_per_task"]
        cells = [cpu.get(x, 0.0) for x in roles]
        rows.append([f"run {r['run']}", r["services_ms_per_task"], *cells, r["load_average"][0][0]])
    m = figure["median_of_runs"]
    cells = [m["cpu_ms_per_task"].get(x, 0.0) for x in roles]
    rows.append(["median", m["services_ms_per_task"], *cells, ""])
    print("CPU ms per task")
    print(table(["", "services", *roles, "load"], rows))
    print(
        f"services = router + workers + stats; target ≤ {TARGET_SERVICES_MS:g} ms "
        f"({'met' if figure['met'] else 'NOT met'}); {path}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
