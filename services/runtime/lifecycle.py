"""Service lifecycle: SIGINT/SIGTERM set a stop event; services finish their work, then close
what they hold, within a stated budget.

A stop is bounded at every level, whatever the bus's state (connected, reconnecting, or gone
for good), and a requested stop ends normally:

- each step of a service's stop (`stop_within`) and the close of its NATS connection
  (`close_bus`: a drain, then a close) has its own time, and never raises;
- a service's whole stop has a budget (`stop_budget_s`: its grace for the work in hand, plus
  `STOP_MARGIN_S` for its goodbyes and connections); past it the service is cancelled
  (`run_within`), and the process ends anyway (`run_main`);
- a cancelled task is cancelled again until it ends, for at most `CANCEL_S`, then left
  (`cancel_and_wait`): a library may swallow one cancellation (nats.py does, in places).
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable, Collection, Coroutine
from contextvars import ContextVar
from typing import Any, Final, TypeVar

import structlog
from nats.aio.client import Client

from services.errors import StopRequested

log = structlog.get_logger("lifecycle")

T = TypeVar("T")

# A cancelled task gets this long to end, cancelled again every `CANCEL_AGAIN_S` meanwhile.
CANCEL_S: Final = 2.0
CANCEL_AGAIN_S: Final = 0.25
# A NATS connection at a stop: this long to drain (the messages in hand handled, what was
# published flushed), then this long to close.
DRAIN_S: Final = 2.0
CLOSE_S: Final = 2.0
# One step of a service's stop: its endpoints, subscriptions, a goodbye, a database pool.
STEP_S: Final = 3.0
# A service's whole stop beyond its grace for the work in hand: its steps, its goodbyes (a
# write the bus never answers takes JetStream's request timeout, 5 s: a worker's lease and
# its `stopped` event, 10 s) and the close of its connections, with room to spare.
STOP_MARGIN_S: Final = 20.0

_stop_event: ContextVar[asyncio.Event | None] = ContextVar("stop_event", default=None)


def install_stop_signals(stop: asyncio.Event) -> None:
    """Make SIGINT and SIGTERM set ``stop`` instead of killing the process mid-task.

    ``stop`` is also this task's `current_stop` (and that of the tasks it starts).
    """
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, _on_signal, stop, sig)
    set_current_stop(stop)


def set_current_stop(stop: asyncio.Event) -> None:
    """Make ``stop`` this task's `current_stop` (and that of the tasks it starts) without
    the signals: a service run as a task beside others (the tests run each so) then waits
    for the bus as it would in its own process, until its own stop."""
    _stop_event.set(stop)


def current_stop() -> asyncio.Event | None:
    """The stop event of a process that runs until stopped (a service, ``coordinator up``);
    None in a one-shot command."""
    return _stop_event.get()


def _on_signal(stop: asyncio.Event, sig: signal.Signals) -> None:
    if stop.is_set():
        log.info("stop requested again; stopping already", signal=sig.name)
    else:
        log.info("stop requested", signal=sig.name)
    stop.set()


def stop_budget_s(grace_s: float = 0.0) -> float:
    """How long a service's stop may take: ``grace_s`` for the work in hand (a worker's
    ``STOP_GRACE_S``), then `STOP_MARGIN_S`."""
    return grace_s + STOP_MARGIN_S


def run_until_stopped(main: Callable[[asyncio.Event], Awaitable[None]], *, budget_s: float) -> None:
    """Run ``main(stop)`` in a fresh event loop with the stop signals installed; once stopped,
    it has ``budget_s`` to end (`run_within`).

    A `StopRequested` (stopped before it was ready) ends it as a stop does: normally.
    """

    async def runner() -> None:
        stop = asyncio.Event()
        install_stop_signals(stop)
        try:
            await run_within(main, stop, budget_s)
        except StopRequested as exc:
            log.info("stopped before start", reason=exc.message)

    run_main(runner())


def run_main(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)``, except at the end: the tasks still running are cancelled within
    `CANCEL_S` and then left (``asyncio.run`` cancels them once and waits for ever on one that
    carries on)."""
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        return loop.run_until_complete(main)
    finally:
        try:
            left = asyncio.all_tasks(loop)
            if left and (stuck := loop.run_until_complete(cancel_and_wait(left))):
                log.error("tasks left running at exit", tasks=_names(stuck))
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.run_until_complete(loop.shutdown_default_executor())
        finally:
            asyncio.set_event_loop(None)
            loop.close()


async def run_within(
    main: Callable[[asyncio.Event], Awaitable[None]], stop: asyncio.Event, budget_s: float
) -> None:
    """Await ``main(stop)``; once ``stop`` is set it has ``budget_s`` to return, then it is
    cancelled (`cancel_and_wait`) and this returns, logging the overrun. What ``main`` raises
    is raised."""
    work = asyncio.ensure_future(main(stop))
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({work, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if not work.done():
            await asyncio.wait({work}, timeout=budget_s)
        if not work.done():
            log.error("stop overran its budget; cut short", budget_s=budget_s)
            if await cancel_and_wait({work}):
                log.error("stop cut short, but it goes on; left running")
            return
    finally:
        stopped.cancel()
        if not work.done():  # this task itself was cancelled
            await cancel_and_wait({work})
    if not work.cancelled():
        work.result()


async def cancel_and_wait(
    tasks: Collection[asyncio.Future[Any]], within_s: float | None = None
) -> set[asyncio.Future[Any]]:
    """Cancel ``tasks`` and wait for them to end, for at most ``within_s`` (`CANCEL_S`);
    returns those that did not (they are left running).

    Each one still running is cancelled again every `CANCEL_AGAIN_S`: code that swallows a
    cancellation (nats.py's does, in places; Python 3.11's ``wait_for`` did,
    `services.runtime.waitfor`) would leave a task cancelled only once running for ever.
    """
    pending = {task for task in tasks if not task.done()}
    loop = asyncio.get_running_loop()
    deadline = loop.time() + (CANCEL_S if within_s is None else within_s)
    while pending:
        for task in pending:
            task.cancel()
        left_s = deadline - loop.time()
        if left_s <= 0:
            break
        _, pending = await asyncio.wait(pending, timeout=min(CANCEL_AGAIN_S, left_s))
    return pending


async def stop_within(what: str, step: Awaitable[object], timeout_s: float = STEP_S) -> None:
    """Await one step of a stop for at most ``timeout_s``. A step that fails or overruns (a
    bus that went away holds a request until its timeout) is logged and cut short, never
    raised: the stop goes on to close what is left."""
    task = asyncio.ensure_future(step)
    try:
        await asyncio.wait({task}, timeout=timeout_s)
    finally:
        if not task.done():
            await cancel_and_wait({task})
            log.warning("stop step overran; cut short", step=what, timeout_s=timeout_s)
    if task.done() and not task.cancelled() and (error := task.exception()) is not None:
        log.warning("stop step failed", step=what, error=repr(error))


async def close_bus(nc: Client, *, drain_s: float = DRAIN_S, close_s: float = CLOSE_S) -> None:
    """Drain ``nc`` for at most ``drain_s``, then close it, whatever the bus's state; never
    raises.

    Connected, the drain lets the subscriptions' handlers finish the messages in hand and
    flushes what was published, then closes. Reconnecting (the server away), nats.py refuses
    to drain, and the close ends the reconnecting. A server that stopped answering (stopped,
    a cut link) holds the drain until nats.py's flush times out, and nats.py then leaves the
    connection open: the drain is cut short at ``drain_s`` and the connection closed.
    """
    if nc.is_closed:
        return
    if nc.is_connected and not nc.is_draining:
        await stop_within("drain the NATS connection", nc.drain(), drain_s)
    if not nc.is_closed:
        await stop_within("close the NATS connection", nc.close(), close_s)


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
        """Let running tasks finish for up to ``timeout_s``, then cancel the rest
        (`cancel_and_wait`: within `CANCEL_S`; one that still runs is logged and left)."""
        if not self._tasks:
            return
        _, pending = await asyncio.wait(set(self._tasks), timeout=timeout_s)
        if stuck := await cancel_and_wait(pending):
            log.error("background tasks did not stop; left running", tasks=_names(stuck))


def _names(tasks: Collection[asyncio.Future[Any]]) -> list[str]:
    return sorted(t.get_name() if isinstance(t, asyncio.Task) else repr(t) for t in tasks)
