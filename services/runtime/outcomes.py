"""A task attempt's life on the bus, for every service that runs tasks.

Storing an outcome once (a message id per attempt, so a retried publish, a redelivered task or
a second process racing for the same attempt stores one outcome: the first), finding what a
task's stream already holds, and keeping a long task's message from being redelivered.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import suppress
from types import TracebackType
from typing import Self

import structlog
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from schemas.events import (
    TERMINAL_KINDS,
    TaskCompleted,
    TaskFailed,
    TaskStarted,
    task_event_decoder,
)
from schemas.subjects import EVENTS_STREAM, task_event
from services.runtime.bus import publish_event

log = structlog.get_logger("outcomes")

# How many times an outcome event is tried before giving up (the caller returns the task).
OUTCOME_PUBLISH_TRIES = 5


def outcome_msg_id(task_id: str, attempt: int) -> str:
    """One id for every outcome of one attempt: JetStream keeps the first, drops the others."""
    return f"{task_id}:{attempt}:outcome"


async def store_outcome(
    js: JetStreamContext,
    outcome: TaskCompleted | TaskFailed,
    *,
    tries: int = OUTCOME_PUBLISH_TRIES,
    first_delay_s: float = 0.2,
) -> None:
    """Publish ``outcome`` with its attempt's message id, retrying with backoff; raise at last."""
    delay = first_delay_s
    for attempt in range(tries):
        try:
            await publish_event(
                js, outcome, msg_id=outcome_msg_id(outcome.task_id, outcome.attempt)
            )
            return
        except Exception as exc:
            if attempt == tries - 1:
                raise
            log.warning(
                "storing the outcome failed; retrying", task_id=outcome.task_id, error=repr(exc)
            )
            await asyncio.sleep(delay)
            delay *= 2


async def stored_outcome(
    js: JetStreamContext, task_id: str, attempt: int
) -> TaskCompleted | TaskFailed | None:
    """The outcome stored for this attempt of the task or a later one, if there is one."""
    for kind in TERMINAL_KINDS:
        try:
            stored = await js.get_last_msg(EVENTS_STREAM, task_event(task_id, kind))
        except NotFoundError:
            continue
        event = task_event_decoder.decode(stored.data or b"")
        if isinstance(event, TaskCompleted | TaskFailed) and event.attempt >= attempt:
            return event
    return None


async def last_started(js: JetStreamContext, task_id: str, attempt: int) -> TaskStarted | None:
    """The latest ``started`` of this attempt: who began it, on which host, when."""
    try:
        stored = await js.get_last_msg(EVENTS_STREAM, task_event(task_id, "started"))
    except NotFoundError:
        return None
    event = task_event_decoder.decode(stored.data or b"")
    if isinstance(event, TaskStarted) and event.attempt == attempt:
        return event
    return None


class KeepAlive:
    """Tells JetStream a task is still being worked on, so its message is not redelivered.

    ``in_progress()`` goes out at most every ``ack_wait_s / 3``: on `progress` (call it as
    output arrives) and, while the work is silent (loading a model, waiting for a slow
    server), from a background loop. A failed ``in_progress()`` (the bus is reconnecting) is
    logged, never raised into the work. Use as ``async with KeepAlive(msg, ack_wait_s) as alive``.
    """

    def __init__(self, msg: Msg, ack_wait_s: float) -> None:
        self.msg = msg
        self.interval_s = ack_wait_s / 3
        self._last = time.monotonic()
        self._loop: asyncio.Task[None] | None = None

    async def progress(self) -> None:
        """Signal life if the last signal is older than the interval."""
        if time.monotonic() - self._last < self.interval_s:
            return
        self._last = time.monotonic()
        try:
            await self.msg.in_progress()
        except Exception as exc:
            log.warning("in_progress failed", subject=self.msg.subject, error=repr(exc))

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.progress()

    async def __aenter__(self) -> Self:
        self._last = time.monotonic()
        self._loop = asyncio.create_task(self._beat())
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._loop is not None:
            self._loop.cancel()
            with suppress(asyncio.CancelledError):
                await self._loop
