"""`asyncio.wait_for` that never loses a cancellation: Python 3.12's, in place of 3.11's.

Python 3.11's ``wait_for`` returns the awaited result when the task waiting in it is cancelled
in the same turn of the loop as that result arrives: the cancellation is lost (CPython
gh-86296; 3.12 fixed it by building ``wait_for`` on `asyncio.timeout`). nats.py waits for
every reply with it, so a loop cancelled at a stop while a reply came in (a heartbeat, a
dashboard poll) went on running, and whatever awaited it after cancelling it waited for
ever: ``coordinator up`` hung on Ctrl-C that way, one service never closing its connection.

`install` puts 3.12's ``wait_for`` in ``asyncio`` for the whole process (nats.py and this
project look it up there at each call; asyncpg already carries the same copy for itself). On
3.12 and later it does nothing.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


# The parameter is named `timeout` as asyncio's is: callers pass it by that name.
async def wait_for(fut: Awaitable[T], timeout: float | None) -> T:  # noqa: ASYNC109
    """Await ``fut`` for at most ``timeout`` seconds (None: no limit), as Python 3.12 does:
    `TimeoutError` when the time is up (``fut`` cancelled), and a cancellation of the caller
    always raised, whether or not ``fut`` finished in the same turn."""
    if timeout is not None and timeout <= 0:
        # No time at all: a coroutine is not even started (3.12's behaviour).
        task = asyncio.ensure_future(fut)
        if task.done():
            return task.result()
        task.cancel()
        await asyncio.wait({task})
        try:
            return task.result()
        except asyncio.CancelledError as exc:
            raise TimeoutError from exc
    async with asyncio.timeout(timeout):
        return await fut


def install() -> None:
    """Make `wait_for` this process's ``asyncio.wait_for`` on Python before 3.12."""
    if sys.version_info >= (3, 12):
        return
    asyncio.wait_for = wait_for  # type: ignore[assignment]
    asyncio.tasks.wait_for = wait_for  # type: ignore[assignment]
