"""Replay speed: rebuild the stats projections from a generated log of 100,000 events.

    .venv/bin/python -m benchmarks.replay [--events 100000] [--dsn postgresql://…]

It starts its own nats-server (the pinned wheel's, temporary store), writes a realistic log
into ``EVENTS`` (tasks on several workers and models, 5 % failures, retries, judge verdicts,
worker registrations, aliases and exclusions), then times `services.stats.rebuild.rebuild`
into a fresh PostgreSQL database (the machine's on 127.0.0.1:5432 when it answers, else an
embedded one; ``--dsn`` names an admin DSN to create it with) and prints events per second.
The figure and the setup it was measured on go to ``benchmarks/results/replay-<time>.json``.

Target: at least 5,000 events/s on a 2-core machine, so a year of a small fleet's log
(a few hundred thousand events) rebuilds in about a minute.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import sys
import time
from pathlib import Path
from typing import Final

import asyncpg
import nats

from devtools.servers import Postgres, running_nats
from schemas.events import (
    AliasSet,
    AnyEvent,
    Durations,
    ExclusionAdded,
    QualityScored,
    TaskCompleted,
    TaskFailed,
    TaskRouted,
    TaskStarted,
    TaskSubmitted,
    Tokens,
    WorkerRegistered,
    encoder,
    subject_for,
)
from schemas.work import Work
from services.runtime.bus import ensure_streams
from services.stats.rebuild import rebuild
from services.stats.store import Store

RESULTS: Final = Path(__file__).resolve().parent / "results"
TARGET_EVENTS_PER_S: Final = 5000.0

WORKERS: Final = ("mac", "pc", "cpu-1", "cpu-2", "esxi", "ai-core")
MODELS: Final = ("qwen2.5:7b", "gemma3:1b", "LFM2.5-1.2B-JP", "elyza-jp-8b", "qwen3:8b")
PROMPTS: Final = (
    ("Write a Python function that parses a date.", None),
    ("What is 17*23?", "math"),
    ("日本の首都はどこですか？", None),
    ("Summarise the plot of Hamlet in two lines.", "general"),
)
T0: Final = 1_750_000_000.0


def generate(count: int, seed: int = 6) -> list[AnyEvent]:
    """A log of exactly ``count`` events, the same for the same seed."""
    rng = random.Random(seed)
    events: list[AnyEvent] = []
    at = T0
    number = 0
    while len(events) < count:
        if number % 500 == 0:
            for worker in WORKERS:
                events.append(
                    WorkerRegistered(
                        at=at,
                        worker_id=worker,
                        host=f"{worker}.lan",
                        instance_id=f"{worker}-{number}",
                        models=list(MODELS),
                        supports=["cpu_inference"],
                        version="0.1.0",
                    )
                )
        if number == 2000:
            events.append(AliasSet(at=at, alias="elyza-jp-8b", canonical="elyza:8b"))
        if number % 5000 == 2500:
            events.append(
                ExclusionAdded(
                    at=at,
                    exclusion_id=f"x-{number}",
                    worker=rng.choice(WORKERS),
                    since=at - 600,
                    until=at,
                    reason="benchmark: a polluted window",
                )
            )
        events.extend(_task(rng, f"t-{number:07d}", at))
        at += rng.uniform(0.5, 5.0)
        number += 1
    return events[:count]


def _task(rng: random.Random, task_id: str, at: float) -> list[AnyEvent]:
    model = rng.choice(MODELS)
    prompt, domain = rng.choice(PROMPTS)
    worker = rng.choice(WORKERS)
    total_ms = rng.lognormvariate(7.5, 0.6)
    events: list[AnyEvent] = [
        TaskSubmitted(
            at=at,
            task_id=task_id,
            model=model,
            timeout_s=300,
            work=Work(prompt=prompt, domain=domain),
        ),
        TaskRouted(at=at, task_id=task_id, attempt=1, worker=worker, queue=f"tasks.cpu.{worker}"),
        TaskStarted(at=at + 0.01, task_id=task_id, attempt=1, worker=worker, host=worker),
    ]
    ended = at + total_ms / 1000
    attempt = 1
    if rng.random() < 0.05:
        events.append(
            TaskFailed(
                at=ended,
                task_id=task_id,
                attempt=1,
                worker=worker,
                code="backend_timeout",
                reason="did not finish",
                retryable=True,
            )
        )
        attempt, worker = 2, rng.choice(WORKERS)
        events.append(
            TaskRouted(
                at=ended, task_id=task_id, attempt=2, worker=worker, queue=f"tasks.cpu.{worker}"
            )
        )
    events.append(
        TaskCompleted(
            at=ended + (1 if attempt == 2 else 0),
            task_id=task_id,
            attempt=attempt,
            worker=worker,
            model=model,
            response="An answer of a few dozen words. " * 4,
            durations=Durations(
                total_ms=total_ms,
                load_ms=rng.choice((0.0, 0.0, 0.0, 2500.0)),
                eval_ms=total_ms * 0.8,
                first_token_ms=total_ms * 0.1,
            ),
            tokens=Tokens(prompt=30, eval=int(total_ms / 20)),
        )
    )
    if rng.random() < 0.1:
        events.append(
            QualityScored(
                at=ended + 3600,
                task_id=task_id,
                attempt=attempt,
                verdict="scored",
                score=round(rng.random(), 2),
                rubric=domain or "general",
                judge_model="qwen3:8b",
                judge_host="http://mac:11434",
            )
        )
    return events


async def publish(js: nats.js.JetStreamContext, events: list[AnyEvent]) -> None:
    """Store the events in order, many publishes in flight at a time."""
    chunk = 1000
    for start in range(0, len(events), chunk):
        await asyncio.gather(
            *(
                js.publish(subject_for(event), encoder.encode(event))
                for event in events[start : start + chunk]
            )
        )


async def run(count: int, admin_dsn: str | None) -> dict[str, object]:
    postgres = Postgres()
    if admin_dsn:
        postgres.admin_dsn = admin_dsn
    else:
        await postgres.start()
    dsn = await postgres.create_database()
    try:
        with running_nats() as server:
            nc = await nats.connect(server.url)
            try:
                js = nc.jetstream()
                await ensure_streams(js)
                events = generate(count)
                started = time.perf_counter()
                await publish(js, events)
                publish_s = time.perf_counter() - started
                print(f"{len(events)} events published in {publish_s:.1f} s", file=sys.stderr)

                store = await Store.connect(dsn)
                try:
                    await store.apply_schema()
                finally:
                    await store.close()
                result = await rebuild(js, dsn)
            finally:
                await nc.close()
        conn = await asyncpg.connect(dsn)
        try:
            pg_version = str(await conn.fetchval("SHOW server_version"))
        finally:
            await conn.close()
    finally:
        await postgres.drop_database(dsn)
        postgres.stop()
    return {
        "benchmark": "replay",
        "events": result.events,
        "seconds": round(result.seconds, 3),
        "events_per_s": round(result.events_per_s, 1),
        "target_events_per_s": TARGET_EVENTS_PER_S,
        "figures": result.figures,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "postgresql": pg_version,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.replay", description=__doc__)
    parser.add_argument("--events", type=int, default=100_000)
    parser.add_argument("--dsn", help="admin DSN of the PostgreSQL to create the database in")
    args = parser.parse_args(argv)
    figure = asyncio.run(run(args.events, args.dsn))
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"replay-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.json"
    path.write_text(json.dumps(figure, indent=2) + "\n", encoding="utf-8")
    print(
        f"replay: {figure['events']} events in {figure['seconds']} s = "
        f"{figure['events_per_s']} events/s (target {TARGET_EVENTS_PER_S:.0f}); {path}"
    )
    return 0 if float(str(figure["events_per_s"])) >= TARGET_EVENTS_PER_S else 1


if __name__ == "__main__":
    raise SystemExit(main())
