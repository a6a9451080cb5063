"""A key of a KV bucket held as a lease: one live process per worker id (lesson 2), one
acting instance per active/standby role (`services.runtime.leadership`).

One rule for both: a process ``create``s the key to take it; if the key exists and its
holder's heartbeat is fresh (`services.fleet.liveness`), it is refused, else it takes the
key over with ``update(last=revision)``. Each heartbeat ``update``s the key with the expected
revision, so when another process has taken the key over the update fails and this one knows
it must stop. The bucket's TTL frees the key of a process that died without a word. A holder
whose heartbeats have not been stored for nearly a TTL (`KeyLease.in_touch`) stops its work
before anyone may judge its entry stale and take over.

`KeyLease` is the rule; `Lease` is a worker's registry entry, which refuses a second process
with the same worker id naming the live one.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from contextlib import suppress
from typing import Any, Generic, Protocol, TypeVar

import msgspec
import structlog
from nats.js import JetStreamContext
from nats.js.errors import APIError, KeyWrongLastSequenceError, NotFoundError
from nats.js.kv import KeyValue

from schemas.events import WorkerStopped
from schemas.workers import WorkerRecord, worker_record_decoder
from services.errors import DuplicateWorker, LeaseLost
from services.fleet.liveness import in_touch, is_fresh, is_live
from services.runtime.bus import is_wrong_last_sequence, publish_event

# The lease's errors are defined in the catalogue (`services.errors`) and exported
# from here too, where their callers look for them.

log = structlog.get_logger("lease")

_encoder = msgspec.json.Encoder()


class HolderRecord(Protocol):
    """What a lease's value must say: whose it is, and when it was last renewed."""

    @property
    def instance_id(self) -> str: ...

    @property
    def heartbeat_at(self) -> float: ...


R = TypeVar("R", bound=HolderRecord)


class _Holder(msgspec.Struct, frozen=True):
    """The two fields of any lease value the rule needs (a view: the rest is ignored)."""

    instance_id: str
    heartbeat_at: float


_holder_decoder = msgspec.json.Decoder(_Holder)


class KeyLease(Generic[R]):
    """This process's hold on ``key`` in ``kv``; ``record()`` is the value each write stores
    (this instance's, with the time of the write as ``heartbeat_at``). ``log_fields`` name
    the lease in log lines."""

    def __init__(
        self,
        kv: KeyValue,
        key: str,
        ttl_s: float,
        record: Callable[[], R],
        log_fields: dict[str, Any] | None = None,
    ) -> None:
        self.kv = kv
        self.key = key
        self.ttl_s = ttl_s
        self.record = record
        self.log_fields = log_fields if log_fields is not None else {"key": key}
        self.revision: int | None = None
        self.lost = asyncio.Event()
        # When the last entry the server stored was written (its ``heartbeat_at``): what every
        # other process judges this holder's freshness by.
        self.stored_at: float | None = None

    def holder_live(self, value: bytes, now: float) -> bool:
        """Does the entry ``value`` belong to a live holder (its heartbeat fresh)?"""
        try:
            holder = _holder_decoder.decode(value)
        except msgspec.DecodeError:
            return False  # not a lease value at all: nobody holds it
        return is_fresh(holder.heartbeat_at, now, self.ttl_s)

    async def take(self) -> bytes | None:
        """Take the key: None once it is this process's; the live holder's entry when that
        holder refuses it (the key is left as it is)."""
        self.lost.clear()
        self.revision = None
        record = self.record()
        value = _encoder.encode(record)
        try:
            self.revision = await self.kv.create(self.key, value)
            self.stored_at = record.heartbeat_at
            return None
        except KeyWrongLastSequenceError:
            pass
        entry = await self.kv.get(self.key)
        held = entry.value or b""
        if self.holder_live(held, time.time()) and not self._mine(held):
            return held
        # The holder is gone but its entry has not expired yet (or it is this instance's own,
        # from before it stopped for want of touch): take it over.
        self.revision = await self.kv.update(self.key, value, last=entry.revision)
        self.stored_at = record.heartbeat_at
        return None

    async def renew(self) -> None:
        """Refresh the entry; raise `LeaseLost` (and set ``lost``) when another process took it."""
        record = self.record()
        try:
            self.revision = await self.kv.update(
                self.key, _encoder.encode(record), last=self.revision
            )
            self.stored_at = record.heartbeat_at
        except (KeyWrongLastSequenceError, NotFoundError) as exc:
            if await self._still_mine():
                return
            self.lost.set()
            raise LeaseLost(f"lease of {self.describe()} lost: {exc}") from exc

    def describe(self) -> str:
        """The lease as log lines and errors name it."""
        return f"'{self.key}'"

    def in_touch(self, now: float, interval_s: float) -> bool:
        """May the holder go on working (`services.fleet.liveness.in_touch`)?"""
        return self.stored_at is not None and in_touch(self.stored_at, now, self.ttl_s, interval_s)

    async def _still_mine(self) -> bool:
        """After a refused update: hold the key again if nobody else does.

        With a TTL of a few seconds, a nats-server restart can outlast the entry (nobody holds
        the key then: create it again), and a reconnect can lose the acknowledgement of an
        update that was stored (the entry is this instance's, at a newer revision). Only an
        entry of another instance means the lease was taken.
        """
        record = self.record()
        try:
            entry = await self.kv.get(self.key)
        except NotFoundError:  # expired or deleted
            try:
                self.revision = await self.kv.create(self.key, _encoder.encode(record))
            except KeyWrongLastSequenceError:
                return False  # another instance created it first
            self.stored_at = record.heartbeat_at
            log.warning("lease entry had expired (bus outage?); taken again", **self.log_fields)
            return True
        if not self._mine(entry.value or b""):
            return False
        self.revision = await self.kv.update(self.key, _encoder.encode(record), last=entry.revision)
        self.stored_at = record.heartbeat_at
        return True

    def _mine(self, value: bytes) -> bool:
        try:
            return _holder_decoder.decode(value).instance_id == self.record().instance_id
        except msgspec.DecodeError:
            return False

    async def keep(self, interval_s: float) -> None:
        """Renew every ``interval_s`` until the lease is lost (run it as a task, cancel to stop).

        The beats keep their period from send to send, not from an answer to the next send: a
        slow round trip delays one beat, not every one after it. (A beat waits for the one
        before it, since each update names the revision the last one made: over a round trip
        longer than the interval, the period is the round trip.)
        """
        clock = asyncio.get_running_loop()
        next_beat = clock.time() + interval_s
        while not self.lost.is_set():
            await asyncio.sleep(max(0.0, next_beat - clock.time()))
            next_beat = max(next_beat + interval_s, clock.time())
            try:
                await self.renew()
            except LeaseLost as exc:
                log.error("lease lost; stopping", error=exc.message, **self.log_fields)
                return
            except Exception as exc:  # the bus is reconnecting: try again next beat
                log.warning("heartbeat failed", error=repr(exc), **self.log_fields)

    async def release(self) -> None:
        """Delete the entry if this process still holds it.

        A heartbeat cancelled in flight may have been stored without this process learning its
        revision: then the entry is read again, and deleted if it is still this instance's.
        """
        if self.lost.is_set() or self.revision is None:
            return
        with suppress(Exception):
            try:
                await self.kv.delete(self.key, last=self.revision)
            except APIError as exc:
                if not is_wrong_last_sequence(exc):
                    raise
                entry = await self.kv.get(self.key)
                if self._mine(entry.value or b""):
                    await self.kv.delete(self.key, last=entry.revision)


class Lease(KeyLease[WorkerRecord]):
    """This worker process's hold on ``worker_id`` in the ``workers`` bucket."""

    def __init__(
        self, kv: KeyValue, worker_id: str, ttl_s: float, record: Callable[[], WorkerRecord]
    ) -> None:
        super().__init__(kv, worker_id, ttl_s, record, log_fields={"worker_id": worker_id})
        self.worker_id = worker_id

    def holder_live(self, value: bytes, now: float) -> bool:
        """A worker is live while its heartbeat is fresh and it is not stopping (`is_live`)."""
        return is_live(worker_record_decoder.decode(value), now, self.ttl_s)

    def describe(self) -> str:
        return f"worker '{self.worker_id}'"

    async def acquire(self) -> None:
        """Take the key, or raise `DuplicateWorker` naming the live holder."""
        held = await self.take()
        if held is None:
            return
        holder = worker_record_decoder.decode(held)
        age = time.time() - holder.heartbeat_at
        started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(holder.started_at))
        raise DuplicateWorker(
            f"worker id '{self.worker_id}' is already running: host {holder.host}, "
            f"pid {holder.pid}, started {started}, last heartbeat {age:.1f} s ago. Stop that "
            "instance first (two units starting the same worker make every task twice as slow)."
        )


async def deregister(lease: Lease | None, js: JetStreamContext, reason: str) -> None:
    """Give the worker id up (`Lease.release`) and record why (``stopped``, best effort)."""
    if lease is None:
        return
    await lease.release()
    with suppress(Exception):
        await publish_event(
            js,
            WorkerStopped(
                at=time.time(),
                worker_id=lease.worker_id,
                instance_id=lease.record().instance_id,
                reason=reason,
            ),
        )
