"""One task message, from its delivery to its stored outcome: the part of the task loop
(`services.runtime.taskloop`) that every kind's task goes through.

Redelivery settled first (`services.runtime.redelivery`); then the claim and the kind's work
together (a kind that never runs twice waits for the claim); a cancel notice or a refused claim
stops the work; the outcome, checked to fit in one event, is stored, and the caller acks.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable

import msgspec
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.kv import KeyValue
from opentelemetry import trace
from structlog.typing import FilteringBoundLogger

from schemas.events import TaskCompleted, TaskFailed, TaskStarted
from schemas.route import CancelNotice
from schemas.tasks import TaskMessage, task_decoder
from services.backends import Progress
from services.errors import Cancelled
from services.runtime.acks import NAK, TERM, settle
from services.runtime.attempts import (
    CancelMemory,
    cancelled,
    chunk_publishers,
    fitting,
    refused,
)
from services.runtime.outcomes import (
    KeepAlive,
    NotAlone,
    Reads,
    RouterReads,
    attempt_fence,
    claim,
    moved_on,
    store_attempt_outcome,
)
from services.runtime.redelivery import settled
from services.runtime.taskkind import Attempt, Kind, LoopSettings
from services.runtime.tracing import extract_context

log = structlog.get_logger("taskloop")
tracer = trace.get_tracer("coordinator.taskloop")

_task_decoder = task_decoder
_cancel_decoder = msgspec.json.Decoder(CancelNotice)


class TaskRunner:
    """Runs one task message at a time for a kind; knows which task runs and what was cancelled."""

    def __init__(
        self, nc: Client, js: JetStreamContext, kind: Kind, settings: LoopSettings
    ) -> None:
        self.nc = nc
        self.js = js
        # Where the task's events are read: the log itself, or the router for a worker with
        # credentials, which may not read it (`services.runtime.outcomes.RouterReads`).
        self.reads: Reads = RouterReads(nc) if settings.through_router else js
        self.kind = kind
        self.settings = settings
        self.registry: KeyValue | None = None  # the workers bucket, once the loop has it
        self.current_task: str | None = None
        self.current_attempt = 0
        self.current_model: str | None = None
        self.last_activity = time.time()
        self.counts = {"completed": 0, "failed": 0, "cancelled": 0}
        # Set when a stop's grace is over: a kind that can wrap up records what it has.
        self.cut = asyncio.Event()
        # Set by the loop after it lost touch with the bus: the next task's work waits for its
        # claim, since its message may have been delivered before a move took it over.
        self.claim_first = False
        self._work: asyncio.Future[TaskCompleted | TaskFailed] | None = None  # a cancel's
        # Told when the kind's work on a task starts (True) and ends (False): the watchdog
        # (`services.runtime.watchdog`) learns it at once, not at its next tick.
        self.on_working: Callable[[bool], None] = lambda working: None
        # Stores the worker's registry entry now (the loop's lease, once taken).
        self.announce: Progress | None = None
        self._cancels = CancelMemory()  # from `CANCEL_NOTICES`

    @property
    def working(self) -> bool:
        """Is the kind's work on a task under way (a backend call, for inference)?"""
        return self._work is not None and not self._work.done()

    def stop_work(self) -> bool:
        """Stop the kind's work on the running task, if it is under way (the caller then holds
        the task: `services.runtime.touch`); False when there was none to stop."""
        if not self.working:
            return False
        assert self._work is not None
        self._work.cancel()
        return True

    # -- one task ------------------------------------------------------------------------------

    async def handle_traced(self, msg: Msg) -> bool:
        """`handle` in a ``run task`` span continuing the router's trace (``traceparent``)."""
        with tracer.start_as_current_span(
            "run task",
            context=extract_context(msg.headers),
            kind=trace.SpanKind.CONSUMER,
            attributes={"messaging.destination.name": msg.subject},
        ):
            return await self.handle(msg)

    async def handle(self, msg: Msg) -> bool:
        """Run one task message to a stored outcome event: True, and the caller acknowledges
        the message. False when this settled the message already (acked, terminated or
        returned to the queue)."""
        try:
            task = _task_decoder.decode(msg.data)
        except msgspec.DecodeError as exc:
            log.error("dropping undecodable task message", subject=msg.subject, error=str(exc))
            await settle(self.nc, msg, TERM)
            return False
        bound = log.bind(
            task_id=task.task_id,
            attempt=task.attempt,
            subject=msg.subject,
            stream_seq=msg.metadata.sequence.stream,
        )
        assert self.registry is not None
        to_run = await settled(
            self.nc,
            self.js,
            task,
            msg,
            bound=bound,
            registry=self.registry,
            worker_id=self.settings.worker_id,
            runs_twice=self.settings.runs_twice,
            worker_ttl_s=self.settings.worker_ttl_s,
            fence=attempt_fence(self.nc, task),
            reads=self.reads,
        )
        if to_run is None:
            return False
        self.current_task = task.task_id
        self.current_attempt = task.attempt
        self.current_model = task.model
        outcome: TaskCompleted | TaskFailed
        try:
            notice = self._cancels.stopping(task.task_id, task.attempt)
            if notice is not None:
                # Cancelled while queued: not run, and no outcome for a copy that was moved on.
                if notice.up_to_attempt is not None or await moved_on(self.reads, task):
                    bound.warning("stale attempt: the task was moved on; dropped unrun")
                    await settle(self.nc, msg, TERM)
                    return False
                outcome = cancelled(task, self.settings.worker_id, notice.reason, None)
            else:
                # The claim and the work go out together: the backend does not wait a round
                # trip, and a stale copy's work is stopped when its claim is refused. A kind
                # that never runs a task twice waits for the claim: a stale copy does nothing;
                # so does every kind right after the worker was out of touch with the bus.
                alone_after = None if self.settings.runs_twice else to_run.judged_up_to
                claimed = asyncio.ensure_future(
                    claim(
                        self.nc,
                        self.js,
                        self._started(task),
                        task,
                        alone_after=alone_after,
                        reads=self.reads,
                    )
                )
                claimed.add_done_callback(self._stop_if_refused)
                if not self.settings.runs_twice or self.claim_first:
                    self.claim_first = False
                    await claimed  # a claim that cannot be stored returns the task
                try:
                    outcome = await self._attempt(task, msg, claimed, bound)
                    fresh = await claimed
                finally:
                    claimed.cancel()  # a no-op once done
                moved = self._cancels.stopping(task.task_id, task.attempt)
                if not fresh or (moved is not None and moved.up_to_attempt is not None):
                    # Refused, or stopped by the reaper's notice that it moved the task on.
                    bound.warning("stale attempt: the task was moved on; dropped")
                    await settle(self.nc, msg, TERM)
                    return False
            # Stored through any outage, however long: the work is done, and the fence keeps
            # it from counting once the task was moved on meanwhile.
            if not await store_attempt_outcome(
                self.nc,
                self.js,
                task,
                outcome,
                self.settings.worker_id,
                retry_s=math.inf,
                reads=self.reads,
            ):
                bound.warning("stale attempt: the task was moved on while it ran; outcome dropped")
                await settle(self.nc, msg, TERM)
                return False
        except NotAlone as exc:
            bound.warning("the task was begun or ended elsewhere; judged again", error=str(exc))
            await settle(self.nc, msg, NAK, delay_s=1)
            return False
        except Exception as exc:
            # The outcome could not be stored: return the task so it is not lost.
            bound.error("task not finished; returned to the queue", error=repr(exc))
            await settle(self.nc, msg, NAK, delay_s=1)
            return False
        finally:
            self.current_task = None
            self.last_activity = time.time()
        self._count(outcome, bound)
        return True

    def _started(self, task: TaskMessage) -> TaskStarted:
        return TaskStarted(
            at=time.time(),
            task_id=task.task_id,
            attempt=task.attempt,
            worker=self.settings.worker_id,
            host=self.settings.host,
        )

    async def _attempt(
        self,
        task: TaskMessage,
        msg: Msg,
        claimed: asyncio.Future[bool],
        bound: FilteringBoundLogger,
    ) -> TaskCompleted | TaskFailed:
        """The kind's work on a claimed task, kept alive, stoppable by a cancel notice."""
        on_chunk, on_model_progress = (
            chunk_publishers(self.nc, task, claimed, self.settings.worker_id)
            if task.work.stream
            else (None, None)
        )
        started = time.perf_counter()
        notice = self._cancels.stopping(task.task_id, task.attempt)
        if notice is not None or refused(claimed):
            return cancelled(
                task, self.settings.worker_id, notice.reason if notice else None, started
            )
        try:
            async with KeepAlive(msg, self.settings.ack_wait_s) as alive:
                # A future of its own, so a cancel notice can stop the work alone.
                self._work = asyncio.ensure_future(
                    self.kind.run(
                        Attempt(
                            task,
                            alive.progress,
                            on_chunk,
                            self.cut,
                            bound,
                            on_model_progress=on_model_progress,
                            announce=self.announce,
                        )
                    )
                )
                self.on_working(True)  # before the work's first step sends anything
                outcome = await self._work
        except asyncio.CancelledError:
            this = asyncio.current_task()
            if this is not None and this.cancelling():
                raise  # the worker itself is stopping
            notice = self._cancels.stopping(task.task_id, task.attempt)
            if notice is None and not refused(claimed):
                raise
            return cancelled(
                task, self.settings.worker_id, notice.reason if notice else None, started
            )  # a stale copy's is never stored
        finally:
            self._work = None
            self.on_working(False)
        return fitting(outcome, self.nc.max_payload)

    def _stop_if_refused(self, claimed: asyncio.Future[bool]) -> None:
        """A refused claim stops the work at once: the copy is stale."""
        if refused(claimed) and self._work is not None:
            self._work.cancel()

    def _count(self, outcome: TaskCompleted | TaskFailed, bound: FilteringBoundLogger) -> None:
        if isinstance(outcome, TaskCompleted):
            self.counts["completed"] += 1
            fields: dict[str, object] = {"total_ms": round(outcome.durations.total_ms, 1)}
            if outcome.sources is not None:
                fields["sources"] = len(outcome.sources)
            if outcome.note is not None:
                fields["note"] = outcome.note
            bound.info("task done", model=outcome.model, **fields)
        elif outcome.code == Cancelled.code:
            self.counts["cancelled"] += 1
            bound.info("task cancelled", reason=outcome.reason)
        else:
            self.counts["failed"] += 1
            bound.warning("task failed", code=outcome.code, reason=outcome.reason)

    async def on_cancel(self, msg: Msg) -> None:
        """Remember a cancel notice; stop the work if it is for the running task."""
        try:
            notice = _cancel_decoder.decode(msg.data)
        except msgspec.DecodeError:
            return
        self._cancels.remember(notice)
        if (
            notice.task_id == self.current_task
            and notice.stops(self.current_attempt)
            and self._work is not None
        ):
            log.info("cancelling the running task", task_id=notice.task_id, reason=notice.reason)
            self._work.cancel()
