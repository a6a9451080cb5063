"""Routing overhead: what the coordinator adds on top of the backend's own time, one client.

    .venv/bin/python -m benchmarks.overhead [--requests 1000] [--runs 3] [--workers 1]

Brings up the stack as separate processes (`benchmarks.stack`: nats-server, the instant
Ollama stand-in, stats with a scratch PostgreSQL database, router, workers), sends
``--requests`` route requests with ``wait`` one after the other from one client, and per
request takes the time from sending it to receiving the reply, minus the backend's own time
for that task (``durations.total_ms``, which the stand-in reports as its real time on the
request). Everything else counts as overhead: the client's request to the router, routing,
the three stored publishes, the worker's fetch, its ``started`` event, the HTTP round trip
to the backend, the stored outcome, the event back to the router and its reply.

Each run is preceded by warm-up requests; p50, p90 and p99 are given per run and as the
median over the runs, with the load average, in a table and in
``benchmarks/results/overhead-<time>.json``.

Targets: p50 ≤ 2 ms and p99 ≤ 10 ms on the project's 2-core machines.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from typing import Any, Final

from benchmarks.stack import (
    Stack,
    Standin,
    load_average,
    median,
    percentile,
    route_once,
    table,
    write_result,
)

TARGET_P50_MS: Final = 2.0
TARGET_P99_MS: Final = 10.0
WARMUP: Final = 100


async def measure(
    requests: int, runs: int, workers: int, standin: Standin, stats: bool
) -> dict[str, Any]:
    results: list[dict[str, Any]] = []
    async with Stack(workers, standin=standin, stats=stats) as stack:
        assert stack.nc is not None
        for run in range(runs):
            for _ in range(WARMUP):
                await route_once(stack.nc)
            await stack.stats_caught_up()
            load_before = load_average()
            overhead: list[float] = []
            total: list[float] = []
            backend: list[float] = []
            failed = 0
            started = time.perf_counter()
            for _ in range(requests):
                sample = await route_once(stack.nc)
                if not sample.ok:
                    failed += 1
                    continue
                total.append(sample.total_ms)
                backend.append(sample.backend_ms)
                overhead.append(sample.total_ms - sample.backend_ms)
            took = time.perf_counter() - started
            results.append(
                {
                    "run": run + 1,
                    "requests": requests,
                    "failed": failed,
                    "seconds": round(took, 2),
                    "overhead_ms": _pcts(overhead),
                    "end_to_end_ms": _pcts(total),
                    "backend_ms": _pcts(backend),
                    "load_average": [load_before, load_average()],
                }
            )
            print(
                f"run {run + 1}: overhead p50 {results[-1]['overhead_ms']['p50']} ms, "
                f"p99 {results[-1]['overhead_ms']['p99']} ms (load {load_before[0]})",
                file=sys.stderr,
            )
    summary = {
        key: {q: round(median([r[key][q] for r in results]), 3) for q in ("p50", "p90", "p99")}
        for key in ("overhead_ms", "end_to_end_ms", "backend_ms")
    }
    return {
        "setup": {
            "workers": workers,
            "standin": standin,
            "stats": stats,
            "requests_per_run": requests,
            "runs": runs,
            "warmup_per_run": WARMUP,
        },
        "runs": results,
        "median_of_runs": summary,
        "targets": {"overhead_p50_ms": TARGET_P50_MS, "overhead_p99_ms": TARGET_P99_MS},
        "met": {
            "p50": summary["overhead_ms"]["p50"] <= TARGET_P50_MS,
            "p99": summary["overhead_ms"]["p99"] <= TARGET_P99_MS,
        },
    }


def _pcts(values: list[float]) -> dict[str, float]:
    return {f"p{q}": round(percentile(values, q), 3) for q in (50, 90, 99)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.overhead", description=__doc__)
    parser.add_argument("--requests", type=int, default=1000, help="per run")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--standin", choices=("instant", "fake"), default="instant")
    parser.add_argument("--no-stats", action="store_true", help="leave the stats service out")
    args = parser.parse_args(argv)
    figure = asyncio.run(
        measure(args.requests, args.runs, args.workers, args.standin, not args.no_stats)
    )
    path = write_result("overhead", figure)
    rows = [
        [
            f"run {r['run']}",
            r["overhead_ms"]["p50"],
            r["overhead_ms"]["p90"],
            r["overhead_ms"]["p99"],
            r["backend_ms"]["p50"],
            r["backend_ms"]["p99"],
            r["failed"],
            r["load_average"][0][0],
        ]
        for r in figure["runs"]
    ]
    m = figure["median_of_runs"]
    rows.append(
        [
            "median",
            m["overhead_ms"]["p50"],
            m["overhead_ms"]["p90"],
            m["overhead_ms"]["p99"],
            m["backend_ms"]["p50"],
            m["backend_ms"]["p99"],
            "",
            "",
        ]
    )
    print(
        table(
            [
                "",
                "overhead p50 ms",
                "p90 ms",
                "p99 ms",
                "backend p50 ms",
                "backend p99 ms",
                "failed",
                "load",
            ],
            rows,
        )
    )
    print(
        f"targets: p50 ≤ {TARGET_P50_MS:g} ms ({'met' if figure['met']['p50'] else 'NOT met'}), "
        f"p99 ≤ {TARGET_P99_MS:g} ms ({'met' if figure['met']['p99'] else 'NOT met'}); {path}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
