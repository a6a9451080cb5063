"""A worker out of touch with the bus: it stops its task before anyone may move it.

A worker whose heartbeats have not been stored for nearly a TTL (`Lease.in_touch`: a network
partition, a bus outage, a stalled process) may be judged dead by the reaper any moment, and
its task routed to another worker. So it stops its running task first (the backend call is
closed, as for a cancel: Ollama stops generating), holds the task's message, and pulls
nothing until a heartbeat is stored again: two backends never run one task at once, a
partition included.

Back in touch, the held task runs again (`TaskLoop` asks `resumable`): its claim is awaited
before the work begins, and is refused when the reaper moved the task on meanwhile; then
nothing runs. Until then the heartbeats name the held task as the current one, so after a
restart of the whole bus (when nobody could move anything) nobody takes the worker for one
that lost its task, and the task ends where it was.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import suppress
from typing import Final

import msgspec
import structlog
from nats.aio.msg import Msg

from schemas.subjects import SHARED_CPU, WEB
from schemas.tasks import task_decoder
from services.runtime.acks import NAK, STOP_SETTLE_S, settle
from services.runtime.lease import Lease
from services.runtime.taskrun import TaskRunner

log = structlog.get_logger("taskloop")

# How often the worker checks that its heartbeats are being stored (at most; a quarter of the
# heartbeat interval when that is shorter).
TOUCH_LOOK_S: Final = 0.1

_task_decoder = task_decoder


class Touch:
    """Watches whether the worker's heartbeats are stored; stops and holds the running task
    when they are not."""

    def __init__(self, lease: Lease, runner: TaskRunner, interval_s: float, ack_wait_s: float):
        self.lease = lease
        self.runner = runner
        self.interval_s = interval_s
        self.ack_wait_s = ack_wait_s
        self.adrift = asyncio.Event()
        """Set while out of touch: nothing is pulled."""
        self.parked: Msg | None = None
        """The task stopped for want of touch, held until the worker is back."""
        self.stopping = False
        """Set while the running task is being stopped for want of touch (not for a stop)."""
        self._parked_at = 0.0

    async def watch(self) -> None:
        """Set and clear `adrift` as heartbeats stop and start being stored; stop the running
        task's work (run it as a task, cancel to stop). A task whose work is over goes on
        storing its outcome through the outage: fenced on its attempt, it is stored unless the
        task was moved on meanwhile (`services.runtime.outcomes.store_attempt_outcome`)."""
        look_s = min(TOUCH_LOOK_S, self.interval_s / 4)
        while True:
            await asyncio.sleep(look_s)
            touching = self.lease.in_touch(time.time(), self.interval_s)
            if touching and self.adrift.is_set():
                self.adrift.clear()
                log.info(
                    "heartbeats stored again; pulling tasks again", worker_id=self.lease.worker_id
                )
            elif not touching and not self.adrift.is_set():
                self.adrift.set()
                self.runner.claim_first = True
                self._log_adrift()
                if self.runner.stop_work():
                    self.stopping = True

    def _log_adrift(self) -> None:
        silent_s = time.time() - (self.lease.stored_at or 0.0)
        log.error(
            f"no heartbeat stored for {silent_s:.1f} s (WORKER_TTL_S is {self.lease.ttl_s:g} s): "
            "out of touch with NATS, so another worker may be given this one's task; the "
            "running task is stopped and held (it runs again once back, unless it was moved on "
            "meanwhile), and nothing is pulled until the lease is renewed. Check the network "
            "between this host and the NATS server.",
            worker_id=self.lease.worker_id,
            task_id=self.runner.current_task,
        )

    def park(self, msg: Msg) -> None:
        """Hold the task stopped for want of touch; the heartbeats name it until it runs
        again or is let go."""
        self.stopping = False
        self.parked = msg
        self._parked_at = time.time()
        with suppress(msgspec.DecodeError):
            task = _task_decoder.decode(msg.data)
            self.runner.current_task = task.task_id
            self.runner.current_model = task.model

    async def take_parked(self) -> Msg | None:
        """The held task, to run again now that the worker is back in touch; None when there
        is none, or when it went back to its queue instead: a pool's task held for half its
        ack wait or more may be handed to another pool member by now."""
        msg, self.parked = self.parked, None
        if msg is None:
            return None
        pooled = msg.subject in (SHARED_CPU.queue, WEB.queue)
        if pooled and time.time() - self._parked_at >= self.ack_wait_s / 2:
            self.runner.current_task = None
            await settle(self.runner.nc, msg, NAK)
            return None
        log.info("running again the task stopped while out of touch", subject=msg.subject)
        self.runner.claim_first = True
        return msg

    async def let_go(self) -> None:
        """The worker is stopping: the held task goes back to its queue."""
        msg, self.parked = self.parked, None
        if msg is not None:
            await settle(self.runner.nc, msg, NAK, within_s=STOP_SETTLE_S)
