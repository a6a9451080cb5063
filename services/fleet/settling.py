"""Is a view of the registry settled enough to say a worker is not live? Pure: no I/O, no clock.

A view of the ``workers`` bucket (the router's, the reaper's) is built from a KV watch. While
the bus is away no heartbeat arrives, and after a reconnect the watch first hands back each
worker's last value from *before* the outage: judged by those, a live worker looks dead (the
incident behind this rule: a graceful nats-server restart, four workers alive, and 2.8 s later
the reaper failed tasks as ``ghost_pending`` with no alternative worker while the router said
``no_worker``). So a verdict that depends on a worker *not* being live (no worker serves the
model, the worker is dead, nobody pulls the queue, no alternative worker) waits until the view
has settled:

- the bucket has been read in full on the current connection, and
- every worker it is waiting for (`awaited_after_outage`: those live when the bus went quiet;
  at a start, those the caller names) has heartbeated again, or ``WORKER_TTL_S`` has passed
  since the (re)connect: by then a worker that has not heartbeated is dead by the one rule
  (`services.fleet.liveness`).

A fresh start waits for nothing but the read when nobody is awaited: the bucket's current
values are the registry, so a router started beside a running fleet serves at once.

A verdict that a worker *is* live (route to it, move a task to it) needs no wait: a fresh
heartbeat is fresh whatever the outage did.

The registry can also stall while the connection stays up: a cluster electing the bucket's
leader (seconds, longer than a TTL) stores no heartbeat at all. A view that has heard from no
worker for a third of a TTL (`is_quiet`) asks whether the bucket takes writes; while it does not,
the view settles again (`SettlingTracker.wait_for`, with `awaited_after_outage`), as after a
reconnect (`services.runtime.stall`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from schemas.workers import WorkerRecord
from services.fleet.liveness import is_fresh

# The least ``Retry-After`` hint given while a view settles (seconds; a header is whole seconds).
MIN_RETRY_AFTER_S = 1


@dataclass(frozen=True, slots=True)
class Settling:
    """One settling of a view: since when, on which connection, and whom it waits for."""

    since: float
    """When the (re)connect was noticed (the start, for the first connection)."""
    generation: int
    """The connection it is for (`services.runtime.watch.reconnects`)."""
    awaited: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))
    """Worker id -> the heartbeat time the view had for it when this settling began: a later
    heartbeat (by the worker's own clock, so no skew between hosts) is news from after it."""
    read: bool = False
    """Has the bucket been read in full on this connection?"""


def begin(generation: int, now: float, awaited: Mapping[str, float] | None = None) -> Settling:
    """A settling from ``now`` on connection ``generation``, waiting for ``awaited``."""
    return Settling(since=now, generation=generation, awaited=MappingProxyType(dict(awaited or {})))


def awaited_after_outage(records: Iterable[WorkerRecord], ttl_s: float) -> dict[str, float]:
    """The workers a view waits to hear from after a reconnect: those live when the bus went
    quiet. That moment is taken as the newest heartbeat the view holds (no clock of this
    process's: nothing was heard after it), so a long outage does not make every worker
    look dead, and an entry that was stale before it (a dead worker's) is not waited for."""
    running = [r for r in records if r.state != "stopping"]
    if not running:
        return {}
    quiet_at = max(r.heartbeat_at for r in running)
    fresh = (r for r in running if is_fresh(r.heartbeat_at, quiet_at, ttl_s))
    return {r.worker_id: r.heartbeat_at for r in fresh}


def is_quiet(records: Iterable[WorkerRecord], now: float, ttl_s: float) -> bool:
    """Has a view with running workers heard from none of them for a third of a TTL? Each
    live worker heartbeats more than twice a TTL, so a registry this quiet has lost every
    worker at once, or stopped storing heartbeats, or is between two beats of a lone worker:
    worth asking which (cheaply) long before any entry is old enough for a verdict."""
    newest = max((r.heartbeat_at for r in records if r.state != "stopping"), default=None)
    return newest is not None and now - newest >= ttl_s / 3


def heard(settling: Settling, record: WorkerRecord) -> Settling:
    """``record`` arrived: its worker is no longer awaited if it heartbeated since."""
    before = settling.awaited.get(record.worker_id)
    if before is None or record.heartbeat_at <= before:
        return settling
    return _without(settling, record.worker_id)


def gone(settling: Settling, worker_id: str) -> Settling:
    """The worker's entry was deleted (it deregistered): news too, it is awaited no more."""
    return _without(settling, worker_id) if worker_id in settling.awaited else settling


def read_in_full(settling: Settling, generation: int) -> Settling:
    """The bucket has been read in full on connection ``generation``."""
    if generation != settling.generation or settling.read:
        return settling
    return replace(settling, read=True)


def is_settled(settling: Settling, now: float, ttl_s: float) -> bool:
    """May a verdict that a worker is not live be made at ``now``?"""
    return settling.read and (not settling.awaited or now - settling.since >= ttl_s)


def retry_after_s(settling: Settling, now: float, ttl_s: float) -> int:
    """Whole seconds until the view has settled at the latest (a ``Retry-After`` hint)."""
    left = settling.since + ttl_s - now
    return max(MIN_RETRY_AFTER_S, math.ceil(left))


def _without(settling: Settling, worker_id: str) -> Settling:
    awaited = {k: v for k, v in settling.awaited.items() if k != worker_id}
    return replace(settling, awaited=MappingProxyType(awaited))


class SettlingTracker:
    """The settling of one view, kept as the view's feeds report (still no I/O, no clock: the
    caller passes the time and the connection's generation).

    A bucket read may be reported before the reconnect it follows is noticed (the watch and
    the one who notices run apart), so the newest generation read is remembered.
    """

    def __init__(self, generation: int, now: float, awaited: Mapping[str, float] | None = None):
        self.state = begin(generation, now, awaited)
        self._read_generation = -1

    def reconnected(
        self, generation: int, now: float, records: Iterable[WorkerRecord], ttl_s: float
    ) -> bool:
        """Connection ``generation`` is a new one: settle again, waiting for the workers of
        ``records`` (the view as it was) that were live when the bus went quiet. True when it
        was new."""
        if generation <= self.state.generation:
            return False
        self.state = begin(generation, now, awaited_after_outage(records, ttl_s))
        if self._read_generation >= generation:
            self.state = read_in_full(self.state, generation)
        return True

    def wait_for(self, now: float, awaited: Mapping[str, float]) -> None:
        """Settle again from ``now`` on the same connection, waiting for ``awaited`` (a read
        already made on it still counts)."""
        read = self.state.read
        self.state = replace(begin(self.state.generation, now, awaited), read=read)

    def read(self, generation: int) -> None:
        """The bucket was read in full on connection ``generation``."""
        self._read_generation = max(self._read_generation, generation)
        self.state = read_in_full(self.state, generation)

    def put(self, record: WorkerRecord) -> None:
        self.state = heard(self.state, record)

    def remove(self, worker_id: str) -> None:
        self.state = gone(self.state, worker_id)

    def settled(self, now: float, ttl_s: float) -> bool:
        return is_settled(self.state, now, ttl_s)

    def retry_after_s(self, now: float, ttl_s: float) -> int:
        return retry_after_s(self.state, now, ttl_s)
