"""One attempt's pieces that every kind shares: its outcome when cancelled or too large to
store, the cancel notices a worker remembers, and the publisher of its stream chunks, which
sends nothing before the claim."""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from typing import Any

import msgspec
from nats.aio.client import Client

from schemas.events import Durations, TaskCompleted, TaskFailed
from schemas.route import CHUNK_HEADER, CancelNotice, ModelProgress, StreamChunk, ToolCall
from schemas.subjects import chunk_subject
from schemas.tasks import TaskMessage
from services.backends import OnChunk, OnModelProgress
from services.errors import Cancelled, TooLarge

# What headers and the event's own fields add to an outcome beyond its answer: an outcome is
# checked against the server's max_payload with this much room left.
OUTCOME_HEADROOM_BYTES = 1024

# Cancel notices kept for tasks this worker may take later (queued ones); oldest forgotten first.
CANCEL_MEMORY = 1024

_encoder = msgspec.json.Encoder()


class CancelMemory:
    """The cancel notices a worker has heard, by task, so that a task cancelled while queued
    is not run when it arrives. Pure: no I/O.

    A client's cancel stops every attempt; a move's stops the attempts it replaced, so the
    new attempt runs even where it lands on the worker that heard the notice. Of two notices
    for one task the wider is kept."""

    def __init__(self, capacity: int = CANCEL_MEMORY) -> None:
        self.capacity = capacity
        self._notices: OrderedDict[str, CancelNotice] = OrderedDict()

    def remember(self, notice: CancelNotice) -> CancelNotice:
        """Keep ``notice`` (merged with an earlier one for its task); return what is kept."""
        earlier = self._notices.pop(notice.task_id, None)
        kept = notice if earlier is None else _wider(earlier, notice)
        self._notices[notice.task_id] = kept
        while len(self._notices) > self.capacity:
            self._notices.popitem(last=False)
        return kept

    def stopping(self, task_id: str, attempt: int) -> CancelNotice | None:
        """The notice that stops ``attempt`` of ``task_id``, if one was heard."""
        notice = self._notices.get(task_id)
        return notice if notice is not None and notice.stops(attempt) else None


def _wider(a: CancelNotice, b: CancelNotice) -> CancelNotice:
    """Of two notices for one task, the one that stops more attempts (the later on a tie)."""
    if b.up_to_attempt is None:
        return b
    if a.up_to_attempt is None:
        return a
    return a if a.up_to_attempt > b.up_to_attempt else b


def refused(claimed: asyncio.Future[bool]) -> bool:
    """Has the attempt's claim come back refused (a stale copy)?"""
    if not claimed.done() or claimed.cancelled() or claimed.exception() is not None:
        return False
    return not claimed.result()


def fitting(outcome: TaskCompleted | TaskFailed, max_payload: int) -> TaskCompleted | TaskFailed:
    """The outcome, or an explicit failure when the answer is too large to store as one event
    (a huge batch of embeddings, say): never a publish that fails over and over."""
    limit = max_payload - OUTCOME_HEADROOM_BYTES
    size = len(_encoder.encode(outcome))
    if size <= limit:
        return outcome
    return TaskFailed(
        at=time.time(),
        task_id=outcome.task_id,
        attempt=outcome.attempt,
        worker=outcome.worker,
        code=TooLarge.code,
        reason=(
            f"the answer is {size} bytes, over what one event can hold ({limit} bytes: the "
            "NATS server's max_payload less headers); send fewer inputs per request"
        ),
        durations=outcome.durations,
    )


def cancelled(
    task: TaskMessage, worker_id: str, reason: str | None, started: float | None
) -> TaskFailed:
    """The outcome of a task whose client cancelled it (``started``: when its work began, by
    ``time.perf_counter``); not retryable: nobody waits."""
    durations = (
        None if started is None else Durations(total_ms=(time.perf_counter() - started) * 1000)
    )
    return TaskFailed(
        at=time.time(),
        task_id=task.task_id,
        attempt=task.attempt,
        worker=worker_id,
        code=Cancelled.code,
        reason=reason or "cancelled by its client",
        durations=durations,
    )


def chunk_publishers(
    nc: Client, task: TaskMessage, claimed: asyncio.Future[bool], worker_id: str
) -> tuple[OnChunk, OnModelProgress]:
    """Publish each piece of output (and each step of a change to the models) on this
    worker's chunk subject for the task, for the router to pass on (core NATS: a lost chunk
    is only a gap on the screen; the whole answer is in the outcome event), once the
    attempt's claim is stored: a stale copy sends nothing."""
    subject = chunk_subject(worker_id, task.task_id)
    seq = 0

    async def send(**piece: Any) -> None:
        nonlocal seq
        if not claimed.done():
            await asyncio.wait([claimed])
        if claimed.cancelled() or claimed.exception() is not None or not claimed.result():
            return
        seq += 1
        chunk = StreamChunk(task_id=task.task_id, seq=seq, attempt=task.attempt, **piece)
        await nc.publish(subject, _encoder.encode(chunk), headers={CHUNK_HEADER: str(seq)})

    async def output(
        response: str, thinking: str, tool_calls: list[ToolCall] | None = None
    ) -> None:
        await send(response=response, thinking=thinking, tool_calls=tool_calls)

    async def progress(step: ModelProgress) -> None:
        await send(progress=step)

    return output, progress
