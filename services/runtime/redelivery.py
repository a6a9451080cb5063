"""What the task loop does with a message delivered before, before it runs anything.

A stored outcome means the task ended (a crash between storing and acknowledging): the
message is acknowledged. A kind that runs tasks twice then runs it (the claim recognises a
stale copy). A kind that never does (web search) asks who began it
(`services.fleet.takeover`): nobody, run it; a live starter, look again later; a lost one,
fail the task naming it. Any copy of the log may answer those reads, one that lags behind a
cut included, so what they showed is handed to the claim (`ToRun`), which is stored only
while nothing newer of the task is (`services.runtime.outcomes.claim`).
"""

from __future__ import annotations

import time
from collections.abc import Collection
from typing import NamedTuple, assert_never

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError
from nats.js.kv import KeyValue
from structlog.typing import FilteringBoundLogger

from schemas.events import TaskCompleted, TaskFailed, TaskStarted
from schemas.tasks import TaskMessage
from schemas.workers import WorkerRecord, worker_record_decoder
from services.errors import WorkerLost
from services.fleet.binding import refusal, routed_to_of_queue
from services.fleet.takeover import Lost, Run, Wait, on_redelivery
from services.runtime.acks import ACK, NAK, TERM, settle
from services.runtime.bus import is_wrong_last_sequence
from services.runtime.outcomes import (
    Reads,
    Sourced,
    last_started,
    outcome_among,
    store_outcome,
    stored_ends,
)


class ToRun(NamedTuple):
    """The message is to be run: its claim may follow. ``judged_up_to``: the sequence of the
    newest event of the task that the reads judged (0: none, a first delivery)."""

    judged_up_to: int = 0


async def settled(
    nc: Client,
    js: JetStreamContext,
    task: TaskMessage,
    msg: Msg,
    *,
    bound: FilteringBoundLogger,
    registry: KeyValue,
    worker_id: str,
    runs_twice: bool,
    worker_ttl_s: float,
    fence: tuple[str, int] | None = None,
    reads: Reads | None = None,
) -> ToRun | None:
    """None when the message is dealt with (acknowledged, returned, failed): nothing to run.
    ``fence``: the attempt's (`services.runtime.outcomes.attempt_fence`), for a failure this
    stores; ``reads``: where the task's events are read (default: ``js``).

    Only events their recorder may give count (`services.fleet.binding`): the attempt was
    routed where the message's queue says."""
    if msg.metadata.num_delivered == 1:
        return ToRun()
    try:
        ends = await stored_ends(reads or js, task.task_id)
        supports = await _supports(registry, {end.source for end in ends if end.source})
        routed_to = routed_to_of_queue(msg.subject)

        def accepted(sourced: Sourced) -> bool:
            event, source, _ = sourced
            assert isinstance(event, TaskCompleted | TaskFailed)
            if event.attempt != task.attempt:
                return True  # a later attempt's: this copy is stale either way
            return refusal(event, source, (task.attempt, routed_to), supports.get) is None

        if outcome_among(ends, task.attempt, accepted) is not None:
            bound.info("redelivered task had already ended; acknowledging")
            await settle(nc, msg, ACK)
            return None
        if runs_twice:
            return ToRun()
        return await _taken_over(
            nc,
            js,
            registry,
            task,
            msg,
            reads=reads or js,
            bound=bound,
            worker_id=worker_id,
            routed_to=routed_to,
            worker_ttl_s=worker_ttl_s,
            fence=fence,
            judged_up_to=max((end.seq for end in ends), default=0),
        )
    except Exception as exc:  # the bus is reconnecting: look again on the redelivery
        bound.warning("redelivered task not settled; returned to the queue", error=repr(exc))
        await settle(nc, msg, NAK, delay_s=1)
        return None


async def _taken_over(
    nc: Client,
    js: JetStreamContext,
    registry: KeyValue,
    task: TaskMessage,
    msg: Msg,
    *,
    reads: Reads,
    bound: FilteringBoundLogger,
    worker_id: str,
    routed_to: str,
    worker_ttl_s: float,
    fence: tuple[str, int] | None,
    judged_up_to: int,
) -> ToRun | None:
    found = await last_started(reads, task.task_id, task.attempt)
    started, starter = None, None
    if found is not None:
        event, source, seq = found
        judged_up_to = max(judged_up_to, seq)
        assert isinstance(event, TaskStarted)
        record = await _registry_entry(registry, source) if source is not None else None
        supports: dict[str, Collection[str]] = {}
        if record is not None:
            supports[record.worker_id] = record.supports
        if refusal(event, source, (task.attempt, routed_to), supports.get) is None:
            started, starter = event, record
        else:
            bound.warning("a start recorded by a worker that may not is ignored", source=source)
    decision = on_redelivery(started, starter, now=time.time(), ttl_s=worker_ttl_s)
    match decision:
        case Run():
            return ToRun(judged_up_to)
        case Wait(delay_s=delay_s):
            bound.info("redelivered task is still running elsewhere", recheck_s=delay_s)
            await settle(nc, msg, NAK, delay_s=delay_s)
            return None
        case Lost(reason=reason):
            assert started is not None
            try:
                await store_outcome(
                    js,
                    by=worker_id,
                    fence=fence,
                    outcome=TaskFailed(
                        at=time.time(),
                        task_id=task.task_id,
                        attempt=task.attempt,
                        worker=started.worker,
                        code=WorkerLost.code,
                        reason=reason,
                        retryable=False,
                    ),
                )
            except Exception as exc:
                if fence is None or not is_wrong_last_sequence(exc):
                    raise
                bound.warning("redelivered task was moved on; dropped")
                await settle(nc, msg, TERM)
                return None
            await settle(nc, msg, ACK)
            bound.warning("task lost by its worker; failed", lost_by=started.worker)
            return None
        case _:
            assert_never(decision)


async def _supports(registry: KeyValue, workers: set[str]) -> dict[str, Collection[str]]:
    """What each of ``workers`` supports, by its registry entry (a worker without one is
    left out: it is no pool's member now)."""
    found: dict[str, Collection[str]] = {}
    for worker in workers:
        record = await _registry_entry(registry, worker)
        if record is not None:
            found[worker] = record.supports
    return found


async def _registry_entry(registry: KeyValue, worker_id: str) -> WorkerRecord | None:
    try:
        entry = await registry.get(worker_id)
    except KeyNotFoundError:
        return None
    try:
        return worker_record_decoder.decode(entry.value or b"")
    except msgspec.DecodeError:
        return None
