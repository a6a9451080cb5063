"""The inference worker's watch on its own backend: probes between tasks, and the first-token
and progress timeouts of every generation. The rules (when to probe, what makes the worker
degraded or healthy) are `services.fleet.health`; this runs them against the backend.

The task loop asks `BackendProbe.check` between tasks only, so a probe never runs beside a
task (one generation at a time per worker), and reads `BackendProbe.health` into every
heartbeat. A degraded worker keeps its lease and heartbeats (it is alive) but pulls nothing
(`services.runtime.taskloop`); the router sends it nothing and the reaper moves what waits on
its queue.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import structlog

from services.backends import Backend, Progress
from services.fleet import health
from services.fleet.health import Failure, Health, HealthPolicy, ProbeKind
from services.runtime.errors import BackendError, BackendTimeout, BackendUnavailable

log = structlog.get_logger("worker")

T = TypeVar("T")

# The probe's prompt: any model answers it; one token is enough.
PROBE_PROMPT = "Reply with the single word OK."


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
    """How a task's backend failure counts for health: an unreachable or hanging backend is
    degraded at once; any other error (an error answer, the task's own timeout) asks for a
    generation probe."""
    stalled = isinstance(exc, BackendTimeout) and exc.stalled
    degrades = stalled or isinstance(exc, BackendUnavailable)
    return Failure(reason=f"{exc.code}: {exc.message}", degrades=degrades)


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
    ) -> None:
        self.backend = backend
        self.policy = policy
        self.served = served  # (name as the backend serves it, embedding-only?) per model
        self.first_token_s = first_token_s
        self.progress_s = progress_s
        self.health: Health = health.start(time.time())

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

    def task_ended(self, failure: Failure | None) -> None:
        """Fold in a task's backend call: it worked (None), or how it failed."""
        self._set(health.task_ended(self.health, failure, time.time()))

    def due(self) -> bool:
        """Is a probe due now (`check` would run one)?"""
        return health.due(self.health, self.policy, time.time()) is not None

    async def check(self) -> None:
        """Run the probe that is due, if any (between tasks only)."""
        kind = health.due(self.health, self.policy, time.time())
        if kind is None:
            return
        failure = await self._probe(kind)
        self._set(health.probed(self.health, kind, failure, time.time()))

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
            await self.backend.embed(model, ["OK"], timeout_s=self.first_token_s)
            return

        def generate(progress: Progress) -> Awaitable[object]:
            return self.backend.generate(
                model,
                PROBE_PROMPT,
                options={"num_predict": 1},
                timeout_s=self.first_token_s,
                progress=progress,
            )

        await watched(
            generate,
            None,
            first_token_s=self.first_token_s,
            progress_s=self.progress_s,
            what=f"{model} on {self.backend.address}",
        )
