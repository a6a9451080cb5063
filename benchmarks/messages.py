"""Messages per task: what one task costs the bus, per service, counted rather than timed.

    .venv/bin/python -m benchmarks.messages [--tasks 300]

Brings up the stack (`benchmarks.stack`: nats-server with its monitoring port, the instant
stand-in, stats, the router, one worker), sends ``--tasks`` route requests one after the other
and reads each connection's message counters from nats-server (``/connz``) before and after;
the messages the services send and receive meanwhile while idle (heartbeats, watches) are
measured over as long a quiet window and taken off.

A count does not drift with the machine's load as throughput and latency do: it says whether
a change added round trips to a task's way (each one a wait for a worker with one task at a
time), where timed figures on a shared 2-core machine cannot tell 5% from noise. Compare two
trees with ``BENCH_SERVICES_PATH``. Results: a table, and
``benchmarks/results/messages-<time>.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any, Final

import httpx

from benchmarks.stack import Stack, route_once, table, write_result

WARMUP_TASKS: Final = 50


def _role(name: str) -> str:
    """A connection's name as the services give it, grouped by role."""
    if name.startswith("coordinator-worker"):
        return "worker"
    if name.startswith("coordinator-"):
        return name.removeprefix("coordinator-")
    return name or "(unnamed)"


async def counters(port: int) -> dict[str, tuple[int, int]]:
    """Messages (in, out) per role, as nats-server counts them on open connections."""
    async with httpx.AsyncClient() as client:
        reply = await client.get(f"http://127.0.0.1:{port}/connz", params={"limit": 1024})
    reply.raise_for_status()
    totals: dict[str, tuple[int, int]] = {}
    for conn in reply.json()["connections"]:
        role = _role(conn.get("name", ""))
        got, sent = totals.get(role, (0, 0))
        # in_msgs: what the connection published; out_msgs: what it was delivered.
        totals[role] = (got + conn["in_msgs"], sent + conn["out_msgs"])
    return totals


def _minus(
    after: dict[str, tuple[int, int]], before: dict[str, tuple[int, int]]
) -> dict[str, tuple[int, int]]:
    return {
        role: (a[0] - before.get(role, (0, 0))[0], a[1] - before.get(role, (0, 0))[1])
        for role, a in after.items()
    }


async def run(tasks: int) -> dict[str, Any]:
    async with Stack(1, monitor=True) as stack:
        assert stack.nc is not None and stack.monitor_port is not None
        for _ in range(WARMUP_TASKS):
            await route_once(stack.nc)
        await stack.stats_caught_up()
        started = time.monotonic()
        before = await counters(stack.monitor_port)
        failed = 0
        for _ in range(tasks):
            failed += not (await route_once(stack.nc)).ok
        await stack.stats_caught_up()
        busy = _minus(await counters(stack.monitor_port), before)
        busy_s = time.monotonic() - started
        quiet_before = await counters(stack.monitor_port)
        await asyncio.sleep(busy_s)
        idle = _minus(await counters(stack.monitor_port), quiet_before)
    per_task = {
        role: (sent / tasks, got / tasks)
        for role, (sent, got) in sorted(_minus(busy, idle).items())
    }
    return {"tasks": tasks, "failed": failed, "seconds": busy_s, "per_task": per_task}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=300)
    args = parser.parse_args()
    figure = asyncio.run(run(args.tasks))
    rows = [
        [role, round(sent, 2), round(got, 2)] for role, (sent, got) in figure["per_task"].items()
    ]
    total_sent = sum(sent for sent, _ in figure["per_task"].values())
    total_got = sum(got for _, got in figure["per_task"].values())
    rows.append(["all", round(total_sent, 2), round(total_got, 2)])
    print(table(["messages per task", "published", "delivered"], rows))
    print(f"{figure['tasks']} tasks one after the other, {figure['failed']} failed")
    print(write_result("messages", figure))


if __name__ == "__main__":
    main()
