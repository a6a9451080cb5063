"""What ``sync_interval: always`` costs: acknowledged publishes to a file stream, one server at
JetStream's default (fsync every 2 minutes) against one that fsyncs before every
acknowledgement, and the shipped cluster configuration (three nodes, three replicas, always).

Each setup gets its own nats-server(s) from the pinned wheel on loopback ports and a temporary
store. Two loads per setup: ``--messages`` publishes of ``--size`` bytes one after another,
each waiting for its acknowledgement (as the services publish events), timed one by one; then
as many again with ``--in-flight`` publishes outstanding at a time (a busy fleet). It prints a
table and writes ``benchmarks/results/durability-<time>.json``.

    python -m benchmarks.durability [--messages 2000] [--size 512] [--in-flight 32]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import nats
from nats.js.api import StorageType, StreamConfig

from benchmarks.stack import load_average, write_result
from devtools.servers import NatsCluster, NatsServer
from services.cli.permissions import NATS_ROLES, password_variable
from services.runtime.bus import MAX_PAYLOAD

STREAM = "DURABILITY"


@asynccontextmanager
async def single(sync_always: bool) -> AsyncIterator[tuple[str, dict[str, str], int]]:
    """One server; ``sync_always`` adds the cluster configuration's ``sync_interval``."""
    with tempfile.TemporaryDirectory(prefix="coord-bench-nats-") as tmp:
        store = Path(tmp) / "js"
        sync = "  sync_interval: always\n" if sync_always else ""
        conf = Path(tmp) / "nats-server.conf"
        conf.write_text(
            f"max_payload: {MAX_PAYLOAD}\njetstream {{\n  store_dir: {store}\n{sync}}}\n"
        )
        server = NatsServer(str(store), config=str(conf)).start()
        try:
            yield server.url, {}, 1
        finally:
            server.stop()


@asynccontextmanager
async def cluster() -> AsyncIterator[tuple[str, dict[str, str], int]]:
    """The shipped cluster configuration, three nodes; publishes as the admin user."""
    users = ["admin", *NATS_ROLES]
    with tempfile.TemporaryDirectory(prefix="coord-bench-cluster-") as root:
        nodes = NatsCluster(root, {password_variable(u): f"pw-{u}" for u in users}).start()
        try:
            yield nodes.url, {"user": "admin", "password": "pw-admin"}, 3
        finally:
            nodes.stop()


async def measure(
    url: str,
    credentials: dict[str, str],
    replicas: int,
    *,
    messages: int,
    size: int,
    in_flight: int,
) -> dict[str, Any]:
    nc = await nats.connect(servers=url.split(","), **credentials)
    try:
        js = nc.jetstream(timeout=10.0)
        await js.add_stream(
            StreamConfig(
                name=STREAM,
                subjects=["bench.>"],
                storage=StorageType.FILE,
                num_replicas=replicas,
            )
        )
        payload = b"x" * size
        for _ in range(100):  # warm-up
            await js.publish("bench.warm", payload)
        latencies: list[float] = []
        began = time.perf_counter()
        for _ in range(messages):
            start = time.perf_counter()
            await js.publish("bench.one", payload)
            latencies.append((time.perf_counter() - start) * 1000)
        sequential_s = time.perf_counter() - began

        began = time.perf_counter()
        sent = 0
        while sent < messages:
            batch = min(in_flight, messages - sent)
            await asyncio.gather(*(js.publish("bench.many", payload) for _ in range(batch)))
            sent += batch
        concurrent_s = time.perf_counter() - began
        latencies.sort()
        return {
            "ack_p50_ms": statistics.median(latencies),
            "ack_p99_ms": latencies[int(len(latencies) * 0.99) - 1],
            "sequential_per_s": messages / sequential_s,
            "in_flight_per_s": messages / concurrent_s,
        }
    finally:
        await nc.close()


SETUPS: dict[str, Callable[[], Any]] = {
    "single, default (fsync every 2 min)": lambda: single(sync_always=False),
    "single, sync_interval: always": lambda: single(sync_always=True),
    "cluster of 3, R3, sync_interval: always": cluster,
}


async def run(messages: int, size: int, in_flight: int) -> dict[str, Any]:
    figures: dict[str, Any] = {}
    for name, setup in SETUPS.items():
        async with setup() as (url, credentials, replicas):
            figures[name] = await measure(
                url, credentials, replicas, messages=messages, size=size, in_flight=in_flight
            )
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.durability", description=__doc__)
    parser.add_argument("--messages", type=int, default=2000)
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--in-flight", type=int, default=32)
    args = parser.parse_args(argv)
    load_before = load_average()
    figures = asyncio.run(run(args.messages, args.size, args.in_flight))
    header = ("ack p50 ms", "ack p99 ms", "1 by 1 /s", "in flight /s")
    print(f"{'setup':<42} " + " ".join(f"{h:>12}" for h in header))
    for name, f in figures.items():
        print(
            f"{name:<42} {f['ack_p50_ms']:>12.3f} {f['ack_p99_ms']:>12.3f} "
            f"{f['sequential_per_s']:>12.0f} {f['in_flight_per_s']:>12.0f}"
        )
    path = write_result(
        "durability",
        {
            "messages": args.messages,
            "size": args.size,
            "in_flight": args.in_flight,
            "figures": figures,
            "load_before": load_before,
            "load_after": load_average(),
        },
    )
    print(f"written to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
