"""Failover: seconds from ``SIGKILL`` of a busy worker to its task running on another.

    .venv/bin/python -m benchmarks.failover [--trials 5]

It starts its own nats-server (the pinned wheel's, temporary store), two Ollama stand-ins
(``devtools/fakes/ollama.py``, each generation taking ``--task-seconds``) and, as separate
processes with their default settings (heartbeat 1 s, ``WORKER_TTL_S`` 3 s, the reaper
looking every second): ``coordinator router``, ``coordinator reaper`` and two ``coordinator
worker``. Each trial submits one task, waits until a worker has started it, kills that worker
with ``SIGKILL``, and times until the task's next attempt is ``started`` on the other worker
(both instants taken in this process: the kill, and the arrival of the ``started`` event).
Then it lets the task finish, starts the killed worker again, and goes on.

It prints each trial, the median and the maximum, and writes them to
``benchmarks/results/failover-<time>.json``. Target: under 5 s with the default settings (a
dead worker is noticed when its heartbeat is ``WORKER_TTL_S`` old, at the reaper's next look).
Exit status: 1 when the median is over the target.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import tempfile
import time
from contextlib import ExitStack, suppress
from pathlib import Path
from typing import Any, Final

import msgspec
import nats
from nats.aio.client import Client
from nats.aio.msg import Msg

from benchmarks.chaos import COORDINATOR, MODEL, Service
from devtools.fakes.ollama import FakeOllama
from devtools.servers import running_nats
from schemas.events import TaskCompleted, TaskEvent, TaskStarted, task_event_decoder
from schemas.route import RouteReply, RouteRequest
from schemas.subjects import ROUTE, WORKERS
from services.runtime.bus import ensure_streams
from services.runtime.settings import DEFAULT_HEARTBEAT_INTERVAL_S, DEFAULT_WORKER_TTL_S

RESULTS: Final = Path(__file__).resolve().parent / "results"
TARGET_S: Final = 5.0


class Watch:
    """Task events as they arrive, with the monotonic time of their arrival."""

    def __init__(self) -> None:
        self.seen: list[tuple[float, TaskEvent]] = []
        self.changed = asyncio.Event()

    async def on_msg(self, msg: Msg) -> None:
        self.seen.append((time.monotonic(), task_event_decoder.decode(msg.data)))
        self.changed.set()

    async def first(self, task_id: str, kind: type[Any], attempt: int) -> tuple[float, Any]:
        while True:
            for at, event in self.seen:
                if isinstance(event, kind) and (event.task_id, event.attempt) == (task_id, attempt):
                    return at, event
            self.changed.clear()
            await asyncio.wait_for(self.changed.wait(), timeout=60)


async def routable(nc: Client, count: int) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with suppress(Exception):
            reply = await nc.request(WORKERS, b"{}", timeout=2)
            if len(msgspec.json.decode(reply.data)["workers"]) >= count:
                return
        await asyncio.sleep(0.2)
    raise RuntimeError("the workers did not register")


async def start_again(worker: Service) -> None:
    """A worker killed a moment ago is refused while its old lease is fresh: try until it runs."""
    while True:
        worker.start()
        await asyncio.sleep(3.0)
        if worker.alive:
            return


async def trials(count: int, task_s: float, logs: Path) -> list[float]:
    figures: list[float] = []
    with running_nats() as server, ExitStack() as stack:
        env = {k: v for k, v in os.environ.items() if k not in ("OLLAMA_HOST", "WORKER_ID")}
        env.update(NATS_URL=server.url, LOG_FORMAT="json", LOG_LEVEL="warning")
        workers: dict[str, Service] = {}
        backends: dict[str, FakeOllama] = {}
        for name in ("fo-a", "fo-b"):
            backends[name] = stack.enter_context(FakeOllama())
            worker_env = {**env, "OLLAMA_HOST": backends[name].url, "WORKER_ID": name}
            workers[name] = Service(name, [COORDINATOR, "worker"], worker_env, logs)
        services = [
            Service("router", [COORDINATOR, "router"], env, logs),
            Service("reaper", [COORDINATOR, "reaper"], env, logs),
            *workers.values(),
        ]
        for service in services:
            service.start()
            stack.callback(service.stop)
        nc = await nats.connect(server.url)
        try:
            await ensure_streams(nc.jetstream())
            watch = Watch()
            await nc.subscribe("events.task.>", cb=watch.on_msg)
            await routable(nc, 2)
            for backend in backends.values():
                backend.delay_s = task_s
            for trial in range(1, count + 1):
                body = msgspec.json.encode(RouteRequest(prompt=f"{trial}+1", model=MODEL))
                reply = msgspec.json.decode((await nc.request(ROUTE, body, timeout=10)).data)
                task_id = msgspec.convert(reply, RouteReply).task_id
                _, started = await watch.first(task_id, TaskStarted, 1)
                victim = workers[started.worker]
                killed_at = time.monotonic()
                victim.kill()
                moved_at, moved = await watch.first(task_id, TaskStarted, 2)
                figure = moved_at - killed_at
                figures.append(figure)
                print(
                    f"trial {trial}: killed {started.worker}, running on {moved.worker} "
                    f"{figure:.2f} s later",
                    flush=True,
                )
                await watch.first(task_id, TaskCompleted, 2)
                backends[started.worker].delay_s = 0.0  # its start's sanity run
                await start_again(victim)
                await routable(nc, 2)
                backends[started.worker].delay_s = task_s
        finally:
            await nc.close()
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.failover", description=__doc__)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--task-seconds", type=float, default=2.0, help="one generation's time")
    args = parser.parse_args(argv)
    logs = Path(tempfile.mkdtemp(prefix="coord-failover-"))
    figures = asyncio.run(trials(args.trials, args.task_seconds, logs))
    median, worst = statistics.median(figures), max(figures)
    print(
        f"failover: median {median:.2f} s, max {worst:.2f} s over {len(figures)} trials "
        f"(target < {TARGET_S:g} s; heartbeat {DEFAULT_HEARTBEAT_INTERVAL_S:g} s, "
        f"WORKER_TTL_S {DEFAULT_WORKER_TTL_S:g} s)"
    )
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"failover-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.json"
    result = {
        "benchmark": "failover",
        "trials_s": [round(f, 3) for f in figures],
        "median_s": round(median, 3),
        "max_s": round(worst, 3),
        "target_s": TARGET_S,
        "heartbeat_interval_s": DEFAULT_HEARTBEAT_INTERVAL_S,
        "worker_ttl_s": DEFAULT_WORKER_TTL_S,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "logs": str(logs),
    }
    path.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(f"figures: {path}")
    return 0 if median < TARGET_S else 1


if __name__ == "__main__":
    raise SystemExit(main())
