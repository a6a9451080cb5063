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
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from nats.aio.subscription import Subscription

from schemas.events import TaskCompleted, TaskFailed
from services.fleet.binding import Supports, refusal

# How long a retryable failure waits for the reaper to move the task on (it looks every second).
MOVE_ON_WAIT_S = 5.0


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

    async def routed(self, attempt: int, routed_to: str) -> list[str]:
        """The task was routed (again): from now on only this attempt's outcome counts.
        Returns the refusals of the outcomes that were waiting for this routing."""
        if attempt <= self.attempt:
            return []
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


@dataclass(slots=True)
class Tracking:
    """What follows one submitted task while its route request is handled."""

    started: Subscription | None = None
    """A woken worker's ``started`` subject, until the wake watches it."""
    waiter: Waiter | None = None
    """The task's end, for a client that waits."""
    waiting_on: str = ""
    """The reply subject the client waits on, by which it may cancel the task."""
