"""A stop is bounded at every level: a step, a task that swallows its cancellation, a whole
service that overruns its budget. None of them raises out of a stop."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from structlog.testing import capture_logs

from services.runtime import lifecycle
from services.runtime.lifecycle import (
    TaskSet,
    cancel_and_wait,
    run_within,
    stop_budget_s,
    stop_within,
)


class Stubborn:
    """A task body that swallows every cancellation until released, as code that catches
    ``CancelledError`` does (nats.py in places)."""

    def __init__(self, swallow: int | None = None) -> None:
        self.swallow = swallow  # None: every one
        self.swallowed = 0
        self.released = asyncio.Event()

    async def run(self) -> None:
        while not self.released.is_set():
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                if self.swallow is not None and self.swallowed >= self.swallow:
                    raise
                self.swallowed += 1

    async def release(self, task: asyncio.Task[None]) -> None:
        self.released.set()
        task.cancel()
        await asyncio.wait({task})


async def test_a_task_that_swallows_a_cancellation_is_cancelled_again_until_it_ends() -> None:
    body = Stubborn(swallow=2)
    task = asyncio.create_task(body.run())
    await asyncio.sleep(0)
    assert await cancel_and_wait({task}, within_s=5.0) == set()
    assert task.cancelled()
    assert body.swallowed == 2


async def test_a_task_that_never_ends_is_given_up_on_in_time_and_returned() -> None:
    body = Stubborn()
    task = asyncio.create_task(body.run())
    await asyncio.sleep(0)
    began = time.monotonic()
    assert await cancel_and_wait({task}, within_s=0.3) == {task}
    assert time.monotonic() - began < 5.0
    assert body.swallowed >= 1
    await body.release(task)


async def test_a_task_set_stops_waiting_for_a_task_that_will_not_end_and_says_so() -> None:
    body = Stubborn()
    tasks = TaskSet()
    stuck = tasks.spawn(body.run(), name="stubborn")
    tasks.spawn(asyncio.sleep(10), name="sleeper")
    with capture_logs() as logs, pytest.MonkeyPatch.context() as patch:
        patch.setattr(lifecycle, "CANCEL_S", 0.3)
        await asyncio.wait_for(tasks.wait(timeout_s=0.0), timeout=10)
    assert [e["tasks"] for e in logs if e["event"].startswith("background tasks did not")] == [
        ["stubborn"]
    ]
    await body.release(stuck)


async def test_a_failing_step_of_a_stop_is_logged_not_raised() -> None:
    async def refused() -> None:
        raise ConnectionResetError("the bus went away")

    with capture_logs() as logs:
        await stop_within("say goodbye", refused())
    [entry] = [e for e in logs if e["event"] == "stop step failed"]
    assert entry["step"] == "say goodbye"
    assert "the bus went away" in entry["error"]


async def test_a_step_that_overruns_is_cut_short_at_its_time() -> None:
    step = asyncio.ensure_future(asyncio.sleep(10))
    with capture_logs() as logs:
        await asyncio.wait_for(stop_within("drain", step, timeout_s=0.05), timeout=10)
    assert step.cancelled()
    assert [e["step"] for e in logs if e["event"] == "stop step overran; cut short"] == ["drain"]


async def test_a_service_that_stops_in_time_ends_normally() -> None:
    stop = asyncio.Event()

    async def service(stop: asyncio.Event) -> None:
        await stop.wait()

    running = asyncio.create_task(run_within(service, stop, budget_s=5.0))
    await asyncio.sleep(0)
    stop.set()
    await asyncio.wait_for(running, timeout=10)


async def test_a_service_past_its_budget_is_cancelled_and_the_stop_ends() -> None:
    stop = asyncio.Event()
    cut = asyncio.Event()

    async def service(stop: asyncio.Event) -> None:
        await stop.wait()
        try:
            await asyncio.sleep(60)  # a goodbye the bus never answers
        except asyncio.CancelledError:
            cut.set()
            raise

    with capture_logs() as logs:
        running = asyncio.create_task(run_within(service, stop, budget_s=0.05))
        await asyncio.sleep(0)
        stop.set()
        await asyncio.wait_for(running, timeout=10)
    assert cut.is_set()
    assert [e["budget_s"] for e in logs if e["event"] == "stop overran its budget; cut short"] == [
        0.05
    ]


async def test_what_a_service_raises_is_raised() -> None:
    async def service(stop: asyncio.Event) -> None:
        raise LookupError("bad start")

    with pytest.raises(LookupError, match="bad start"):
        await run_within(service, asyncio.Event(), budget_s=1.0)


def test_a_stop_budget_is_the_grace_for_the_work_in_hand_plus_the_margin() -> None:
    assert stop_budget_s() == lifecycle.STOP_MARGIN_S
    assert stop_budget_s(30.0) == 30.0 + lifecycle.STOP_MARGIN_S


def test_the_loop_ends_though_a_task_left_at_the_end_will_not_stop() -> None:
    # asyncio.run cancels what is left once, then waits for ever on a task that carries on.
    left: list[asyncio.Task[None]] = []

    async def main() -> str:
        left.append(asyncio.get_running_loop().create_task(Stubborn().run(), name="left"))
        await asyncio.sleep(0)
        return "done"

    result: list[str] = []
    with capture_logs() as logs, pytest.MonkeyPatch.context() as patch:
        patch.setattr(lifecycle, "CANCEL_S", 0.3)
        # In a thread of its own: this test's thread has the test suite's loop.
        worker = threading.Thread(target=lambda: result.append(lifecycle.run_main(main())))
        worker.start()
        worker.join(timeout=10)
    assert result == ["done"]
    assert [e["tasks"] for e in logs if e["event"] == "tasks left running at exit"] == [["left"]]
    # Left on purpose: no "destroyed but pending" warning when it is collected.
    left[0]._log_destroy_pending = False  # type: ignore[attr-defined]
