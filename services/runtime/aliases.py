"""Following the alias events: the live map of model aliases (lesson 6).

Aliases are events (``events.stats.alias.set|removed``); a service that needs the map (router:
request names; worker: served names) replays them from the stream at start and keeps
following. The map itself and its rules live in `services.fleet.aliases` (pure).

The ordered consumer is given a name, so its create request carries the filter in its subject
(``$JS.API.CONSUMER.CREATE.EVENTS.<name>.events.stats.alias.>``), which a role's permissions
can pin. A worker with credentials makes no consumer at all (one per follow would have no
bound): it asks the router for the map instead (`AliasPoller`).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from contextlib import suppress
from typing import Any

import msgspec
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig

from schemas.events import ALIAS_EVENTS, AliasRemoved, AliasSet, any_event_decoder
from schemas.queries import AliasMap
from schemas.subjects import ALIAS_MAP, EVENTS_STREAM
from services.errors import CoordinatorError
from services.fleet.aliases import resolve
from services.runtime.bus import answered
from services.runtime.request import call

log = structlog.get_logger("aliases")


class AliasFollower:
    """The alias map as the event log has it, kept current; ``on_change`` runs after changes."""

    def __init__(self, js: JetStreamContext, on_change: Callable[[], None] | None = None) -> None:
        self.js = js
        self.aliases: dict[str, str] = {}
        self.on_change = on_change
        self._sub: Subscription | None = None

    def canonical(self, name: str) -> str:
        """The statistics key for a model name (the name itself when it has no alias)."""
        return resolve(self.aliases, name) if self.aliases else name

    async def start(self, timeout_s: float = 10.0) -> None:
        """Replay every alias event, then keep following; returns once caught up. Asked again
        while JetStream does not answer (`answered`)."""
        await answered(lambda: self._replay(timeout_s), "the alias events")

    async def _replay(self, timeout_s: float) -> None:
        self._sub = await self.js.subscribe(
            ALIAS_EVENTS,
            stream=EVENTS_STREAM,
            ordered_consumer=True,
            cb=self._on_msg,
            config=ConsumerConfig(name=consumer_name("aliases")),
        )
        rename_on_reset(self._sub, "aliases")
        deadline = asyncio.get_running_loop().time() + timeout_s
        sub = self._sub
        try:
            while (await sub.consumer_info()).num_pending or sub.pending_msgs:
                if asyncio.get_running_loop().time() > deadline:
                    raise TimeoutError("alias events did not replay in time")
                await asyncio.sleep(0.02)
        except BaseException:
            await self.stop()  # a start asked again begins afresh
            raise

    async def stop(self) -> None:
        sub, self._sub = self._sub, None
        if sub is not None:
            with suppress(Exception):
                await sub.unsubscribe()

    async def _on_msg(self, msg: Msg) -> None:
        try:
            event = any_event_decoder.decode(msg.data)
        except msgspec.DecodeError:
            log.warning("ignoring a malformed alias event", subject=msg.subject)
            return
        if isinstance(event, AliasSet):
            self.aliases[event.alias] = event.canonical
        elif isinstance(event, AliasRemoved):
            self.aliases.pop(event.alias, None)
        else:
            return
        if self.on_change is not None:
            self.on_change()


class AliasPoller:
    """The alias map as the router has it (`ALIAS_MAP`), asked again every ``every_s``: for a
    worker with credentials, which makes no consumer on ``EVENTS``. Without a router to ask,
    the names stay as they are until one answers."""

    def __init__(self, nc: Client, every_s: float) -> None:
        self.nc = nc
        self.every_s = every_s
        self.aliases: dict[str, str] = {}
        self._task: asyncio.Task[None] | None = None

    def canonical(self, name: str) -> str:
        return resolve(self.aliases, name) if self.aliases else name

    async def start(self, timeout_s: float = 10.0) -> None:
        """Ask once (waiting up to ``timeout_s`` for a router), then keep asking."""
        with suppress(CoordinatorError):
            await self._ask(unserved_s=timeout_s)
        self._task = asyncio.create_task(self._keep(), name="aliases")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with suppress(asyncio.CancelledError):
                await task

    async def _keep(self) -> None:
        while True:
            await asyncio.sleep(self.every_s)
            try:
                await self._ask(unserved_s=None)
            except CoordinatorError as exc:  # no router just now: the map stays as it was
                log.debug("alias map not read", error=str(exc))

    async def _ask(self, unserved_s: float | None) -> None:
        reply = await call(self.nc, ALIAS_MAP, b"{}", ALIAS_MAP_TIMEOUT_S, unserved_s=unserved_s)
        self.aliases = msgspec.json.decode(reply, type=AliasMap).aliases


ALIAS_MAP_TIMEOUT_S = 5.0


def consumer_name(prefix: str) -> str:
    """A fresh name for a named ordered consumer: ``<prefix>-<random>``."""
    return f"{prefix}-{uuid.uuid4().hex[:16]}"


def rename_on_reset(sub: Any, prefix: str) -> None:
    """An ordered consumer is recreated after a gap or lost heartbeats; nats-py would reuse the
    name, which the server refuses while the old consumer lingers. Give each one a new name
    (`consumer_name`).

    (nats-py 2.16's ``_JSI.reset_ordered_consumer``, which both of its reset paths call.)
    """
    jsi = sub._sub._jsi
    reset = jsi.reset_ordered_consumer

    async def reset_renamed(sseq: int | None) -> bool:
        jsi._ccreq.name = consumer_name(prefix)
        return bool(await reset(sseq))

    jsi.reset_ordered_consumer = reset_renamed
