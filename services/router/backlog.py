"""The tasks under way when a router starts, read back from the event log.

A router counts the work ahead of each worker from the ``routed`` events and the ends it
sees (`FleetView`). Every router sees every router's events as they happen, so routers that
run side by side count alike; but a router that starts while tasks are under way (a second
one, or one started again after a crash) would see none of those until they ended, and send
work to workers it took for idle. So at start the router reads back the task events of the
last ``lookback_s`` (what its view keeps before it forgets a task whose end it missed), in
order, through the same handler as the live ones. The live subscriptions are opened first
and held meanwhile (`live`): what they bring is handled after the read-back, in the order it
came, so the view ends as the log does (a task's events stored after the subscriptions
opened all arrive live, after anything the read-back gave of it).
"""

from __future__ import annotations

import asyncio
import datetime
import time
from collections.abc import Awaitable, Callable
from contextlib import suppress
from typing import Final

import structlog
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig, DeliverPolicy

from schemas.subjects import EVENTS_STREAM
from services.runtime.aliases import consumer_name, rename_on_reset

log = structlog.get_logger("router")

# The task events the view is made of; ``submitted`` and ``started`` are read past.
KINDS: Final = frozenset({"routed", "completed", "failed"})
# Task events, every recorder's (``events.task.<task>.<kind>`` and ``.<worker>.<kind>``).
SUBJECTS: Final = "events.task.>"
# How long a start may spend reading back; the router serves with what it has read by then.
READ_BACK_S: Final = 30.0


class Backlog:
    """Holds the live task events while the read-back runs, then hands every event to
    ``handle`` in order."""

    def __init__(self, js: JetStreamContext, handle: Callable[[Msg], Awaitable[None]]) -> None:
        self.js = js
        self.handle = handle
        self._held: list[Msg] | None = []

    async def live(self, msg: Msg) -> None:
        """The live subscriptions' callback: held until the read-back is done."""
        if self._held is not None:
            self._held.append(msg)
            return
        await self.handle(msg)

    async def read_back(self, lookback_s: float, timeout_s: float = READ_BACK_S) -> int:
        """Handle the task events stored in the last ``lookback_s``, then the live ones held
        meanwhile; how many were read back. A read-back that fails or runs out of time is
        logged and cut short: the view then counts only what it saw."""
        count = 0
        try:
            count = await self._read(lookback_s, timeout_s)
        except Exception as exc:
            log.warning(
                "tasks under way not read back; queue depths count only tasks routed from now",
                error=repr(exc),
            )
        held = self._held or []
        while held:
            await self.handle(held.pop(0))
        self._held = None
        log.info("tasks under way read back", events=count, lookback_s=lookback_s)
        return count

    async def _read(self, lookback_s: float, timeout_s: float) -> int:
        count = 0

        async def on_msg(msg: Msg) -> None:
            nonlocal count
            if msg.subject.rsplit(".", 1)[-1] in KINDS:
                count += 1
                await self.handle(msg)

        since = datetime.datetime.fromtimestamp(time.time() - lookback_s, tz=datetime.UTC)
        sub = await self.js.subscribe(
            SUBJECTS,
            stream=EVENTS_STREAM,
            ordered_consumer=True,
            cb=on_msg,
            config=ConsumerConfig(
                name=consumer_name("router-backlog"),
                deliver_policy=DeliverPolicy.BY_START_TIME,
                opt_start_time=since,
            ),
        )
        rename_on_reset(sub, "router-backlog")
        deadline = time.monotonic() + timeout_s
        try:
            while (await sub.consumer_info()).num_pending or sub.pending_msgs:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"not read back within {timeout_s:g} s")
                await asyncio.sleep(0.02)
        finally:
            with suppress(Exception):
                await sub.unsubscribe()
        return count
