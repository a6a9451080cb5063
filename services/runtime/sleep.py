"""Idle sleep: a worker idle long enough leaves a wake address, deregisters and powers off.

The rule (when) is `services.fleet.idle.should_sleep`; this is the doing: the ``asleep``
bucket entry the router wakes the machine from, the ``asleep`` event, the deregistration and
the operator's shutdown command.
"""

from __future__ import annotations

import asyncio
import shlex
import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass

import msgspec
import structlog
from nats.js import JetStreamContext

from schemas.events import WorkerAsleep
from schemas.subjects import ASLEEP_BUCKET
from schemas.workers import WorkerRecord
from services.fleet.idle import should_sleep
from services.runtime.bus import ensure_bucket, publish_event
from services.runtime.lease import Lease, deregister

log = structlog.get_logger("sleep")

_encoder = msgspec.json.Encoder()


@dataclass(frozen=True, slots=True)
class SleepPolicy:
    """When a worker may sleep and how it powers its machine off."""

    idle_shutdown_s: float | None  # None: never
    min_uptime_s: float
    check_interval_s: float
    shutdown_command: str


async def forget_sleeping(js: JetStreamContext, worker_id: str) -> None:
    """Awake again: no longer a sleeper for the router to wake."""
    with suppress(Exception):
        await (await ensure_bucket(js, ASLEEP_BUCKET, ttl_s=None)).delete(worker_id)


async def watch_idle(
    policy: SleepPolicy,
    *,
    started_at: float,
    last_activity: Callable[[], float],
    busy: Callable[[], bool],
    asleep: asyncio.Event,
) -> None:
    """With an idle shutdown configured, set ``asleep`` once the worker has idled long enough."""
    if policy.idle_shutdown_s is None:
        return
    while True:
        await asyncio.sleep(policy.check_interval_s)
        if should_sleep(
            now=time.time(),
            started_at=started_at,
            last_activity=last_activity(),
            busy=busy(),
            idle_shutdown_s=policy.idle_shutdown_s,
            min_uptime_s=policy.min_uptime_s,
        ):
            log.info("idle; going to sleep", idle_s=round(time.time() - last_activity()))
            asleep.set()
            return


async def go_to_sleep(
    js: JetStreamContext,
    lease: Lease | None,
    record: WorkerRecord,
    policy: SleepPolicy,
    *,
    idle_s: float,
) -> None:
    """Leave a wake address for the router, deregister, then run the shutdown command."""
    record = msgspec.structs.replace(record, state="asleep", current_task=None)
    try:
        sleepers = await ensure_bucket(js, ASLEEP_BUCKET, ttl_s=None)
        await sleepers.put(record.worker_id, _encoder.encode(record))
        await publish_event(
            js,
            WorkerAsleep(
                at=time.time(),
                worker_id=record.worker_id,
                instance_id=record.instance_id,
                models=record.models,
                wol_mac=record.wol_mac,
                idle_s=idle_s,
            ),
        )
    except Exception as exc:
        log.error("could not record going to sleep", error=repr(exc))
    await deregister(lease, js, "idle shutdown")
    command = shlex.split(policy.shutdown_command)
    log.info("running the shutdown command", command=command)
    try:
        proc = await asyncio.create_subprocess_exec(*command)
        code = await proc.wait()
    except OSError as exc:
        log.error("shutdown command failed to start", command=command, error=str(exc))
        return
    if code != 0:
        log.error("shutdown command failed", command=command, exit_code=code)
