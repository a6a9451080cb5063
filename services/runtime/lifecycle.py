"""Service lifecycle: SIGINT/SIGTERM set a stop event; services finish their work and drain."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable, Coroutine
from contextvars import ContextVar
from typing import Any

import structlog

from services.runtime.errors import StopRequested

log = structlog.get_logger("lifecycle")

_stop_event: ContextVar[asyncio.Event | None] = ContextVar("stop_event", default=None)


def install_stop_signals(stop: asyncio.Event) -> None:
    """Make SIGINT and SIGTERM set ``stop`` instead of killing the process mid-task.

    ``stop`` is also this task's `current_stop` (and that of the tasks it starts).
    """
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, _on_signal, stop, sig)
    _stop_event.set(stop)


def current_stop() -> asyncio.Event | None:
    """The stop event of a process that runs until stopped (a service, ``coordinator up``);
    None in a one-shot command."""
    return _stop_event.get()


def _on_signal(stop: asyncio.Event, sig: signal.Signals) -> None:
    log.info("stop requested", signal=sig.name)
    stop.set()


def run_until_stopped(main: Callable[[asyncio.Event], Awaitable[None]]) -> None:
    """Run ``main(stop)`` in a fresh event loop with the stop signals installed.

    A `StopRequested` (stopped before it was ready) ends it as a stop does: normally.
    """

    async def runner() -> None:
        stop = asyncio.Event()
        install_stop_signals(stop)
        try:
            await main(stop)
        except StopRequested as exc:
            log.info("stopped before start", reason=exc.message)

    asyncio.run(runner())


class TaskSet:
    """Background tasks a service owns; they are awaited (or cancelled) at shutdown."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str | None = None) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background task failed", task=task.get_name(), error=repr(task.exception()))

    def __len__(self) -> int:
        return len(self._tasks)

    async def wait(self, timeout_s: float) -> None:
        """Let running tasks finish for up to ``timeout_s``, then cancel the rest."""
        if not self._tasks:
            return
        _, pending = await asyncio.wait(set(self._tasks), timeout=timeout_s)
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
