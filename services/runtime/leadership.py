"""Active/standby for a role one instance at a time may act in (the reaper, the stats
projection): any number of instances run, one acts, the others stand by.

The role is a lease on its key in the ``leaders`` bucket (`services.runtime.lease.KeyLease`,
the same rule a worker's registry entry follows): taken with ``create``, or over an entry
whose heartbeat is older than the TTL; renewed with ``update(last=revision)`` every heartbeat
interval; freed by the bucket's TTL when its holder dies, or deleted when it stops.

Two instances never act at once: the active one stops acting (its work is cancelled) once
its last stored renewal is older than the TTL less one heartbeat interval
(`KeyLease.in_touch`, as a worker stops its task, `services.runtime.touch`), or at once when
its lease was taken over; a standby takes the role only once the holder's last renewal is
older than the whole TTL (by its own clock, or the bucket's expiry). So the active one has
stopped a heartbeat interval before anyone may start, which holds while the hosts' clocks
agree to within that interval. A standby looks again when the holder's entry goes stale,
so it takes over within a TTL of the active one's last renewal (and within a heartbeat
interval of a stop, which deletes the entry).
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
import uuid
from collections.abc import Callable, Coroutine
from contextlib import suppress
from typing import Any, Final, Literal

import msgspec
import structlog
from nats.js.errors import NotFoundError
from nats.js.kv import KeyValue

from schemas.leaders import LeaderRecord, leader_record_decoder
from services import __version__
from services.fleet.liveness import stale_in
from services.runtime.lease import KeyLease

log = structlog.get_logger("leadership")

# How often the active instance checks that its renewals are being stored (at most; a quarter
# of the heartbeat interval when that is shorter), as a worker does (`services.runtime.touch`).
TOUCH_LOOK_S: Final = 0.1
# A standby never waits less than this between two tries (an entry just about to go stale).
MIN_TRY_S: Final = 0.05

Role = Literal["active", "standby"]
Work = Callable[[], Coroutine[Any, Any, None]]
"""What an instance does while it acts: runs until cancelled (or until the stop it watches)."""


class Leadership:
    """This process's part in ``role``: standing by, or acting while it holds the lease."""

    def __init__(self, kv: KeyValue, role: str, *, ttl_s: float, interval_s: float) -> None:
        self.kv = kv
        self.role = role
        self.ttl_s = ttl_s
        self.interval_s = interval_s
        self.instance_id = uuid.uuid4().hex[:12]
        self.host = socket.gethostname()
        self.pid = os.getpid()
        self.started_at = time.time()
        self.since = self.started_at
        """When this instance last became active or standby."""
        self.active = False
        """True while this instance acts (its work runs)."""
        self._took_at = self.started_at
        self.lease = KeyLease(kv, role, ttl_s, self.record, log_fields={"role": role})
        self._look_s = min(TOUCH_LOOK_S, interval_s / 4)

    def record(self) -> LeaderRecord:
        """This instance's entry, renewed now."""
        return LeaderRecord(
            role=self.role,
            instance_id=self.instance_id,
            host=self.host,
            pid=self.pid,
            version=__version__,
            started_at=self.started_at,
            since=self._took_at,
            heartbeat_at=time.time(),
        )

    @property
    def state(self) -> Role:
        return "active" if self.active else "standby"

    async def holder(self) -> LeaderRecord | None:
        """Who holds the role now, as the bucket says (None: nobody, or it cannot say)."""
        try:
            entry = await self.kv.get(self.role)
            return leader_record_decoder.decode(entry.value or b"")
        except (NotFoundError, msgspec.DecodeError):
            return None

    async def run(self, work: Work, stop: asyncio.Event, *, stop_grace_s: float) -> None:
        """Stand by until the role is free, then run ``work()`` while this instance holds it
        and its renewals are stored; stand by again when they are not; until ``stop``.

        ``work`` acts until it is cancelled, or until ``stop`` is set (then it is given
        ``stop_grace_s`` to finish before it is cancelled, and the role is handed on)."""
        while not stop.is_set():
            if not await self._stand_by(stop):
                return
            await self._lead(work, stop, stop_grace_s)

    async def _stand_by(self, stop: asyncio.Event) -> bool:
        """Try to take the role until it is this instance's (True) or ``stop`` (False)."""
        said: str | None = None
        failing = False
        while not stop.is_set():
            wait_s = self.interval_s
            try:
                self._took_at = time.time()
                held = await self.lease.take()
                failing = False
            except Exception as exc:  # the bus is away: try again
                if not failing:
                    log.warning(f"{self.role}: cannot reach the leaders bucket", error=repr(exc))
                failing = True
                held = b""
            else:
                if held is None:
                    self._became(True)
                    return True
                try:
                    holder = leader_record_decoder.decode(held)
                except msgspec.DecodeError:
                    holder = None
                if holder is not None:
                    # Look again as soon as its entry would be stale.
                    stale_s = stale_in(holder.heartbeat_at, time.time(), self.ttl_s)
                    wait_s = min(self.interval_s, max(stale_s, MIN_TRY_S))
                    if said != holder.instance_id:
                        said = holder.instance_id
                        self._became(False)
                        log.info(
                            f"{self.role} standing by",
                            active_host=holder.host,
                            active_pid=holder.pid,
                            active_instance=holder.instance_id,
                        )
            with suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=wait_s)
        return False

    async def _lead(self, work: Work, stop: asyncio.Event, stop_grace_s: float) -> None:
        """Act until the lease is lost, out of touch, ``work`` ends, or a stop's grace is over."""
        log.info(f"{self.role} active", instance=self.instance_id, host=self.host, pid=self.pid)
        keeper = asyncio.create_task(self.lease.keep(self.interval_s), name=f"{self.role}-lease")
        acting = asyncio.create_task(work(), name=f"{self.role}-active")
        clock = asyncio.get_running_loop()
        deadline: float | None = None
        why = ""
        try:
            while not acting.done():
                await asyncio.wait({acting}, timeout=self._look_s)
                if acting.done():
                    break
                if self.lease.lost.is_set():
                    why = "its lease was taken over"
                    break
                if not self.lease.in_touch(time.time(), self.interval_s):
                    silent_s = time.time() - (self.lease.stored_at or 0.0)
                    why = (
                        f"no renewal stored for {silent_s:.1f} s (WORKER_TTL_S is "
                        f"{self.ttl_s:g} s): out of touch with NATS, so another instance may "
                        "take over"
                    )
                    break
                if stop.is_set():
                    deadline = deadline if deadline is not None else clock.time() + stop_grace_s
                    if clock.time() >= deadline:
                        why = "it did not finish within the stop's grace"
                        break
        finally:
            if not acting.done():
                acting.cancel()
                # Cancelled at its next await: nothing more is written. Its clean-up may wait
                # on a bus that is away; the role is not held up by it.
                await asyncio.wait({acting}, timeout=self.interval_s)
            self._became(False)
            keeper.cancel()
            await asyncio.gather(keeper, return_exceptions=True)
        failure = acting.exception() if acting.done() and not acting.cancelled() else None
        if why:
            after = "" if stop.is_set() else "; standing by"
            log.error(f"{self.role} stopped acting: {why}{after}", instance=self.instance_id)
        elif failure is not None or not stop.is_set():
            log.error(f"{self.role} work ended; handing the role on", error=repr(failure))
        if not self.lease.lost.is_set() and (stop.is_set() or not why):
            # Handed on at once rather than after a TTL: a stop, or work that ended.
            await self.lease.release()
        if not stop.is_set() and not why:
            # Let another instance take the role before this one tries again.
            with suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=self.interval_s)

    def _became(self, active: bool) -> None:
        if active != self.active:
            self.since = time.time()
        self.active = active
