"""Waking a sleeping worker for a task: the magic packet (at most one per `WAKE_RESEND_S`
per worker), the ``wake_requested`` event, and the task failed if the worker has not started
it within ``WAKE_WAIT_S``."""

from __future__ import annotations

import time
from contextlib import suppress
from typing import Final

import nats.errors
import structlog
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from schemas import message_ids
from schemas.events import WakeRequested
from schemas.subjects import TASKS_STREAM
from schemas.workers import WorkerRecord
from services.router.records import wake_failure
from services.router.settings import RouterSettings
from services.router.wol import send_magic_packet
from services.runtime.bus import publish_event
from services.runtime.lifecycle import TaskSet

log = structlog.get_logger("router")

# A sleeping worker is sent at most one magic packet in this many seconds.
WAKE_RESEND_S: Final = 10.0


class Waker:
    """Wakes sleeping workers, and gives up on the tasks of those that do not wake."""

    def __init__(self, js: JetStreamContext, settings: RouterSettings, tasks: TaskSet) -> None:
        self.js = js
        self.settings = settings
        self.tasks = tasks
        self._woken: dict[str, float] = {}

    async def wake(
        self, sleeper: WorkerRecord, task_id: str, model: str, seq: int, started: Subscription
    ) -> None:
        """Send the magic packet (at most once per `WAKE_RESEND_S` per worker), record it, and
        fail the task (its message ``seq`` in TASKS) if the worker has not started it within
        ``WAKE_WAIT_S`` (nothing on ``started``, the task's ``started`` subject, which this
        owns from now on)."""
        assert sleeper.wol_mac is not None
        now = time.monotonic()
        if now - self._woken.get(sleeper.worker_id, -WAKE_RESEND_S) >= WAKE_RESEND_S:
            self._woken[sleeper.worker_id] = now
            send_magic_packet(sleeper.wol_mac, self.settings.wol_broadcast, self.settings.wol_port)
            log.info("wake-on-lan sent", worker=sleeper.worker_id, mac=sleeper.wol_mac)
        await publish_event(
            self.js,
            WakeRequested(
                at=time.time(),
                worker_id=sleeper.worker_id,
                mac=sleeper.wol_mac,
                task_id=task_id,
                model=model,
            ),
        )
        self.tasks.spawn(
            self._give_up_waking(sleeper.worker_id, task_id, seq, started), name="wake-wait"
        )

    async def _give_up_waking(
        self, worker_id: str, task_id: str, seq: int, started: Subscription
    ) -> None:
        try:
            await started.next_msg(timeout=self.settings.wake_wait_s)
            return  # started in time
        except nats.errors.TimeoutError:
            pass
        finally:
            with suppress(Exception):
                await started.unsubscribe()
        try:
            # Take it out of the queue first, so a late wake cannot run a failed task.
            await self.js.delete_msg(TASKS_STREAM, seq)
        except NotFoundError:
            return  # the worker took it in the last moment
        log.warning("wake timed out", task_id=task_id, worker=worker_id)
        await publish_event(
            self.js,
            wake_failure(task_id, worker_id, self.settings.wake_wait_s, time.time()),
            msg_id=message_ids.failed_before_routing(task_id, "wake"),
        )
