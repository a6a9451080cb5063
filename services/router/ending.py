"""Waiting for a task's end on behalf of its client, and asking the stream for an end the
router's subscription missed."""

from __future__ import annotations

import asyncio

from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from schemas.events import TERMINAL_KINDS, TaskCompleted, TaskFailed, task_event_decoder
from schemas.subjects import EVENTS_STREAM, task_event
from services.router.records import latest_outcome
from services.runtime.errors import WaitTimeout


async def wait_for_end(
    js: JetStreamContext,
    task_id: str,
    waiter: asyncio.Future[TaskCompleted | TaskFailed],
    timeout_s: float,
) -> TaskCompleted | TaskFailed:
    """The task's outcome as ``waiter`` gets it, or as the stream has it after ``timeout_s``;
    `WaitTimeout` when it has none."""
    try:
        # asyncio.timeout, not wait_for over a shield: three fewer hand-offs through the
        # loop per reply. A timeout cancels the future; nothing settles it afterwards.
        async with asyncio.timeout(timeout_s):
            return await waiter
    except TimeoutError:
        pass
    # The end event may have been missed during a reconnect: ask the stream itself (the
    # latest attempt's outcome, if the task was moved on).
    outcome = latest_outcome(await stored_ends(js, task_id))
    if outcome is not None:
        return outcome
    raise WaitTimeout(
        f"task {task_id} has not ended after {timeout_s:.0f} s; it may still finish: "
        f"ask coordinator.task for {task_id}"
    )


async def stored_ends(js: JetStreamContext, task_id: str) -> list[TaskCompleted | TaskFailed]:
    """The last outcome event of each kind the ``EVENTS`` stream holds for the task."""
    ended: list[TaskCompleted | TaskFailed] = []
    for kind in TERMINAL_KINDS:
        try:
            stored = await js.get_last_msg(EVENTS_STREAM, task_event(task_id, kind))
        except NotFoundError:
            continue
        event = task_event_decoder.decode(stored.data or b"")
        if isinstance(event, TaskCompleted | TaskFailed):
            ended.append(event)
    return ended
