"""What a worker kind is to the task loop (`services.runtime.taskloop`): its settings, what it
serves, and what it does with one claimed task."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from structlog.typing import FilteringBoundLogger

from schemas.events import TaskCompleted, TaskFailed
from schemas.models import ModelFacts
from schemas.tasks import TaskMessage
from schemas.workers import Capability
from services.backends import OnChunk, OnModelProgress, Progress
from services.fleet.health import Health
from services.runtime.consumers import Queue
from services.runtime.settings import NatsAuth
from services.runtime.sleep import SleepPolicy


@dataclass(frozen=True, slots=True)
class LoopSettings:
    """What the loop needs of a kind's settings."""

    worker_id: str
    host: str
    heartbeat_interval_s: float
    worker_ttl_s: float
    ack_wait_s: float
    stop_grace_s: float
    # After the grace, how long a kind that can wrap up gets to record what it has; None:
    # the task is stopped at once and goes back to its queue.
    wrap_up_s: float | None = None
    # False: a task is never run a second time (a redelivered started task whose starter is
    # gone fails instead), and its work begins only once its claim is stored.
    runs_twice: bool = True
    sleep: SleepPolicy | None = None
    wol_mac: str | None = None
    # The watchdog's limit (`services.runtime.watchdog`), for a worker that is its own
    # process; None: no watchdog.
    watchdog_s: float | None = None
    # A worker with credentials (an identity, a password user) asks the router for what its
    # permissions keep it from doing itself: read its tasks' events
    # (`services.runtime.outcomes.RouterReads`), make its own consumer (`own_consumer`).
    through_router: bool = False


class WorkerIdentity(Protocol):
    """What every kind's settings share with the loop (`WorkerSettings`, `WebSearchSettings`)."""

    @property
    def worker_id(self) -> str: ...
    @property
    def worker_host(self) -> str: ...
    @property
    def heartbeat_interval_s(self) -> float: ...
    @property
    def worker_ttl_s(self) -> float: ...
    @property
    def ack_wait_s(self) -> float: ...
    @property
    def stop_grace_s(self) -> float: ...
    def nats_auth(self) -> NatsAuth: ...


def loop_settings(
    settings: WorkerIdentity,
    *,
    wrap_up_s: float | None = None,
    runs_twice: bool = True,
    sleep: SleepPolicy | None = None,
    wol_mac: str | None = None,
    watchdog_s: float | None = None,
) -> LoopSettings:
    """The loop's settings: the shared ones from the kind's settings, and the kind's policy."""
    return LoopSettings(
        worker_id=settings.worker_id,
        host=settings.worker_host,
        heartbeat_interval_s=settings.heartbeat_interval_s,
        worker_ttl_s=settings.worker_ttl_s,
        ack_wait_s=settings.ack_wait_s,
        stop_grace_s=settings.stop_grace_s,
        wrap_up_s=wrap_up_s,
        runs_twice=runs_twice,
        sleep=sleep,
        wol_mac=wol_mac,
        watchdog_s=watchdog_s,
        through_router=settings.nats_auth().proves_who(),
    )


@dataclass(frozen=True, slots=True)
class Attempt:
    """One claimed task, as a kind's `Kind.run` gets it."""

    task: TaskMessage
    progress: Progress  # call as output arrives: the message is not redelivered meanwhile
    on_chunk: OnChunk | None  # the stream's publisher, when the client streams
    cut: asyncio.Event  # set when a stop's grace is over: record what you have, now
    log: FilteringBoundLogger
    on_model_progress: OnModelProgress | None = None  # a streamed change's steps
    announce: Progress | None = None
    """Store the worker's registry entry now (what it serves changed: routing follows at once,
    not at the next heartbeat)."""


class Kind(Protocol):
    """What a worker kind does; everything else is the loop's."""

    @property
    def supports(self) -> Sequence[Capability]:
        """What the worker does, for routing: ``cpu_inference``, ``web_search``..."""
        ...

    @property
    def backend_kind(self) -> str:
        """For the registry: ``ollama``, ``openai``."""
        ...

    @property
    def address(self) -> str:
        """The backend's address, for the registry and the logs."""
        ...

    @property
    def models(self) -> list[str]:
        """The models served, by the names routing uses."""
        ...

    @property
    def facts(self) -> list[ModelFacts]: ...

    def queues(self) -> list[Queue]:
        """The queues to pull, the first one longest."""
        ...

    async def prepare(self, stop: asyncio.Event) -> None:
        """Before the lease: learn what is served (may wait for the backend while not stop)."""
        ...

    def serves(self, task: TaskMessage) -> bool:
        """Can this worker run a task from a checked (shared) queue?"""
        ...

    async def run(self, attempt: Attempt) -> TaskCompleted | TaskFailed:
        """The claimed task's outcome; an exception returns the task to its queue."""
        ...

    async def close(self) -> None: ...


class KindDefaults:
    """What a kind that leaves it out gets: no model facts, nothing to learn before the
    lease, every task of its queues served, nothing to close. A kind subclasses this and
    declares only what differs (`Kind` says what there is)."""

    @property
    def facts(self) -> list[ModelFacts]:
        return []

    async def prepare(self, stop: asyncio.Event) -> None:
        """Nothing to learn before the lease."""

    def serves(self, task: TaskMessage) -> bool:
        return True

    async def close(self) -> None:
        """Nothing of its own to close."""


class HealthWatch(Protocol):
    """A kind's watch on its own backend (the inference kind's `services.worker.probe`): the
    loop asks it to probe between tasks only, heartbeats what it says, and pulls nothing
    while it says ``degraded``."""

    @property
    def health(self) -> Health: ...

    @property
    def resident(self) -> list[str] | None:
        """The models the backend holds in memory (None: it cannot say)."""
        ...

    @property
    def model_memory(self) -> dict[str, int]:
        """The memory each model took when last seen loaded (bytes)."""
        ...

    @property
    def memory_bytes(self) -> int | None:
        """How much the backend holds of models (None: not known)."""
        ...

    @property
    def max_resident(self) -> int | None:
        """The most models seen in memory at once (None: not known)."""
        ...

    def due(self) -> bool:
        """Is a probe due now?"""
        ...

    async def check(self) -> None:
        """Run the probe that is due, if any."""
        ...
