"""What a fence costs: a task's events stored as the services store them, with and without
``Nats-Expected-Last-Subject-Sequence`` on the worker's ``started`` and outcome.

A task's way through the event log is four stored publishes: ``submitted`` and ``routed``
(the router; each with a message id), then ``started`` and ``completed`` (the worker). Since
the seams' round the worker's two are fenced on the attempt's ``routed`` (stored only while it
is the task's last routing); a web task's claim is fenced on every event of the task
(``events.task.<id>.>``). This times the three on one nats-server from the pinned wheel, on an
``EVENTS``-like stream (file storage, limits, a duplicate window, direct gets), tasks one after
another and ``--in-flight`` tasks at a time, rounds alternating so that the machine's drift
falls on each alike. Each round gets a fresh server and store.

    python -m benchmarks.fences [--tasks 2000] [--in-flight 64] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Final

import nats
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig

from benchmarks.stack import load_average, write_result
from devtools.servers import NatsServer
from services.runtime.bus import MAX_PAYLOAD

STREAM: Final = "EVENTS"
PAYLOAD: Final = b'{"kind":"x","task_id":"' + b"t" * 36 + b'","at":1.0,"worker":"w1"}' * 4

# fence name -> the subject a worker's publishes are fenced on, given the task's id
FENCES: Final[dict[str, Any]] = {
    "none": None,
    "routed": lambda task: f"events.task.{task}.routed",
    "every event": lambda task: f"events.task.{task}.>",
}


@asynccontextmanager
async def server() -> AsyncIterator[str]:
    with tempfile.TemporaryDirectory(prefix="coord-bench-fences-") as tmp:
        store = Path(tmp) / "js"
        conf = Path(tmp) / "nats-server.conf"
        conf.write_text(f"max_payload: {MAX_PAYLOAD}\njetstream {{\n  store_dir: {store}\n}}\n")
        running = NatsServer(str(store), config=str(conf)).start()
        try:
            yield running.url
        finally:
            running.stop()


async def one_task(js: JetStreamContext, fence: Any) -> None:
    """The four stored publishes of one task, in order, each awaited as the services do."""
    task = uuid.uuid4().hex
    await js.publish(f"events.task.{task}.submitted", PAYLOAD, headers={"Nats-Msg-Id": f"{task}:s"})
    routed = await js.publish(
        f"events.task.{task}.routed", PAYLOAD, headers={"Nats-Msg-Id": f"{task}:r"}
    )
    for kind in ("started", "completed"):
        headers = {"Nats-Msg-Id": f"{task}:{kind}"}
        if fence is not None:
            headers["Nats-Expected-Last-Subject-Sequence"] = str(routed.seq)
            headers["Nats-Expected-Last-Subject-Sequence-Subject"] = fence(task)
            if kind == "completed" and fence(task).endswith(">"):
                # the claim's fence moves with the start: fence the outcome on the routing
                headers["Nats-Expected-Last-Subject-Sequence-Subject"] = (
                    f"events.task.{task}.routed"
                )
        await js.publish(f"events.task.{task}.{kind}.w1", PAYLOAD, headers=headers)


async def measure(url: str, fence: Any, *, tasks: int, in_flight: int) -> dict[str, float]:
    nc = await nats.connect(url)
    try:
        js = nc.jetstream(timeout=10.0)
        await js.add_stream(
            StreamConfig(
                name=STREAM,
                subjects=["events.>"],
                retention=RetentionPolicy.LIMITS,
                storage=StorageType.FILE,
                discard=DiscardPolicy.OLD,
                duplicate_window=120.0,
                allow_direct=True,
            )
        )
        for _ in range(50):  # warm-up
            await one_task(js, fence)
        latencies: list[float] = []
        began = time.perf_counter()
        for _ in range(tasks):
            start = time.perf_counter()
            await one_task(js, fence)
            latencies.append((time.perf_counter() - start) * 1000)
        sequential_s = time.perf_counter() - began

        began = time.perf_counter()
        queue: asyncio.Queue[None] = asyncio.Queue()
        for _ in range(tasks):
            queue.put_nowait(None)

        async def client() -> None:
            while not queue.empty():
                queue.get_nowait()
                await one_task(js, fence)

        await asyncio.gather(*(client() for _ in range(in_flight)))
        concurrent_s = time.perf_counter() - began
        return {
            "task_p50_ms": statistics.median(latencies),
            "sequential_per_s": tasks / sequential_s,
            "in_flight_per_s": tasks / concurrent_s,
        }
    finally:
        await nc.close()


async def run(tasks: int, in_flight: int, rounds: int) -> dict[str, list[dict[str, float]]]:
    figures: dict[str, list[dict[str, float]]] = {name: [] for name in FENCES}
    for _ in range(rounds):
        for name, fence in FENCES.items():
            async with server() as url:
                figures[name].append(await measure(url, fence, tasks=tasks, in_flight=in_flight))
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fences", description=__doc__)
    parser.add_argument("--tasks", type=int, default=2000)
    parser.add_argument("--in-flight", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    load_before = load_average()
    figures = asyncio.run(run(args.tasks, args.in_flight, args.rounds))
    header = ("task p50 ms", "1 by 1 /s", "in flight /s")
    print(f"{'fence':<14} " + " ".join(f"{h:>14}" for h in header) + "   (median of rounds)")
    for name, runs in figures.items():
        p50 = statistics.median(r["task_p50_ms"] for r in runs)
        seq = statistics.median(r["sequential_per_s"] for r in runs)
        par = statistics.median(r["in_flight_per_s"] for r in runs)
        each = ", ".join(f"{r['in_flight_per_s']:.0f}" for r in runs)
        print(f"{name:<14} {p50:>14.3f} {seq:>14.0f} {par:>14.0f}   in flight: {each}")
    path = write_result(
        "fences",
        {
            "tasks": args.tasks,
            "in_flight": args.in_flight,
            "rounds": args.rounds,
            "figures": figures,
            "load_before": load_before,
            "load_after": load_average(),
        },
    )
    print(f"written to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
