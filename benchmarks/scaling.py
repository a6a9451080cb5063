"""Scaling: throughput with 1, 2, 4 and 8 workers, and how many registered workers the router
handles before a routing decision passes 1 ms.

    .venv/bin/python -m benchmarks.scaling [--workers 1,2,4,8] [--clients-per-worker 16]
                                           [--duration 8] [--runs 1] [--skip-throughput]
                                           [--skip-routing]

First half: for each worker count, a fresh stack (`benchmarks.stack`) and the closed-loop
load of `benchmarks.throughput` (``--clients-per-worker`` × workers clients, at least 16),
tasks per second and p50/p99 latency. Second half: `benchmarks.routing`, the pure routing
decision against synthetic fleets of 10 to 1000 workers, and the largest fleet whose
decision stays within 1 ms. Results: tables, and ``benchmarks/results/scaling-<time>.json``.

Target: a routing decision ≤ 1 ms with 200 registered workers.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

from benchmarks import routing
from benchmarks.stack import Stack, median, table, write_result
from benchmarks.throughput import run_load


async def throughput(
    counts: list[int], clients_per_worker: int, duration_s: float, runs: int, supports: str
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for workers in counts:
        clients = max(16, clients_per_worker * workers)
        results = []
        async with Stack(workers, supports=supports) as stack:
            for _ in range(runs):
                results.append(
                    await run_load(
                        stack, clients=clients, duration_s=duration_s, max_requests=50_000
                    )
                )
        row = {
            "workers": workers,
            "clients": clients,
            "tasks_per_s": median([r["tasks_per_s"] for r in results]),
            "latency_ms": {
                q: median([r["latency_ms"][q] for r in results]) for q in ("p50", "p99")
            },
            "runs": results,
        }
        rows.append(row)
        print(
            f"{workers} workers: {row['tasks_per_s']} tasks/s "
            f"(load {results[-1]['load_average'][0][0]})",
            file=sys.stderr,
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scaling", description=__doc__)
    parser.add_argument("--workers", default="1,2,4,8")
    parser.add_argument("--clients-per-worker", type=int, default=16)
    parser.add_argument("--duration", type=float, default=8.0, help="seconds per run")
    parser.add_argument("--runs", type=int, default=1, help="runs per worker count")
    parser.add_argument("--supports", default="cpu_inference", help="WORKER_SUPPORTS")
    parser.add_argument("--sizes", default="10,50,200,500,1000", help="routing: fleet sizes")
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--skip-routing", action="store_true")
    args = parser.parse_args(argv)
    figure: dict[str, Any] = {"setup": vars(args)}
    if not args.skip_throughput:
        counts = [int(n) for n in args.workers.split(",")]
        rows = asyncio.run(
            throughput(counts, args.clients_per_worker, args.duration, args.runs, args.supports)
        )
        figure["throughput"] = rows
        print(
            table(
                ["workers", "clients", "tasks/s", "p50 ms", "p99 ms", "load"],
                [
                    [
                        r["workers"],
                        r["clients"],
                        r["tasks_per_s"],
                        r["latency_ms"]["p50"],
                        r["latency_ms"]["p99"],
                        r["runs"][-1]["load_average"][0][0],
                    ]
                    for r in rows
                ],
            )
        )
    if not args.skip_routing:
        figure["routing"] = routing.measure([int(s) for s in args.sizes.split(",")])
        routing.print_table(figure["routing"])
    print(write_result("scaling", figure))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
