"""Helpers for the reaper's tests and benchmarks: watching task events, fake registrations."""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import Callable, Sequence
from contextlib import suppress
from types import TracebackType
from typing import Self

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.api import DeliverPolicy
from nats.js.errors import NotFoundError

from schemas.events import TaskEvent, kind_of, task_event_decoder
from schemas.subjects import EVENTS_STREAM, TASKS_STREAM
from schemas.tasks import TaskMessage, task_decoder
from schemas.workers import Capability, WorkerRecord
from services.runtime.bus import ensure_streams

MODEL = "qwen2.5:0.5b"


class TaskEvents:
    """Every task event stored while it listens, in the stream's order.

    It reads the ``EVENTS`` stream (an ordered consumer from new messages on), not the core
    subjects: a publish the stream refused (a stale attempt's fenced ``started``) reaches core
    subscribers too, but it is not an event.
    """

    def __init__(self, nc: Client) -> None:
        self.nc = nc
        self.events: list[TaskEvent] = []
        self._changed = asyncio.Event()
        self._sub: Subscription | None = None

    async def __aenter__(self) -> Self:
        self._sub = await self.nc.jetstream().subscribe(
            "events.task.>",
            stream=EVENTS_STREAM,
            ordered_consumer=True,
            deliver_policy=DeliverPolicy.NEW,
            cb=self._on,
        )
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._sub is not None:
            with suppress(Exception):
                await self._sub.unsubscribe()

    async def _on(self, msg: Msg) -> None:
        self.events.append(task_event_decoder.decode(msg.data))
        self._changed.set()

    async def ended(self, task_id: str, kind: str) -> TaskEvent:
        """The task's ``kind`` end (``completed``, ``failed``) once this feed has it: a reply
        can reach its client before the event reaches this consumer, and every event stored
        before that end is then here too (the stream's order)."""
        return await self.wait_for(lambda e: e.task_id == task_id and kind_of(e) == kind)

    def of(self, task_id: str, kind: str | None = None) -> list[TaskEvent]:
        return [
            e for e in self.events if e.task_id == task_id and (kind is None or kind_of(e) == kind)
        ]

    async def wait_for(
        self, predicate: Callable[[TaskEvent], bool], timeout_s: float = 15.0
    ) -> TaskEvent:
        """The first event (seen so far or to come) that ``predicate`` accepts."""
        deadline = time.monotonic() + timeout_s
        while True:
            for event in self.events:
                if predicate(event):
                    return event
            left = deadline - time.monotonic()
            if left <= 0:
                kinds = [(e.task_id[-6:], kind_of(e)) for e in self.events]
                raise AssertionError(f"no such event within {timeout_s} s; seen: {kinds}")
            self._changed.clear()
            with suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), timeout=left)

    async def first(
        self, kind: str, task_id: str | None = None, timeout_s: float = 15.0
    ) -> TaskEvent:
        """The first event of ``kind`` (of ``task_id``, when given)."""
        return await self.wait_for(
            lambda e: kind_of(e) == kind and (task_id is None or e.task_id == task_id), timeout_s
        )


class Registration:
    """A registry entry for ``worker_id`` that heartbeats with no process pulling its queue: a
    worker registered but not pulling (a ghost), or, once `silence`d, a dead one."""

    def __init__(
        self,
        nc: Client,
        worker_id: str,
        *,
        supports: Sequence[Capability] = ("cpu_inference",),
        models: Sequence[str] = (MODEL,),
        interval_s: float = 0.5,
    ) -> None:
        self.nc = nc
        self.record = WorkerRecord(
            worker_id=worker_id,
            host=f"host-{worker_id}",
            instance_id=uuid.uuid4().hex[:12],
            pid=os.getpid(),
            version="test",
            supports=list(supports),
            models=list(models),
            started_at=time.time(),
            heartbeat_at=time.time(),
        )
        self.interval_s = interval_s
        self._beating: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Self:
        kv = await ensure_streams(self.nc.jetstream())

        async def beat() -> None:
            while True:
                record = msgspec.structs.replace(self.record, heartbeat_at=time.time())
                await kv.put(self.record.worker_id, msgspec.json.encode(record))
                await asyncio.sleep(self.interval_s)

        self._beating = asyncio.create_task(beat())
        await asyncio.sleep(0.05)
        return self

    def silence(self) -> None:
        """Stop heartbeating, as a process killed with SIGKILL would."""
        if self._beating is not None:
            self._beating.cancel()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.silence()


async def queued_messages(nc: Client, queue: str) -> list[tuple[TaskMessage, int]]:
    """Every task message on ``queue`` still in ``TASKS``, with its stream sequence."""
    js = nc.jetstream()
    found: list[tuple[TaskMessage, int]] = []
    seq = 1
    while True:
        try:
            raw = await js.get_msg(TASKS_STREAM, seq=seq, subject=queue, next=True)
        except NotFoundError:
            return found
        seq = raw.seq or seq
        found.append((task_decoder.decode(raw.data or b""), seq))
        seq += 1


async def queued_copies(nc: Client, queue: str) -> list[tuple[str, int]]:
    """(task id, attempt) of every message on ``queue`` still in ``TASKS``."""
    return [(message.task_id, message.attempt) for message, _ in await queued_messages(nc, queue)]


async def no_live_worker_serving(nc: Client, model: str) -> None:
    """A worker serving ``model`` that the routers heard from and that then fell silent (its
    heartbeats stalled with the registry's election, or it was cut off): known, not live."""
    async with Registration(nc, "cpu-silent", models=(model,)) as silent:
        await asyncio.sleep(1.0)
        silent.silence()
    await asyncio.sleep(3.5)  # older than WORKER_TTL_S
