"""What one router holds only in memory, asked of every router (``coordinator.router.holds``).

Any number of routers serve one fleet, and a request reaches whichever of them the queue
group picks. Most of what a router needs is on the bus (the registry, the figures, the event
log), but two things live only in the router that took a route request: the reply subject
its client waits on, and a task it is submitting that the log does not show yet (held from
the moment its request arrives: reading the log and storing the task may each wait out a
leader election, and another router asked meanwhile must not refuse it). A cancel
naming that reply subject, or a request asking again for a task another router already
answers, may reach another router; that router asks here. Every router listens (no queue
group), and only the one that holds the request or task answers, so the question costs one
message per router and the answer one; no answer within `ANSWER_S` means nobody holds it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, suppress
from typing import Final

import msgspec
import nats.errors
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from schemas.route import HoldsQuery, HoldsReply
from schemas.subjects import ROUTER_HOLDS

log = structlog.get_logger("router")

# How long a router waits for the one that holds a request to say so. Routers answer from
# memory, so a live one answers within a round trip; the wait is paid only when none does
# (a cancel of a request nobody holds any more, a request asked again after its router died).
# A second, not half of one: on a busy machine a live router's answer took longer than 0.5 s,
# and a client that had asked again got two answers.
ANSWER_S: Final = 1.0

_query_decoder = msgspec.json.Decoder(HoldsQuery)
_reply_decoder = msgspec.json.Decoder(HoldsReply)
_encoder = msgspec.json.Encoder()


class Peers:
    """Answers the other routers from this one's ``waiters`` (task id -> its waiter) and
    ``waiting_on`` (reply subject -> task id), and asks them."""

    def __init__(
        self, nc: Client, waiters: Mapping[str, object], waiting_on: Mapping[str, str]
    ) -> None:
        self.nc = nc
        self.waiters = waiters
        self.waiting_on = waiting_on
        self._sub: Subscription | None = None
        # Requests naming a task, from their arrival to their answer (`arrived`), and this
        # router's own questions about a task in flight (`holder_of`): a request that asks is
        # not the holder it asks about.
        self._arrived: Counter[str] = Counter()
        self._asking: Counter[str] = Counter()

    async def start(self) -> None:
        self._sub = await self.nc.subscribe(ROUTER_HOLDS, cb=self._on_query)

    async def stop(self) -> None:
        if self._sub is not None:
            with suppress(Exception):
                await self._sub.unsubscribe()

    @contextmanager
    def arrived(self, task_id: str | None) -> Iterator[None]:
        """While a request naming ``task_id`` is handled here, this router holds the task."""
        if task_id is None:
            yield
            return
        self._arrived[task_id] += 1
        try:
            yield
        finally:
            _drop(self._arrived, task_id)

    def held(self, query: HoldsQuery) -> str | None:
        """The task ``query`` asks about, when this router holds it: it waits on the reply
        subject, or submits the task, or handles a request naming it other than the ones
        asking (`holder_of`)."""
        if query.reply_to:
            return self.waiting_on.get(query.reply_to)
        task_id = query.task_id
        if task_id and (task_id in self.waiters or self._arrived[task_id] > self._asking[task_id]):
            return task_id
        return None

    async def _on_query(self, msg: Msg) -> None:
        try:
            query = _query_decoder.decode(msg.data)
        except msgspec.DecodeError:
            return
        task_id = self.held(query)
        if task_id is None or not msg.reply:
            return  # another router holds it, or none does: only a holder answers
        with suppress(Exception):
            await msg.respond(_encoder.encode(HoldsReply(task_id=task_id)))

    async def holder_of(
        self, *, reply_to: str | None = None, task_id: str | None = None
    ) -> str | None:
        """The task id the router that holds this reply subject's request (or this task)
        says, or None when no router says so within `ANSWER_S` (this one included)."""
        query = HoldsQuery(task_id=task_id, reply_to=reply_to)
        if task_id is not None:
            self._asking[task_id] += 1  # this router answers its own question too
        try:
            local = self.held(query)
            if local is not None:
                return local
            reply = await self.nc.request(ROUTER_HOLDS, _encoder.encode(query), timeout=ANSWER_S)
            return _reply_decoder.decode(reply.data).task_id
        except (nats.errors.TimeoutError, nats.errors.NoRespondersError, msgspec.DecodeError):
            return None
        except Exception as exc:  # the bus is away: nobody can be asked
            log.warning("could not ask the other routers", error=repr(exc))
            return None
        finally:
            if task_id is not None:
                _drop(self._asking, task_id)


def _drop(counts: Counter[str], key: str) -> None:
    counts[key] -= 1
    if counts[key] <= 0:
        del counts[key]
