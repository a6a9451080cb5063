"""The registry entry as a lease: one live process per worker id (lesson 2).

A process ``create``s its key at start; if the key exists and its holder's heartbeat is fresh,
the start is refused naming the holder. Each heartbeat ``update``s the key with the expected
revision, so when another process has taken the key over the update fails and this one knows
it must stop. The bucket's TTL frees the key of a process that died without a word.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from contextlib import suppress

import msgspec
import structlog
from nats.js import JetStreamContext
from nats.js.errors import APIError, KeyWrongLastSequenceError, NotFoundError
from nats.js.kv import KeyValue

from schemas.events import WorkerStopped
from schemas.workers import WorkerRecord, worker_record_decoder
from services.fleet.liveness import in_touch, is_live
from services.runtime.bus import is_wrong_last_sequence, publish_event
from services.runtime.errors import DuplicateWorker, LeaseLost

# The lease's errors are defined in the catalogue (`services.runtime.errors`) and exported
# from here too, where their callers look for them.

log = structlog.get_logger("lease")

_encoder = msgspec.json.Encoder()


class Lease:
    """This process's hold on ``worker_id`` in the ``workers`` bucket."""

    def __init__(
        self, kv: KeyValue, worker_id: str, ttl_s: float, record: Callable[[], WorkerRecord]
    ) -> None:
        self.kv = kv
        self.worker_id = worker_id
        self.ttl_s = ttl_s
        self.record = record
        self.revision: int | None = None
        self.lost = asyncio.Event()
        # When the last entry the server stored was written (its ``heartbeat_at``): what every
        # other service judges this worker's liveness by.
        self.stored_at: float | None = None

    async def acquire(self) -> None:
        """Take the key, or raise `DuplicateWorker` naming the live holder."""
        record = self.record()
        value = _encoder.encode(record)
        try:
            self.revision = await self.kv.create(self.worker_id, value)
            self.stored_at = record.heartbeat_at
            return
        except KeyWrongLastSequenceError:
            pass
        entry = await self.kv.get(self.worker_id)
        holder = worker_record_decoder.decode(entry.value or b"")
        now = time.time()
        if is_live(holder, now, self.ttl_s):
            age = now - holder.heartbeat_at
            started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(holder.started_at))
            raise DuplicateWorker(
                f"worker id '{self.worker_id}' is already running: host {holder.host}, "
                f"pid {holder.pid}, started {started}, last heartbeat {age:.1f} s ago. Stop that "
                "instance first (two units starting the same worker make every task twice as slow)."
            )
        # The holder is gone but its entry has not expired yet: take it over.
        self.revision = await self.kv.update(self.worker_id, value, last=entry.revision)
        self.stored_at = record.heartbeat_at

    async def renew(self) -> None:
        """Refresh the entry; raise `LeaseLost` (and set ``lost``) when another process took it."""
        record = self.record()
        try:
            self.revision = await self.kv.update(
                self.worker_id, _encoder.encode(record), last=self.revision
            )
            self.stored_at = record.heartbeat_at
        except (KeyWrongLastSequenceError, NotFoundError) as exc:
            if await self._still_mine():
                return
            self.lost.set()
            raise LeaseLost(f"lease of worker '{self.worker_id}' lost: {exc}") from exc

    def in_touch(self, now: float, interval_s: float) -> bool:
        """May this worker go on working (`services.fleet.liveness.in_touch`)?"""
        return self.stored_at is not None and in_touch(self.stored_at, now, self.ttl_s, interval_s)

    async def _still_mine(self) -> bool:
        """After a refused update: hold the key again if nobody else does.

        With a TTL of a few seconds, a nats-server restart can outlast the entry (nobody holds
        the id then: create it again), and a reconnect can lose the acknowledgement of an update
        that was stored (the entry is this instance's, at a newer revision). Only an entry of
        another instance means the lease was taken.
        """
        record = self.record()
        try:
            entry = await self.kv.get(self.worker_id)
        except NotFoundError:  # expired or deleted
            try:
                self.revision = await self.kv.create(self.worker_id, _encoder.encode(record))
            except KeyWrongLastSequenceError:
                return False  # another instance created it first
            self.stored_at = record.heartbeat_at
            log.warning(
                "lease entry had expired (bus outage?); taken again", worker_id=self.worker_id
            )
            return True
        holder = worker_record_decoder.decode(entry.value or b"")
        if holder.instance_id != record.instance_id:
            return False
        self.revision = await self.kv.update(
            self.worker_id, _encoder.encode(record), last=entry.revision
        )
        self.stored_at = record.heartbeat_at
        return True

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
                log.error("lease lost; stopping", worker_id=self.worker_id, error=exc.message)
                return
            except Exception as exc:  # the bus is reconnecting: try again next beat
                log.warning("heartbeat failed", worker_id=self.worker_id, error=repr(exc))

    async def release(self) -> None:
        """Delete the entry if this process still holds it.

        A heartbeat cancelled in flight may have been stored without this process learning its
        revision: then the entry is read again, and deleted if it is still this instance's.
        """
        if self.lost.is_set() or self.revision is None:
            return
        with suppress(Exception):
            try:
                await self.kv.delete(self.worker_id, last=self.revision)
            except APIError as exc:
                if not is_wrong_last_sequence(exc):
                    raise
                entry = await self.kv.get(self.worker_id)
                holder = worker_record_decoder.decode(entry.value or b"")
                if holder.instance_id == self.record().instance_id:
                    await self.kv.delete(self.worker_id, last=entry.revision)


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
