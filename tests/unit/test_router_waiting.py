"""A waiting client gets the current attempt's outcome: never a late, stale one."""

from __future__ import annotations

import asyncio
from typing import Any

from schemas.events import Durations, TaskCompleted, TaskFailed
from services.router.waiting import Waiter
from services.runtime.outcomes import Sourced


async def yes() -> bool:
    return True


async def no() -> bool:
    return False


# What each registered worker supports: w and x are CPU workers, g a GPU one.
SUPPORTS = {"w": ["cpu_inference"], "x": ["cpu_inference"], "g": ["gpu_inference"]}


def waiter_for(routed_to: str, **kw: Any) -> Waiter:
    settings: dict[str, Any] = {"retryable_kind": True, "moves_on": yes, **kw}
    return Waiter(routed_to=routed_to, supports=SUPPORTS.get, **settings)


def completed(attempt: int, response: str, worker: str = "w") -> TaskCompleted:
    return TaskCompleted(
        at=0.0,
        task_id="t",
        attempt=attempt,
        worker=worker,
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
    waiter = waiter_for("w")
    await waiter.ended(completed(1, "two"), "w")
    assert waiter.future.result().response == "two"  # type: ignore[union-attr]


async def test_an_older_attempts_outcome_after_a_newer_routing_is_ignored() -> None:
    waiter = waiter_for("w")
    await waiter.routed(2, "w")
    await waiter.ended(completed(1, "stale"), "w")
    assert not waiter.future.done()
    await waiter.ended(completed(2, "current"), "w")
    assert waiter.future.result().response == "current"  # type: ignore[union-attr]


async def test_a_retryable_failure_waits_for_the_task_to_be_moved_on() -> None:
    waiter = waiter_for("w", move_on_wait_s=0.05)
    await waiter.ended(failed(1, retryable=True), "w")
    await waiter.routed(2, "w")
    await asyncio.sleep(0.1)
    assert not waiter.future.done()
    await waiter.ended(failed(2, retryable=False, worker=None), None)
    assert waiter.future.result().attempt == 2


async def test_a_retryable_failure_answers_when_nobody_moves_the_task_on() -> None:
    waiter = waiter_for("w", move_on_wait_s=0.05)
    await waiter.ended(failed(1, retryable=True), "w")
    assert not waiter.future.done()
    assert (await asyncio.wait_for(waiter.future, 1)).attempt == 1


async def test_a_kind_that_is_never_run_again_takes_its_failure_at_once() -> None:
    waiter = waiter_for("w", retryable_kind=False)
    await waiter.ended(failed(1, retryable=True), "w")
    assert waiter.future.done()


async def test_without_a_reaper_a_retryable_failure_answers_at_once() -> None:
    waiter = waiter_for("w", moves_on=no)
    await waiter.ended(failed(1, retryable=True), "w")
    assert waiter.future.done()


async def test_an_outcome_from_a_worker_the_attempt_was_not_routed_to_is_refused() -> None:
    waiter = waiter_for("w")
    problem = await waiter.ended(completed(1, "FORGED", worker="x"), "x")
    assert problem is not None and "routed to 'w'" in problem
    assert not waiter.future.done()
    # Naming the routed worker while publishing as another is no better.
    problem = await waiter.ended(completed(1, "FORGED"), "x")
    assert problem is not None and "as worker 'w'" in problem
    assert not waiter.future.done()
    await waiter.ended(completed(1, "real"), "w")
    assert waiter.future.result().response == "real"  # type: ignore[union-attr]


async def test_a_pool_task_is_answered_by_a_pool_member_only() -> None:
    waiter = waiter_for("shared")
    problem = await waiter.ended(completed(1, "FORGED", worker="g"), "g")
    assert problem is not None and "not one of its members" in problem
    assert await waiter.ended(completed(1, "x did it", worker="x"), "x") is None
    assert waiter.future.result().response == "x did it"  # type: ignore[union-attr]


async def test_a_worker_outcome_of_an_attempt_not_yet_seen_routed_waits_for_its_routing() -> None:
    waiter = waiter_for("w")
    assert await waiter.ended(completed(2, "x ran attempt 2", worker="x"), "x") is None
    assert not waiter.future.done()  # attempt 2's `routed` is on its way
    assert await waiter.routed(2, "x") == []
    assert waiter.future.result().response == "x ran attempt 2"  # type: ignore[union-attr]


async def test_a_forged_later_attempt_is_refused_once_the_real_routing_is_seen() -> None:
    waiter = waiter_for("w")
    await waiter.ended(completed(2, "FORGED", worker="x"), "x")
    [problem] = await waiter.routed(2, "w")
    assert "routed to 'w'" in problem
    assert not waiter.future.done()


async def test_the_routers_and_reapers_failures_are_taken_as_they_are() -> None:
    waiter = waiter_for("w", retryable_kind=False)
    assert await waiter.ended(failed(1, retryable=False, worker=None), None) is None
    assert waiter.future.done()


async def test_an_end_read_from_the_stream_answers_as_if_it_had_arrived() -> None:
    waiter = waiter_for("w")
    assert await waiter.stored([Sourced(completed(1, "two"), "w")]) == []
    assert waiter.future.result().response == "two"  # type: ignore[union-attr]


async def test_an_earlier_attempts_end_stored_before_the_move_answers() -> None:
    # The move to attempt 2 raced attempt 1's completion, which the stream stored first (the
    # server refuses it after the move): the task ended, attempt 2 is never queued.
    waiter = waiter_for("w")
    await waiter.routed(2, "x")
    await waiter.stored([Sourced(completed(1, "two"), "w")])
    assert waiter.future.result().response == "two"  # type: ignore[union-attr]


async def test_an_earlier_attempt_read_from_the_stream_counts_only_as_an_end_by_its_worker() -> (
    None
):
    waiter = waiter_for("w")
    await waiter.routed(2, "x")
    # A retryable failure is what the move was for; another worker's completion is forged.
    refused = await waiter.stored(
        [Sourced(failed(1, retryable=True), "w"), Sourced(completed(1, "forged", worker="g"), "g")]
    )
    assert len(refused) == 1 and "'g'" in refused[0]
    assert not waiter.future.done()
    # Never seen routed by this waiter: no routing to judge its recorder by.
    fresh = waiter_for("x")
    fresh.attempt = 2
    await fresh.stored([Sourced(completed(1, "two"), "w")])
    assert not fresh.future.done()


async def test_the_streams_routing_stands_over_one_heard_but_never_stored() -> None:
    # A reaper cut off with a minority moved the task to x; the move stored was another
    # reaper's, to w, which completes it. Then the stream is read.
    waiter = waiter_for("g")
    await waiter.routed(2, "x")
    assert await waiter.ended(completed(2, "two", worker="w"), "w") is not None  # refused
    waiter.stored_routing(2, "w")
    assert await waiter.stored([Sourced(completed(2, "two", worker="w"), "w")]) == []
    assert waiter.future.result().response == "two"  # type: ignore[union-attr]
    # Heard attempt 2, never stored: the stream's attempt 1 stands again.
    back = waiter_for("w")
    await back.routed(2, "x")
    back.stored_routing(1, "w")
    await back.stored([Sourced(completed(1, "one"), "w")])
    assert back.future.result().response == "one"  # type: ignore[union-attr]


async def test_a_retryable_failure_read_again_from_the_stream_still_answers_in_time() -> None:
    waiter = waiter_for("w", move_on_wait_s=0.2)
    await waiter.ended(failed(1, retryable=True), "w")
    for _ in range(4):  # read again from the stream more often than the wait for the move
        await asyncio.sleep(0.1)
        await waiter.stored([Sourced(failed(1, retryable=True), "w")])
    assert waiter.future.done()
