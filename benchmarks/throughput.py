"""Throughput: tasks completed per second end to end, with enough clients to saturate.

    .venv/bin/python -m benchmarks.throughput [--workers 4] [--clients 64] [--duration 10]
                                              [--runs 3] [--supports cpu_inference]

Brings up the stack as separate processes (`benchmarks.stack`: nats-server, the instant
Ollama stand-in, stats with a scratch PostgreSQL database, router, ``--workers`` workers),
then ``--clients`` concurrent clients each send route requests with ``wait`` one after the
other for ``--duration`` seconds (at most ``--max-requests``). A task counts when its reply
says ``done``; the rate is those over the run's wall time, and p50/p99 are their latencies
(request sent to reply received) at that load. Each run is preceded by a warm-up and followed
by a wait for the stats projection to catch up (its lag is reported, not counted).

The CPU each process spent during the run is reported per task as well (see
`benchmarks.cost` for that figure on its own). Results: a table, and
``benchmarks/results/throughput-<time>.json``.

Target: at least 500 tasks/s with 4 workers on the project's 2-core machines.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any, Final

from benchmarks.stack import (
    Stack,
    Standin,
    closed_loop,
    load_average,
    median,
    percentile,
    table,
    write_result,
)

TARGET_TASKS_PER_S: Final = 500.0
WARMUP_S: Final = 2.0


async def run_load(
    stack: Stack, *, clients: int, duration_s: float, max_requests: int
) -> dict[str, Any]:
    """One measured run on a running stack: rate, latency and CPU per task per role."""
    assert stack.nc is not None
    await closed_loop(stack.nc, clients=clients, duration_s=WARMUP_S, max_requests=max_requests)
    await stack.stats_caught_up()
    load_before = load_average()
    cpu_before = await stack.cpu()
    samples, took = await closed_loop(
        stack.nc, clients=clients, duration_s=duration_s, max_requests=max_requests
    )
    cpu_during = await stack.cpu()
    lag_s = await stack.stats_caught_up()
    cpu_after = await stack.cpu()
    done = [s.total_ms for s in samples if s.ok]
    spent = cpu_after.minus(cpu_before)
    spent_during = cpu_during.minus(cpu_before)
    per_role: dict[str, float] = {}
    for name, seconds in spent.items():
        role = cpu_after.roles[name]
        # The client's CPU is counted for the run itself, not for the wait on stats.
        counted = spent_during[name] if role == "client" else seconds
        per_role[role] = per_role.get(role, 0.0) + counted
    tasks = max(len(done), 1)
    return {
        "clients": clients,
        "sent": len(samples),
        "done": len(done),
        "failed": len(samples) - len(done),
        "seconds": round(took, 2),
        "tasks_per_s": round(len(done) / took, 1),
        "latency_ms": {
            "p50": round(percentile(done, 50), 2),
            "p99": round(percentile(done, 99), 2),
        },
        "stats_lag_s": round(lag_s, 2),
        "cpu_ms_per_task": {role: round(s * 1000 / tasks, 3) for role, s in per_role.items()},
        "load_average": [load_before, load_average()],
    }


async def measure(
    *,
    workers: int,
    clients: int,
    duration_s: float,
    max_requests: int,
    runs: int,
    supports: str,
    standin: Standin,
) -> dict[str, Any]:
    results: list[dict[str, Any]] = []
    async with Stack(workers, standin=standin, supports=supports) as stack:
        for run in range(runs):
            result = await run_load(
                stack, clients=clients, duration_s=duration_s, max_requests=max_requests
            )
            results.append({"run": run + 1, **result})
            print(
                f"run {run + 1}: {result['tasks_per_s']} tasks/s, "
                f"p50 {result['latency_ms']['p50']} ms, p99 {result['latency_ms']['p99']} ms "
                f"(load {result['load_average'][0][0]})",
                file=sys.stderr,
            )
    rate = median([r["tasks_per_s"] for r in results])
    return {
        "setup": {
            "workers": workers,
            "clients": clients,
            "duration_s": duration_s,
            "runs": runs,
            "supports": supports,
            "standin": standin,
        },
        "runs": results,
        "median_of_runs": {
            "tasks_per_s": rate,
            "latency_ms": {
                q: median([r["latency_ms"][q] for r in results]) for q in ("p50", "p99")
            },
        },
        "target_tasks_per_s": TARGET_TASKS_PER_S,
        "met": rate >= TARGET_TASKS_PER_S,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.throughput", description=__doc__)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per run")
    parser.add_argument("--max-requests", type=int, default=50_000, help="per run")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument(
        "--supports", default="cpu_inference", help="WORKER_SUPPORTS of every worker"
    )
    parser.add_argument("--standin", choices=("instant", "fake"), default="instant")
    args = parser.parse_args(argv)
    figure = asyncio.run(
        measure(
            workers=args.workers,
            clients=args.clients,
            duration_s=args.duration,
            max_requests=args.max_requests,
            runs=args.runs,
            supports=args.supports,
            standin=args.standin,
        )
    )
    path = write_result("throughput", figure)
    rows = [
        [
            f"run {r['run']}",
            r["tasks_per_s"],
            r["latency_ms"]["p50"],
            r["latency_ms"]["p99"],
            r["failed"],
            r["stats_lag_s"],
            r["load_average"][0][0],
        ]
        for r in figure["runs"]
    ]
    m = figure["median_of_runs"]
    rows.append(["median", m["tasks_per_s"], m["latency_ms"]["p50"], m["latency_ms"]["p99"]])
    rows[-1] += ["", "", ""]
    print(table(["", "tasks/s", "p50 ms", "p99 ms", "failed", "stats lag s", "load"], rows))
    print(
        f"{args.workers} workers, {args.clients} clients; target ≥ {TARGET_TASKS_PER_S:g} "
        f"tasks/s ({'met' if figure['met'] else 'NOT met'}); {path}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
