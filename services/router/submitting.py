"""A decided task while its route request is handled: followed from before it is queued,
queued (`services.router.submit`), its sleeping worker woken (`services.router.waking`), and
its end waited for on behalf of a client that waits (`services.router.ending`)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager, suppress
from typing import Final

import structlog
from nats.aio.client import Client

from schemas.events import TaskCompleted, TaskFailed, encoder
from schemas.route import CHUNK_HEADER, StreamChunk
from schemas.subjects import task_event
from schemas.tasks import is_retryable
from services.fleet.binding import Supports
from services.router.decide import Submission
from services.router.ending import wait_for_end
from services.router.relay import ChunkRelay
from services.router.settings import RouterSettings
from services.router.submit import submit
from services.router.waiting import Tracking, Waiter, let_go
from services.router.waking import Waker
from services.runtime.bus import fences_by_subject
from services.runtime.endpoints import reply_subject

log = structlog.get_logger("router")

# Extra time a waiting request allows beyond the task's own timeout: queueing and event delivery.
WAIT_MARGIN_S: Final = 30.0


class Submitter:
    """Submits the router's decided tasks, and registers what follows each one in the
    router's ``waiters`` (task id -> waiter) and ``waiting_on`` (reply subject -> task id)."""

    def __init__(
        self,
        nc: Client,
        settings: RouterSettings,
        waker: Waker,
        relay: ChunkRelay,
        *,
        waiters: dict[str, Waiter],
        waiting_on: dict[str, str],
        moves_on: Callable[[], Awaitable[bool]],
        supports: Supports,
    ) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.settings = settings
        self.waker = waker
        self.relay = relay
        self.waiters = waiters
        self.waiting_on = waiting_on
        self.moves_on = moves_on
        self.supports = supports

    @asynccontextmanager
    async def tracking(self, task: Submission) -> AsyncIterator[Tracking]:
        """Follow the task while its request is handled: a woken worker's start is watched
        from before the task is queued, and a waiting client's end is registered before
        anything is published, so neither can be missed. Dropped when the request is done."""
        tracking = Tracking()
        if task.plan.waking is not None:
            tracking.started = await self.nc.subscribe(
                task_event(task.task_id, "started", task.plan.waking.worker_id), max_msgs=1
            )
        if task.waits:
            tracking.waiter = Waiter(
                retryable_kind=is_retryable(task.request.task_type),
                moves_on=self.moves_on,
                routed_to=task.decision.worker_id,
                supports=self.supports,
            )
            self.waiters[task.task_id] = tracking.waiter
            tracking.waiting_on = reply_subject.get()
            if tracking.waiting_on:
                self.waiting_on[tracking.waiting_on] = task.task_id
        if task.stream_subject:
            self.relay.open(task.task_id, task.stream_subject)
        try:
            yield tracking
        finally:
            if tracking.started is not None:
                with suppress(Exception):
                    await tracking.started.unsubscribe()
            if tracking.waiter is not None:
                tracking.waiter.close()
            self.waiters.pop(task.task_id, None)
            let_go(self.waiting_on, tracking.waiting_on, task.task_id)
            self.relay.close(task.task_id)

    async def submit(self, task: Submission, tracking: Tracking) -> int:
        """Queue the task (a stream first learns its id) and wake the sleeping worker it goes
        to; returns its message's sequence in ``TASKS``."""
        if task.stream_subject:
            # Before the task is queued, so it comes before any output (one connection keeps
            # the order): the client learns the task id and can cancel it from now on.
            await self.nc.publish(
                task.stream_subject,
                encoder.encode(StreamChunk(task_id=task.task_id, seq=0)),
                headers={CHUNK_HEADER: "0"},
            )
        seq = await submit(self.js, task, fences=fences_by_subject(self.nc))
        sleeper = task.plan.waking
        if sleeper is not None:
            assert tracking.started is not None
            await self.waker.wake(sleeper, task.task_id, task.request.model, seq, tracking.started)
            tracking.started = None  # watched by the wake's own task from now on
        decision = task.decision
        log.info(
            "routed",
            task_id=task.task_id,
            model=task.request.model,
            worker=decision.worker_id,
            queue=decision.queue,
            reason=decision.reason,
            subject=decision.queue,
            stream_seq=seq,
        )
        return seq

    async def wait(self, task: Submission, waiter: Waiter) -> TaskCompleted | TaskFailed:
        """The task's outcome, allowing its timeout, a woken worker's wake and a margin."""
        wake_s = self.settings.wake_wait_s if task.plan.waking is not None else 0.0
        budget_s = task.timeout_s + wake_s + WAIT_MARGIN_S
        return await wait_for_end(self.js, task.task_id, waiter, budget_s)
