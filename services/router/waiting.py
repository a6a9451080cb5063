"""A client waiting for its task's end (``wait``/``stream``), across the task's attempts.

Only the current attempt's outcome answers the client: the reaper may route a task again as
attempt N+1, and a worker that wakes up late with attempt N's answer must not clobber it. So
a waiter follows the highest attempt routed, and ignores outcomes of lower ones. An outcome
counts only from where its attempt was routed (`services.fleet.binding`): a worker's outcome
for an attempt the router has not yet seen routed waits for that ``routed`` (the two arrive
on different subscriptions), and one from a worker that may not record it is refused.

A retryable failure reported by the worker that ran the attempt (its backend was down, say) is
not final for a kind of task that may run again while a reaper runs: the reaper routes it
again or fails it for good within moments, both as a newer attempt. The waiter gives it
`MOVE_ON_WAIT_S`; with no newer attempt by then, or with no reaper running, the failure is
the answer.

Outcomes come from the router's subscription, which misses what it was not connected for (a
reconnect, a partition: an event stored by replication was never published where the router
listens); the stream's copy is read again now and then (`stored`, `services.router.ending`).
Read there, an earlier attempt's end also counts when it was stored before the move that
superseded it: the server refuses one after (`services.runtime.outcomes.attempt_fence`), so a
stored one means the move raced the task's end and went no further.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

from nats.aio.subscription import Subscription

from schemas.events import TaskCompleted, TaskFailed
from services.fleet.binding import Supports, refusal
from services.runtime.outcomes import Sourced

# How long a retryable failure waits for the reaper to move the task on (it looks every second).
MOVE_ON_WAIT_S = 5.0
# How long a router goes on holding a reply subject it has answered (`let_go`).
ANSWERED_HOLD_S = 2.0


class Waiter:
    """The end of one task as its client should see it: ``future`` gets the outcome."""

    def __init__(
        self,
        *,
        retryable_kind: bool,
        moves_on: Callable[[], Awaitable[bool]],
        routed_to: str,
        supports: Supports,
        move_on_wait_s: float = MOVE_ON_WAIT_S,
    ) -> None:
        self.future: asyncio.Future[TaskCompleted | TaskFailed] = (
            asyncio.get_running_loop().create_future()
        )
        self.attempt = 1
        self.routed_to: str | None = routed_to
        """Where the current attempt was routed: a worker id or a pool's name."""
        self.supports = supports
        # Workers' outcomes of attempts not yet seen routed, by attempt.
        self._early: dict[int, list[tuple[TaskCompleted | TaskFailed, str]]] = {}
        self.retryable_kind = retryable_kind
        self.moves_on = moves_on
        """Whether anything moves a retryable failure on (a reaper runs)."""
        self.move_on_wait_s = move_on_wait_s
        self._pending: asyncio.TimerHandle | None = None
        self.since = time.monotonic()
        # Where each attempt before the current one was routed (those this waiter saw).
        self._superseded: dict[int, str | None] = {}

    async def routed(self, attempt: int, routed_to: str) -> list[str]:
        """The task was routed (again): from now on only this attempt's outcome counts.
        Returns the refusals of the outcomes that were waiting for this routing."""
        if attempt <= self.attempt:
            return []
        self._superseded[self.attempt] = self.routed_to
        self.attempt, self.routed_to = attempt, routed_to
        self._forget_pending()
        refused: list[str] = []
        for early in sorted(self._early):
            if early <= attempt:
                for outcome, source in self._early.pop(early):
                    if (problem := await self.ended(outcome, source)) is not None:
                        refused.append(problem)
        return refused

    def refusal(self, outcome: TaskCompleted | TaskFailed, source: str | None) -> str | None:
        """Why ``outcome``, recorded by ``source``, may not answer (None: it may)."""
        return refusal(outcome, source, (self.attempt, self.routed_to), self.supports)

    async def ended(self, outcome: TaskCompleted | TaskFailed, source: str | None) -> str | None:
        """An outcome event of the task, recorded by the worker ``source`` (None: by the router
        or the reaper); stale ones (older attempts) change nothing. Returns why it was refused
        when its recorder may not give it."""
        if self.future.done() or outcome.attempt < self.attempt:
            return None
        if source is not None and outcome.attempt > self.attempt:
            self._early.setdefault(outcome.attempt, []).append((outcome, source))
            return None  # its `routed` is on its way
        problem = self.refusal(outcome, source)
        if problem is not None:
            return problem
        self.attempt = outcome.attempt
        if (
            isinstance(outcome, TaskFailed)
            and outcome.retryable
            and outcome.worker is not None
            and self.retryable_kind
            and await self.moves_on()
        ):
            self._forget_pending()
            loop = asyncio.get_running_loop()
            self._pending = loop.call_later(self.move_on_wait_s, self._settle, outcome)
            return None
        self._settle(outcome)
        return None

    def stored_routing(self, attempt: int, routed_to: str) -> None:
        """The task's latest ``routed`` as the stream holds it. A routing heard on the
        subscription may never have been stored (a reaper cut off with a minority of the
        cluster moved the task; another's move of the same attempt was stored instead): the
        stream's is the one that stands."""
        if attempt < self.attempt:
            self._superseded.pop(attempt, None)
            self.attempt = attempt
        elif attempt > self.attempt:
            self._superseded[self.attempt] = self.routed_to
            self.attempt = attempt
        self.routed_to = routed_to

    async def stored(self, ends: Iterable[Sourced]) -> list[str]:
        """The task's outcomes as the stream holds them (`stored_ends`), for one the
        subscription missed: this attempt's (or a later one's) as if it had just arrived; an
        earlier attempt's end (a completion, or a failure not to be moved on), recorded by
        where that attempt was routed, ends the task. Returns the refusals."""
        refused: list[str] = []
        for event, source, _ in ends:
            if self.future.done():
                break
            if not isinstance(event, TaskCompleted | TaskFailed):
                continue
            if event.attempt >= self.attempt:
                if self._pending is not None:
                    continue  # a retryable failure already waits for its move: not again
                problem = await self.ended(event, source)
            elif isinstance(event, TaskFailed) and event.retryable:
                continue  # what the move was for
            elif event.attempt not in self._superseded:
                continue  # routed before this waiter began: nothing to judge its recorder by
            else:
                where = (event.attempt, self._superseded[event.attempt])
                problem = refusal(event, source, where, self.supports)
                if problem is None:  # the move raced the task's end
                    self._forget_pending()
                    self.future.set_result(event)
            if problem is not None:
                refused.append(problem)
        return refused

    def _settle(self, outcome: TaskCompleted | TaskFailed) -> None:
        self._forget_pending()
        if not self.future.done() and outcome.attempt >= self.attempt:
            self.future.set_result(outcome)

    def _forget_pending(self) -> None:
        if self._pending is not None:
            self._pending.cancel()
            self._pending = None

    def close(self) -> None:
        """The client is gone (answered or timed out): drop any pending timer."""
        self._forget_pending()


def let_go(waiting_on: dict[str, str], reply_to: str, task_id: str) -> None:
    """Drop ``reply_to`` from ``waiting_on`` (reply subject -> task id) `ANSWERED_HOLD_S`
    after its request was answered, if it still names ``task_id``.

    Held a moment longer than the answer: a client that asked again just as the answer went
    out (its ask crossed the answer on the wire) is then told nothing, by this router and by
    any other that asks it (`services.router.peers`), rather than answered twice. A client
    asks again only after seconds of silence (`services.runtime.request`), so one whose
    answer was really lost is answered on its next ask."""
    if not reply_to:
        return

    def drop() -> None:
        if waiting_on.get(reply_to) == task_id:
            del waiting_on[reply_to]

    asyncio.get_running_loop().call_later(ANSWERED_HOLD_S, drop)


@dataclass(slots=True)
class Tracking:
    """What follows one submitted task while its route request is handled."""

    started: Subscription | None = None
    """A woken worker's ``started`` subject, until the wake watches it."""
    waiter: Waiter | None = None
    """The task's end, for a client that waits."""
    waiting_on: str = ""
    """The reply subject the client waits on, by which it may cancel the task."""
