"""The inference worker's watch on its own backend: probes between tasks, and the first-token
and progress timeouts of every generation. The rules (when to probe, what makes the worker
degraded or healthy) are `services.fleet.health`; this runs them against the backend.

The task loop asks `BackendProbe.check` between tasks only, so a probe never runs beside a
task (one generation at a time per worker), and reads `BackendProbe.health` and
`BackendProbe.resident` (the models the backend holds in memory, with what it was seen to
hold: `BackendProbe.model_memory`, `memory_bytes`, `max_resident`) into every heartbeat. A
degraded worker keeps its lease and heartbeats (it is alive) but pulls nothing
(`services.runtime.taskloop`); the router sends it nothing and the reaper moves what waits on
its queue.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import structlog

from schemas.work import Work
from services.backends import Backend, Progress, embedding_work
from services.errors import (
    BackendError,
    BackendServerError,
    BackendTimeout,
    BackendUnavailable,
)
from services.fleet import health
from services.fleet.health import Failure, Health, HealthPolicy, ProbeKind

log = structlog.get_logger("worker")

T = TypeVar("T")

# The probe's generation: any model answers it; one token is enough.
PROBE_WORK = Work(prompt="Reply with the single word OK.", options={"num_predict": 1})


async def watched(
    call: Callable[[Progress], Awaitable[T]],
    progress: Progress | None,
    *,
    first_token_s: float,
    progress_s: float,
    what: str,
) -> T:
    """Run a streamed backend ``call`` (given the progress callback to call per streamed
    line) within a first-token and a progress timeout: no line within ``first_token_s``, or
    none for ``progress_s`` after one, stops the call (which closes its connection, so the
    backend stops generating) and raises a stalled `BackendTimeout` naming ``what``."""
    clock = asyncio.get_running_loop()
    seen = False
    try:
        async with asyncio.timeout(first_token_s) as deadline:

            async def alive() -> None:
                nonlocal seen
                seen = True
                deadline.reschedule(clock.time() + progress_s)
                if progress is not None:
                    await progress()

            return await call(alive)
    except TimeoutError as exc:
        if not deadline.expired():
            raise  # not this deadline's
        if not seen:
            raise BackendTimeout(
                f"no first token from {what} within {first_token_s:g} s", stalled=True
            ) from exc
        raise BackendTimeout(
            f"{what} stalled: nothing streamed for {progress_s:g} s", stalled=True
        ) from exc


def failure_of(exc: BackendError) -> Failure:
    """How a task's backend failure counts for health: a backend unreachable (a connection
    refused or reset), hanging (no first token in time, a stalled stream) or failing at its
    own work (an HTTP 5xx, an error mid-stream) is degraded at once, so nothing more is
    routed to it until a probe finds it working; any other failure (a refusal of the
    request, the task's own timeout) asks for a generation probe."""
    stalled = isinstance(exc, BackendTimeout) and exc.stalled
    degrades = stalled or isinstance(exc, BackendUnavailable | BackendServerError)
    return Failure(reason=f"{exc.code}: {exc.message}", degrades=degrades)


def runs_elsewhere(exc: BackendError, streamed: bool) -> bool:
    """May the task whose backend call failed with ``exc`` be run again by another worker
    (its failure retryable: the reaper moves it)? When the failure is the backend's own
    (`retryable` by its class: unreachable, reset, a 5xx, a timeout) and no output of it
    reached the client yet: a streamed answer cut off midway is not run again, since a new
    answer would not continue what the client has."""
    return exc.retryable and not streamed


class BackendProbe:
    """Keeps the worker's `Health` from probes and task outcomes."""

    def __init__(
        self,
        backend: Backend,
        policy: HealthPolicy,
        *,
        served: Callable[[], list[tuple[str, bool]]],
        first_token_s: float,
        progress_s: float,
        canonical: Callable[[str], str] = str,
        memory_bytes: int | None = None,
    ) -> None:
        self.backend = backend
        self.policy = policy
        self.served = served  # (name as the backend serves it, embedding-only?) per model
        self.canonical = canonical  # the name routing uses, for a served name
        self.first_token_s = first_token_s
        self.progress_s = progress_s
        self.health: Health = health.start(time.time())
        # The models the backend holds in memory, by served name (None: not known), and
        # whether to ask it again before the next task.
        self._resident: frozenset[str] | None = None
        self._reread = False
        # What the backend's memory was seen to hold; the operator's limit (WORKER_MEMORY_GB).
        self._memory = health.MemorySeen()
        self._memory_limit = memory_bytes

    @property
    def resident(self) -> list[str] | None:
        """The served models the backend holds in memory, by the names routing uses; None
        when the backend cannot say (or did not answer)."""
        if self._resident is None:
            return None
        held = self._resident
        return sorted({self.canonical(name) for name, _ in self.served() if name in held})

    @property
    def model_memory(self) -> dict[str, int]:
        """The memory each served model took when last seen loaded, by the name routing
        uses."""
        sizes = self._memory.sizes
        return {self.canonical(name): sizes[name] for name, _ in self.served() if name in sizes}

    @property
    def memory_bytes(self) -> int | None:
        """How much the backend holds of models: the operator's limit, else the largest
        total seen loaded at once; None before anything was seen loaded."""
        if self._memory_limit is not None:
            return self._memory_limit
        return self._memory.most_bytes or None

    @property
    def max_resident(self) -> int | None:
        """The most models seen loaded at once; None before anything was."""
        return self._memory.most_models or None

    def _set(self, after: Health) -> None:
        before, self.health = self.health, after
        if after.status == before.status and after.reason == before.reason:
            return
        if after.status == "degraded":
            log.warning("backend degraded", backend=self.backend.address, reason=after.reason)
        else:
            down_s = round(time.time() - before.since, 1)
            log.info("backend healthy again", backend=self.backend.address, degraded_s=down_s)

    def restart(self) -> None:
        """The models have just passed their sanity runs: healthy from now."""
        self.health = health.start(time.time())

    def task_ended(
        self,
        failure: Failure | None,
        ran: str | None = None,
        keep_alive: float | str | None = None,
    ) -> None:
        """Fold in a task's backend call: it worked (None), or how it failed; ``ran`` is the
        model it ran (by served name) with the task's ``keep_alive``."""
        self._set(health.task_ended(self.health, failure, time.time()))
        if failure is None and ran is not None:
            self._resident, reread = health.resident_after_task(self._resident, ran, keep_alive)
            self._reread = self._reread or reread

    def due(self) -> bool:
        """Is a probe due now (`check` would run one, or read the models in memory)?"""
        return self._reread or health.due(self.health, self.policy, time.time()) is not None

    async def check(self) -> None:
        """Run the probe that is due, if any (between tasks only), then read which models
        the backend holds in memory (a probe may have loaded some)."""
        kind = health.due(self.health, self.policy, time.time())
        if kind is None and not self._reread:
            return
        if kind is not None:
            failure = await self._probe(kind)
            self._set(health.probed(self.health, kind, failure, time.time()))
        await self.read_resident()

    async def read_resident(self) -> None:
        """Ask the backend which models it holds in memory; not known when it cannot say
        (an OpenAI-compatible server) or does not answer."""
        self._reread = False
        try:
            found = await asyncio.wait_for(
                self.backend.resident_models(), timeout=self.first_token_s
            )
        except (BackendError, TimeoutError) as exc:
            if self._resident is not None:
                log.warning("models in memory unknown", backend=self.backend.address, error=exc)
            self._resident = None
            return
        if found is None:
            self._resident = None
            return
        self._resident = frozenset(found)
        self._memory = health.memory_seen(self._memory, found)

    async def _probe(self, kind: ProbeKind) -> str | None:
        """What is wrong with the backend (None: nothing), by a probe of ``kind``."""
        try:
            await asyncio.wait_for(self.backend.list_models(), timeout=self.first_token_s)
        except TimeoutError:
            return f"backend_timeout: the model list took over {self.first_token_s:g} s"
        except BackendError as exc:
            return f"{exc.code}: {exc.message}"
        if kind == "list":
            return None
        for model, embeds_only in self.served():
            try:
                await self._one_token(model, embeds_only)
            except BackendError as exc:
                return f"probe of {model}: {exc.code}: {exc.message}"
        return None

    async def _one_token(self, model: str, embeds_only: bool) -> None:
        """One token of ``model`` (one embedding of an embedding-only one), within the
        first-token timeout."""
        if embeds_only:
            await self.backend.embed(model, embedding_work(["OK"]), timeout_s=self.first_token_s)
            return

        def generate(progress: Progress) -> Awaitable[object]:
            return self.backend.generate(
                model, PROBE_WORK, timeout_s=self.first_token_s, progress=progress
            )

        await watched(
            generate,
            None,
            first_token_s=self.first_token_s,
            progress_s=self.progress_s,
            what=f"{model} on {self.backend.address}",
        )
