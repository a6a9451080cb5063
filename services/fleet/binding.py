"""Who may record an attempt's start and outcome: the one rule the router, the stats
projection, the reaper and the workers apply. Pure.

A worker publishes a task's ``started``, ``completed`` and ``failed`` on a subject that names
it (``events.task.<task>.<worker>.<kind>``), and the NATS server lets each worker user publish
only under its own id. The subject is therefore the event's true source; the event's
``worker`` field is only what it says. An event on a subject without a worker
(``events.task.<task>.<kind>``) comes from the router or the reaper, which workers cannot
publish as, or was stored before workers named themselves; it is taken as it is.

A worker's event for an attempt is taken only when the attempt was routed to that worker, or
to a pool it belongs to: the shared CPU queue's members are the CPU workers, the web queue's
the web-search workers, whichever of them the queue handed the task to. Its ``worker`` field
must name itself, except a pool member's ``worker_lost`` failure, which names the member that
started the attempt and never finished it. A task the reader knows nothing of (no ``routed``
seen) is taken from a worker that names itself; an attempt later than any the reader knows
was routed (a forged one) is refused. A refused event is logged as such and changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Final

from schemas.events import TaskCompleted, TaskFailed, TaskStarted
from schemas.subjects import POOLS
from services.errors import WorkerLost

# Each pool, and what a worker supports to be one of its members.
POOL_MEMBERSHIP: Final = {pool.name: pool.capability for pool in POOLS}
# The pools' queues, by the pool name an attempt routed there carries.
_POOL_QUEUES: Final = {pool.queue: pool.name for pool in POOLS}

# What a worker supports, by its id; None for a worker the reader does not know.
Supports = Callable[[str], Collection[str] | None]


def routed_to_of_queue(queue: str) -> str:
    """Where an attempt queued on ``queue`` was routed: a pool's name for a pool's queue,
    else the worker the queue (``tasks.<tier>.<worker>``) belongs to."""
    return _POOL_QUEUES.get(queue) or queue.rsplit(".", 1)[-1]


def refusal(
    event: TaskStarted | TaskCompleted | TaskFailed,
    source: str | None,
    routed: tuple[int, str | None] | None,
    supports: Supports,
) -> str | None:
    """Why the worker ``source`` (the one its subject names) may not record ``event``, or None
    when it may (and when the event comes from the router or the reaper: ``source`` None).

    ``routed``: the latest attempt of the task the reader knows was routed, and where to (a
    worker id or a pool's name; None when the reader knows the attempt but not where); None
    for a task the reader knows nothing of. An older attempt's event is stale, and the reader
    ignores it anyway: no refusal."""
    if source is None:
        return None
    where = f"attempt {event.attempt} of task {event.task_id}"
    if routed is None:
        routed_to = source
    elif event.attempt < routed[0]:
        return None
    elif event.attempt > routed[0]:
        return f"worker {source!r} recorded {where}, which was never routed"
    else:
        routed_to = routed[1] or source
    pool = routed_to if routed_to in POOL_MEMBERSHIP else None
    if event.worker != source and not (
        pool is not None and isinstance(event, TaskFailed) and event.code == WorkerLost.code
    ):
        return f"worker {source!r} recorded {where} as worker {event.worker!r}"
    if pool is None:
        if source != routed_to:
            return f"worker {source!r} recorded {where}, which was routed to {routed_to!r}"
        return None
    member_of = supports(source)
    if member_of is None or POOL_MEMBERSHIP[pool] not in member_of:
        return (
            f"worker {source!r} recorded {where}, which was routed to the {pool!r} pool, "
            "and is not one of its members"
        )
    return None
