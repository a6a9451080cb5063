"""`asyncio.wait_for` as Python 3.12 has it: a cancellation is never lost, whenever it comes."""

from __future__ import annotations

import asyncio
import sys

import pytest

from services.runtime import waitfor


async def test_a_cancel_that_comes_with_the_result_is_raised_not_lost() -> None:
    # Python 3.11's wait_for returned the result here and the task carried on (CPython
    # gh-86296): the loop below would then never end, and a stop that awaited it hung.
    reply: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    turns = 0

    async def heartbeat() -> None:
        nonlocal turns
        while True:
            await waitfor.wait_for(reply, 10)
            turns += 1
            await asyncio.sleep(0.01)

    task = asyncio.create_task(heartbeat())
    await asyncio.sleep(0)  # waiting for the reply
    reply.set_result(1)
    task.cancel()  # in the same turn of the loop as the reply
    done, _ = await asyncio.wait({task}, timeout=1.0)
    assert done, "the cancellation was lost: the task went on"
    assert task.cancelled()
    assert turns == 0


async def test_the_time_running_out_raises_timeout_and_cancels_what_was_awaited() -> None:
    inner = asyncio.ensure_future(asyncio.sleep(10))
    with pytest.raises(TimeoutError):
        await waitfor.wait_for(inner, 0.01)
    assert inner.cancelled()


async def test_no_time_at_all_never_starts_a_coroutine() -> None:
    started = False

    async def work() -> int:
        nonlocal started
        started = True
        return 1

    with pytest.raises(TimeoutError):
        await waitfor.wait_for(work(), 0)
    assert not started
    done: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    done.set_result(7)
    assert await waitfor.wait_for(done, 0) == 7


async def test_a_result_in_time_is_returned() -> None:
    assert await waitfor.wait_for(asyncio.sleep(0, result="ok"), 5) == "ok"
    assert await waitfor.wait_for(asyncio.sleep(0, result="none"), None) == "none"


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="3.12's own wait_for is kept")
def test_installed_it_is_asyncios_wait_for_for_every_caller() -> None:
    waitfor.install()  # as the coordinator command and the test suite do at start
    assert asyncio.wait_for is waitfor.wait_for
    assert asyncio.tasks.wait_for is waitfor.wait_for
