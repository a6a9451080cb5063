"""Waiting for a task's end on behalf of its client, and asking the stream for an end the
router's subscription missed."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from typing import Final

import structlog
from nats.js import JetStreamContext

from schemas.events import TaskCompleted, TaskFailed, TaskRouted, task_event_decoder
from schemas.subjects import task_event
from services.errors import WaitTimeout
from services.router.records import latest_outcome
from services.router.waiting import Waiter
from services.runtime.outcomes import Sourced, last_on, stored_ends

log = structlog.get_logger("router")

# How often the stream is asked for the ends of tasks waited on longer than this.
RECHECK_S: Final = 3.0
# Tasks asked about at once.
RECHECK_PARALLEL: Final = 16


async def wait_for_end(
    js: JetStreamContext, task_id: str, waiter: Waiter, timeout_s: float, *, shared: bool = False
) -> TaskCompleted | TaskFailed:
    """The task's outcome as ``waiter`` gets it, or as the stream has it after ``timeout_s``
    (only what ``waiter`` would take); `WaitTimeout` when it has none. ``shared``: another
    request waits on the same waiter, so a timeout here must leave its future alone."""
    try:
        # asyncio.timeout, not wait_for over a shield: three fewer hand-offs through the
        # loop per reply. A timeout cancels the future; nothing settles it afterwards.
        async with asyncio.timeout(timeout_s):
            return await (asyncio.shield(waiter.future) if shared else waiter.future)
    except TimeoutError:
        pass
    # The end event may have been missed during a reconnect: ask the stream itself (the
    # latest attempt's outcome, if the task was moved on).
    ends = [
        event
        for event, source, _ in await stored_ends(js, task_id)
        if isinstance(event, TaskCompleted | TaskFailed) and waiter.refusal(event, source) is None
    ]
    outcome = latest_outcome(ends)
    if outcome is not None:
        return outcome
    raise WaitTimeout(
        f"task {task_id} has not ended after {timeout_s:.0f} s; it may still finish: "
        f"ask coordinator.task for {task_id}"
    )


async def recheck_ends(
    js: JetStreamContext, waiters: Mapping[str, Waiter], every_s: float = RECHECK_S
) -> None:
    """Every ``every_s``, ask the stream for the latest routing and the ends of the tasks
    waited on for longer (`Waiter.stored_routing`, `Waiter.stored`): an end the router's
    subscription missed (it was reconnecting, or cut off while the event was stored by
    replication) reaches its client within seconds, not at the task's timeout, and a routing
    it heard that was never stored is put right. Most tasks end sooner and cost nothing. Run
    it as a task; cancel to stop."""
    limit = asyncio.Semaphore(RECHECK_PARALLEL)

    async def read(task_id: str) -> tuple[TaskRouted | None, list[Sourced]]:
        routed = await last_on(js, task_event(task_id, "routed"))
        event = task_event_decoder.decode(routed) if routed is not None else None
        return (event if isinstance(event, TaskRouted) else None), await stored_ends(js, task_id)

    async def recheck(task_id: str, waiter: Waiter) -> None:
        async with limit:
            try:
                routed, ends = await asyncio.wait_for(read(task_id), every_s)
            except Exception as exc:  # the bus is away: the next round asks again
                log.info("task's end not read; asking again", task_id=task_id, error=repr(exc))
                return
            if routed is not None:
                waiter.stored_routing(routed.attempt, routed.worker)
            for problem in await waiter.stored(ends):
                log.warning("outcome refused", task_id=task_id, problem=problem)
            if waiter.future.done():
                log.info("task's end read from the stream", task_id=task_id)

    while True:
        await asyncio.sleep(every_s)
        now = time.monotonic()
        due = [
            (task_id, waiter)
            for task_id, waiter in waiters.items()
            if not waiter.future.done() and now - waiter.since >= every_s
        ]
        await asyncio.gather(*(recheck(t, w) for t, w in due))
