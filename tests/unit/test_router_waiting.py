"""A waiting client gets the current attempt's outcome: never a late, stale one."""

from __future__ import annotations

import asyncio

from schemas.events import Durations, TaskCompleted, TaskFailed
from services.router.waiting import Waiter


async def yes() -> bool:
    return True


async def no() -> bool:
    return False


def completed(attempt: int, response: str) -> TaskCompleted:
    return TaskCompleted(
        at=0.0,
        task_id="t",
        attempt=attempt,
        worker="w",
        model="m",
        response=response,
        durations=Durations(total_ms=1),
    )


def failed(attempt: int, *, retryable: bool, worker: str | None = "w") -> TaskFailed:
    return TaskFailed(
        at=0.0,
        task_id="t",
        attempt=attempt,
        worker=worker,
        code="backend_unavailable" if retryable else "no_alternative_worker",
        reason="r",
        retryable=retryable,
    )


async def test_the_first_outcome_of_the_current_attempt_answers() -> None:
    waiter = Waiter(retryable_kind=True, moves_on=yes)
    await waiter.ended(completed(1, "two"))
    assert waiter.future.result().response == "two"  # type: ignore[union-attr]


async def test_an_older_attempts_outcome_after_a_newer_routing_is_ignored() -> None:
    waiter = Waiter(retryable_kind=True, moves_on=yes)
    waiter.routed(2)
    await waiter.ended(completed(1, "stale"))
    assert not waiter.future.done()
    await waiter.ended(completed(2, "current"))
    assert waiter.future.result().response == "current"  # type: ignore[union-attr]


async def test_a_retryable_failure_waits_for_the_task_to_be_moved_on() -> None:
    waiter = Waiter(retryable_kind=True, moves_on=yes, move_on_wait_s=0.05)
    await waiter.ended(failed(1, retryable=True))
    waiter.routed(2)
    await asyncio.sleep(0.1)
    assert not waiter.future.done()
    await waiter.ended(failed(2, retryable=False, worker=None))
    assert waiter.future.result().attempt == 2


async def test_a_retryable_failure_answers_when_nobody_moves_the_task_on() -> None:
    waiter = Waiter(retryable_kind=True, moves_on=yes, move_on_wait_s=0.05)
    await waiter.ended(failed(1, retryable=True))
    assert not waiter.future.done()
    assert (await asyncio.wait_for(waiter.future, 1)).attempt == 1


async def test_a_kind_that_is_never_run_again_takes_its_failure_at_once() -> None:
    waiter = Waiter(retryable_kind=False, moves_on=yes)
    await waiter.ended(failed(1, retryable=True))
    assert waiter.future.done()


async def test_without_a_reaper_a_retryable_failure_answers_at_once() -> None:
    waiter = Waiter(retryable_kind=True, moves_on=no)
    await waiter.ended(failed(1, retryable=True))
    assert waiter.future.done()
