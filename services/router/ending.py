"""Waiting for a task's end on behalf of its client, and asking the stream for an end the
router's subscription missed."""

from __future__ import annotations

import asyncio

from nats.js import JetStreamContext

from schemas.events import TaskCompleted, TaskFailed
from services.router.records import latest_outcome
from services.router.waiting import Waiter
from services.runtime.errors import WaitTimeout
from services.runtime.outcomes import stored_ends


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
        for event, source in await stored_ends(js, task_id)
        if isinstance(event, TaskCompleted | TaskFailed) and waiter.refusal(event, source) is None
    ]
    outcome = latest_outcome(ends)
    if outcome is not None:
        return outcome
    raise WaitTimeout(
        f"task {task_id} has not ended after {timeout_s:.0f} s; it may still finish: "
        f"ask coordinator.task for {task_id}"
    )
