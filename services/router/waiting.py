"""A client waiting for its task's end (``wait``/``stream``), across the task's attempts.

Only the current attempt's outcome answers the client: the reaper may route a task again as
attempt N+1, and a worker that wakes up late with attempt N's answer must not clobber it. So
a waiter follows the highest attempt routed, and ignores outcomes of lower ones.

A retryable failure reported by the worker that ran the attempt (its backend was down, say) is
not final for a kind of task that may run again while a reaper runs: the reaper routes it
again or fails it for good within moments, both as a newer attempt. The waiter gives it
`MOVE_ON_WAIT_S`; with no newer attempt by then, or with no reaper running, the failure is
the answer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from schemas.events import TaskCompleted, TaskFailed

# How long a retryable failure waits for the reaper to move the task on (it looks every second).
MOVE_ON_WAIT_S = 5.0


class Waiter:
    """The end of one task as its client should see it: ``future`` gets the outcome."""

    def __init__(
        self,
        *,
        retryable_kind: bool,
        moves_on: Callable[[], Awaitable[bool]],
        move_on_wait_s: float = MOVE_ON_WAIT_S,
    ) -> None:
        self.future: asyncio.Future[TaskCompleted | TaskFailed] = (
            asyncio.get_running_loop().create_future()
        )
        self.attempt = 1
        self.retryable_kind = retryable_kind
        self.moves_on = moves_on
        """Whether anything moves a retryable failure on (a reaper runs)."""
        self.move_on_wait_s = move_on_wait_s
        self._pending: asyncio.TimerHandle | None = None

    def routed(self, attempt: int) -> None:
        """The task was routed (again): from now on only this attempt's outcome counts."""
        if attempt > self.attempt:
            self.attempt = attempt
            self._forget_pending()

    async def ended(self, outcome: TaskCompleted | TaskFailed) -> None:
        """An outcome event of the task; stale ones (older attempts) change nothing."""
        if self.future.done() or outcome.attempt < self.attempt:
            return
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
            return
        self._settle(outcome)

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
