"""A route request that names a task already submitted (`RouteRequest.task_id`): answered as
that task, never submitted again.

That is how a client gets its answer when the router it asked died while it waited, or its
connection lost the reply: it asks again with the same id (`services.runtime.request`), and
whichever router takes the request reads the task from the event log (its ``submitted``, its
latest ``routed``, its outcome if it has one) and answers: at once for a task that has ended
or a client that does not wait, else when the task ends, by the same rules as the first
request (`services.router.waiting`). A router already waiting on that reply subject for the
task stays silent: its one answer comes at the end; so does one that answered it a moment ago
(`services.router.waiting.let_go`), and any other router, once the one waiting says so
(`services.router.peers`), so that a client whose request was asked again of another router
while the first one lives still gets one answer.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Final

import structlog
from nats.js import JetStreamContext

from schemas.events import TaskCompleted, TaskFailed, TaskRouted, TaskSubmitted, task_event_decoder
from schemas.route import RouteReply, RouteRequest
from schemas.subjects import task_event, task_events
from schemas.tasks import is_retryable
from services.errors import NotFound, from_code
from services.fleet.binding import Supports, refusal
from services.fleet.identity import Owner, may_see
from services.router.ending import wait_for_end
from services.router.peers import Peers
from services.router.records import ended_reply, is_refusal, latest_outcome
from services.router.waiting import Waiter, let_go
from services.runtime.outcomes import Sourced, last_on, last_stored, routing_of, stored_ends

log = structlog.get_logger("router")

# What a waiting request allows beyond the task's own timeout, as for the first request.
FOLLOW_MARGIN_S: Final = 30.0


class Unsubmitted:
    """The request names a task the event log does not hold: submit it as usual."""


UNSUBMITTED: Final = Unsubmitted()


async def stored(
    js: JetStreamContext, task_id: str, kind: str, *, leader: bool = False
) -> object | None:
    """The task's latest ``kind`` event recorded by the router or the reaper, decoded; read
    from the stream's leader with ``leader`` (`services.runtime.outcomes.last_stored`)."""
    data = await last_on(js, task_event(task_id, kind), leader=leader)
    return None if data is None else task_event_decoder.decode(data)


async def task_owner(js: JetStreamContext, task_id: str) -> Owner | None:
    """Who the task belongs to, by its ``submitted`` (stored before it is queued); None when
    the log does not hold it (yet)."""
    submitted = await stored(js, task_id, "submitted")
    if not isinstance(submitted, TaskSubmitted):
        return None
    return Owner.of(submitted.asker, submitted.client)


class Follower:
    """Answers route requests for tasks already submitted, over the router's waiters."""

    def __init__(
        self,
        js: JetStreamContext,
        waiters: dict[str, Waiter],
        waiting_on: dict[str, str],
        *,
        moves_on: Callable[[], Awaitable[bool]],
        supports: Supports,
        peers: Peers,
    ) -> None:
        self.js = js
        self.waiters = waiters
        self.waiting_on = waiting_on
        self.moves_on = moves_on
        self.supports = supports
        self.peers = peers
        self._asked: set[str] = set()  # reply subjects whose request is being answered here

    async def answer(
        self, request: RouteRequest, task_id: str, reply_to: str, *, leader: bool = False
    ) -> RouteReply | Unsubmitted | None:
        """The reply for a request naming ``task_id``; `UNSUBMITTED` when the task is new;
        None when this router, or another, already answers ``reply_to`` for it (no second
        reply). With ``leader`` the log is read from the stream's leader: a copy that lags
        (a node that just rejoined) may not hold the task yet."""
        if reply_to and (self.waiting_on.get(reply_to) == task_id or reply_to in self._asked):
            return None
        # Held from here to the answer: the same request asked again meanwhile (a client asks
        # again every few seconds) stays silent here, not a second answer.
        self._asked.add(reply_to)
        try:
            return await self._answer(request, task_id, reply_to, leader)
        finally:
            self._asked.discard(reply_to)

    async def _answer(
        self, request: RouteRequest, task_id: str, reply_to: str, leader: bool
    ) -> RouteReply | Unsubmitted | None:
        # One read for a new task (the usual case): any event of it at all.
        if await last_stored(self.js, task_events(task_id), leader=leader) is None:
            return UNSUBMITTED
        submitted = await stored(self.js, task_id, "submitted", leader=leader)
        if not isinstance(submitted, TaskSubmitted):
            refused = await stored(self.js, task_id, "failed", leader=leader)
            if isinstance(refused, TaskFailed) and is_refusal(refused):
                # A router refused the request before (`services.router.submit.record_refusal`).
                raise from_code(refused.code, refused.reason)
            return UNSUBMITTED
        if not may_see(
            Owner.of(submitted.asker, submitted.client), Owner.asking(reply_to, request.client)
        ):
            # Another's task: answered as a task nobody has (no hint that it exists).
            raise NotFound(f"no task '{task_id}'")
        if reply_to and await self.peers.holder_of(reply_to=reply_to) == task_id:
            log.info("asked again; another router answers it", task_id=task_id)
            return None
        routed = await stored(self.js, task_id, "routed", leader=leader)
        routing = routed if isinstance(routed, TaskRouted) else None
        queue = routing.queue if routing is not None else ""
        routed_to = routing.worker if routing is not None else ""
        waiter = self.waiters.get(task_id)
        shared = waiter is not None
        if waiter is None:
            waiter = Waiter(
                retryable_kind=is_retryable(submitted.work.task_type),
                moves_on=self.moves_on,
                routed_to=routed_to,
                supports=self.supports,
            )
            # Until a routing is seen (none stored yet), no worker's outcome is taken.
            waiter.attempt = routing.attempt if routing is not None else 0
            waiter.routed_to = routing.worker if routing is not None else None
            self.waiters[task_id] = waiter
        if reply_to:
            self.waiting_on[reply_to] = task_id
        try:
            # Registered first: an end stored from now on reaches the waiter, one stored
            # before is in the stream.
            outcome = await self._ended(task_id, waiter, leader)
            if isinstance(outcome, TaskFailed) and is_refusal(outcome) and routing is None:
                # Refused before a router stored its routing: answered as that refusal.
                raise from_code(outcome.code, outcome.reason)
            if outcome is None:
                if not (request.wait or request.stream):
                    return RouteReply(
                        task_id=task_id, status="queued", queue=queue, worker=routed_to
                    )
                budget_s = submitted.at + submitted.timeout_s + FOLLOW_MARGIN_S - time.time()
                outcome = await wait_for_end(
                    self.js, task_id, waiter, max(budget_s, 1.0), shared=shared
                )
            return ended_reply(task_id, queue, routed_to, outcome)
        finally:
            let_go(self.waiting_on, reply_to, task_id)
            if not shared:
                waiter.close()
                self.waiters.pop(task_id, None)

    async def _ended(
        self, task_id: str, waiter: Waiter, leader: bool
    ) -> TaskCompleted | TaskFailed | None:
        """The outcome the stream holds that ``waiter`` would take, if any: its attempt's, or
        an earlier attempt's end that a move raced (`earlier_end`)."""
        stored_now = await stored_ends(self.js, task_id, leader=leader)
        ends = [
            event
            for event, source, _ in stored_now
            if isinstance(event, TaskCompleted | TaskFailed)
            and event.attempt >= waiter.attempt
            and waiter.refusal(event, source) is None
        ]
        return latest_outcome(ends) or await self.earlier_end(task_id, waiter, stored_now)

    async def earlier_end(
        self, task_id: str, waiter: Waiter, ends: list[Sourced]
    ) -> TaskCompleted | TaskFailed | None:
        """An end of an attempt before the latest routed one, recorded by where that attempt
        was routed: the server stores a worker's outcome only while its attempt's ``routed``
        is the latest (`services.runtime.outcomes.attempt_fence`), so a stored one means the
        move that followed raced the task's end and went no further (no new attempt was
        queued). The same rule as a waiter's for an attempt it saw routed
        (`services.router.waiting.Waiter.stored`); a retryable failure is what the move was
        for, not an end."""
        for event, source, _ in ends:
            if not isinstance(event, TaskCompleted | TaskFailed) or event.attempt >= waiter.attempt:
                continue
            if isinstance(event, TaskFailed) and event.retryable:
                continue
            routing = await routing_of(self.js, task_id, event.attempt)
            if routing is None:
                continue
            where = (routing.attempt, routing.worker)
            if refusal(event, source, where, self.supports) is None:
                log.info(
                    "asked again for a task whose move raced its end; answered by that end",
                    task_id=task_id,
                    attempt=event.attempt,
                    latest_attempt=waiter.attempt,
                )
                return event
        return None
