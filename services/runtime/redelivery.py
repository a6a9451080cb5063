"""What the task loop does with a message delivered before, before it runs anything.

A stored outcome means the task ended (a crash between storing and acknowledging): the
message is acknowledged. A kind that runs tasks twice then runs it (the claim recognises a
stale copy). A kind that never does (web search, lesson 8) asks who began it
(`services.fleet.takeover`): nobody, run it; a live starter, look again later; a lost one,
fail the task naming it.
"""

from __future__ import annotations

import time
from contextlib import suppress
from typing import assert_never

import msgspec
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError
from nats.js.kv import KeyValue
from structlog.typing import FilteringBoundLogger

from schemas.events import TaskFailed
from schemas.tasks import TaskMessage
from schemas.workers import WorkerRecord, worker_record_decoder
from services.fleet.takeover import Lost, Run, Wait, on_redelivery
from services.runtime.errors import WorkerLost
from services.runtime.outcomes import last_started, store_outcome, stored_outcome


async def settled(
    js: JetStreamContext,
    task: TaskMessage,
    msg: Msg,
    bound: FilteringBoundLogger,
    registry: KeyValue,
    *,
    runs_twice: bool,
    worker_ttl_s: float,
) -> bool:
    """True when the message is dealt with (acknowledged, returned, failed): nothing to run."""
    if msg.metadata.num_delivered == 1:
        return False
    try:
        if await stored_outcome(js, task.task_id, task.attempt) is not None:
            bound.info("redelivered task had already ended; acknowledging")
            await msg.ack()
            return True
        if runs_twice:
            return False
        return await _taken_over(js, registry, task, msg, bound=bound, worker_ttl_s=worker_ttl_s)
    except Exception as exc:  # the bus is reconnecting: look again on the redelivery
        bound.warning("redelivered task not settled; returned to the queue", error=repr(exc))
        with suppress(Exception):
            await msg.nak(delay=1)
        return True


async def _taken_over(
    js: JetStreamContext,
    registry: KeyValue,
    task: TaskMessage,
    msg: Msg,
    *,
    bound: FilteringBoundLogger,
    worker_ttl_s: float,
) -> bool:
    started = await last_started(js, task.task_id, task.attempt)
    starter = await _registry_entry(registry, started.worker) if started is not None else None
    decision = on_redelivery(started, starter, now=time.time(), ttl_s=worker_ttl_s)
    match decision:
        case Run():
            return False
        case Wait(delay_s=delay_s):
            bound.info("redelivered task is still running elsewhere", recheck_s=delay_s)
            await msg.nak(delay=delay_s)
            return True
        case Lost(reason=reason):
            assert started is not None
            await store_outcome(
                js,
                TaskFailed(
                    at=time.time(),
                    task_id=task.task_id,
                    attempt=task.attempt,
                    worker=started.worker,
                    code=WorkerLost.code,
                    reason=reason,
                    retryable=False,
                ),
            )
            await msg.ack()
            bound.warning("task lost by its worker; failed", lost_by=started.worker)
            return True
        case _:
            assert_never(decision)


async def _registry_entry(registry: KeyValue, worker_id: str) -> WorkerRecord | None:
    try:
        entry = await registry.get(worker_id)
    except KeyNotFoundError:
        return None
    try:
        return worker_record_decoder.decode(entry.value or b"")
    except msgspec.DecodeError:
        return None
