"""A service's feed of the ``workers`` bucket, and whether its view of it has settled.

The router, the reaper and the gateway (its dashboard and metrics) each keep a view of the
registry, and each judges from it whether a worker is live. The KV watch
(`services.runtime.watch.follow_bucket`) feeds `RegistryFeed.on_entry`; a new connection to
NATS (noticed by the watch as it starts again, or by a caller that comes first) makes the view
settle again (`services.fleet.settling`), and so does a registry that stores no heartbeats
while the connection stays up (`services.runtime.stall`). Until it has, no worker is judged
not live: the router answers a request no live worker could take `Unavailable` (retryable,
with a hint of when to retry) instead of ``no_worker``, the reaper moves nothing, and the
dashboard shows no worker ``lost``, since the worker may well be live, its fresh heartbeat not
read yet.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from typing import Protocol

import structlog
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from schemas.workers import WorkerRecord, worker_record_decoder
from services.errors import Unavailable
from services.fleet.settling import SettlingTracker
from services.runtime.lifecycle import TaskSet
from services.runtime.stall import look_once, watch_stalls
from services.runtime.watch import BucketCursor, follow_bucket, reconnects, value_of


class WorkersView(Protocol):
    """What a feed keeps: a view's registered workers."""

    def put_worker(self, record: WorkerRecord) -> None: ...

    def remove_worker(self, worker_id: str) -> None: ...

    def records(self) -> Iterable[WorkerRecord]: ...


class RegistryFeed:
    """Keeps ``view``'s workers from the bucket's entries, and the view's settling. ``role``
    names the service in what it logs and refuses."""

    def __init__(self, nc: Client, view: WorkersView, ttl_s: float, role: str) -> None:
        self.nc = nc
        self.view = view
        self.ttl_s = ttl_s
        self.role = role
        self.log = structlog.get_logger(role)
        # A fresh start awaits nobody: the first full read of the bucket is the registry.
        self.settling = SettlingTracker(reconnects(nc), time.time())
        self.cursor = BucketCursor(nc)  # how far the watch has read (`services.runtime.stall`)

    def follow(
        self, js: JetStreamContext, kv: KeyValue, ready: asyncio.Event, tasks: TaskSet
    ) -> None:
        """Watch the bucket, and whether it stalls, in ``tasks``; ``ready`` is set once the
        bucket has been read."""
        tasks.spawn(
            follow_bucket(
                self.nc,
                kv,
                self.on_entry,
                ready,
                on_watch=self.on_watch,
                on_read=self.on_read,
                cursor=self.cursor,
            ),
            name="watch-workers",
        )
        tasks.spawn(
            watch_stalls(js, self.settling, self.view.records, self.cursor, self.ttl_s),
            name="registry-stalls",
        )

    def on_entry(self, entry: KeyValue.Entry) -> None:
        if (value := value_of(entry)) is None:
            self.view.remove_worker(entry.key)
            self.settling.remove(entry.key)
        else:
            record = worker_record_decoder.decode(value)
            self.view.put_worker(record)
            self.settling.put(record)

    def on_watch(self, generation: int) -> None:
        """A watch starts on connection ``generation``: after a reconnect, settle again."""
        self.notice_reconnect(time.time(), generation)

    def on_read(self, generation: int) -> None:
        self.settling.read(generation)

    def notice_reconnect(self, now: float, generation: int | None = None) -> None:
        """A new connection to NATS makes the view settle again, waiting for the workers
        that were live when the bus went quiet."""
        current = reconnects(self.nc) if generation is None else generation
        if self.settling.reconnected(current, now, self.view.records(), self.ttl_s):
            self.log.info(
                "reading the registry again after a reconnect",
                awaited=sorted(self.settling.state.awaited),
                within_s=self.ttl_s,
            )

    def settled(self, now: float) -> bool:
        """May a worker be judged not live at ``now``: may the router say that no live
        worker can take a request, may the reaper move a worker's tasks, may the dashboard
        show a worker ``lost``?"""
        self.notice_reconnect(now)
        return self.settling.settled(now, self.ttl_s)

    async def look_again(self, js: JetStreamContext) -> None:
        """Before a verdict that no live worker can take a request: a quiet registry is
        asked at once whether it stalled, or its watch fell behind (`services.runtime.stall`),
        so a view read on the wrong side of a partition that just healed is not believed."""
        await look_once(js, self.settling, self.view.records, self.cursor, self.ttl_s)

    def refuse_while_settling(self, now: float, what: str) -> None:
        """Raise `Unavailable` if the view has not settled: ``what`` cannot be told yet."""
        if self.settled(now):
            return
        retry_s = self.settling.retry_after_s(now, self.ttl_s)
        raise Unavailable(
            f"the {self.role} is reading the worker registry again (after a reconnect to NATS, or "
            f"while it stored no heartbeats), so it cannot tell yet whether {what}; retry in "
            f"{retry_s} s"
        )
