"""The inference worker: one task at a time from its own queue, on its local model server.

The task loop (`services.runtime.taskloop`) does the pulling, claiming, keeping alive,
storing and acknowledging; this is the inference kind: which models the backend serves
(each one sanity-checked), what each can do, and one backend call per task (a generation
with everything the client asked for, the embeddings of an embedding task, or a change to
the machine's models: a pull, create, copy or removal, after which the worker lists its
models again, announces them at once and records what changed).
"""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import Awaitable
from contextlib import suppress

import msgspec
import structlog
from nats.aio.client import Client
from opentelemetry import trace

from schemas import message_ids
from schemas.events import Durations, ModelChanged, TaskCompleted, TaskFailed
from schemas.models import COMPLETION, EMBEDDING, ModelFacts, missing, name_variants, needs_of
from schemas.route import ModelProgress, ToolCall
from schemas.tasks import TaskMessage
from schemas.work import ModelChange, Work
from services.backends import Backend, Embedding, Generation, OnChunk, Progress, embedding_work
from services.backends.choose import make_backend
from services.errors import (
    BackendError,
    BackendUnavailable,
    BadRequest,
    ConfigError,
    CoordinatorError,
    InsufficientStorage,
)
from services.fleet.health import HealthPolicy
from services.runtime.aliases import AliasFollower, AliasPoller
from services.runtime.bus import connect, publish_event
from services.runtime.consumers import CPU_POOL, Queue, own_queue
from services.runtime.lifecycle import close_bus, stop_within
from services.runtime.settings import WorkerSettings
from services.runtime.sleep import SleepPolicy
from services.runtime.taskkind import Attempt, LoopSettings, loop_settings
from services.runtime.taskloop import TaskLoop
from services.worker.probe import BackendProbe, failure_of, runs_elsewhere, watched

log = structlog.get_logger("worker")
tracer = trace.get_tracer("coordinator.worker")

# A prompt any model can answer quickly; it only has to come back without an error.
SANITY_WORK = Work(prompt="Reply with the single word OK.", options={"num_predict": 8})


class Inference:
    """The inference kind: serves the backend's models, one backend call per task."""

    def __init__(self, nc: Client, settings: WorkerSettings, backend: Backend) -> None:
        self.js = nc.jetstream()
        self.settings = settings
        self.backend = backend
        self.supports = list(settings.worker_supports)
        self.backend_kind = settings.worker_backend
        # Model names as the backend serves them; registrations use their canonical names.
        self.served: list[str] = []
        # What the backend says of each served model, by its served name.
        self.served_facts: dict[str, ModelFacts] = {}
        # A worker with credentials asks the router for the map (it makes no consumer on
        # EVENTS); on a bus without users it follows the alias events itself.
        self.aliases: AliasFollower | AliasPoller = (
            AliasPoller(nc, settings.heartbeat_interval_s)
            if settings.nats_auth().proves_who()
            else AliasFollower(nc.jetstream())
        )
        self.probe = BackendProbe(
            backend,
            HealthPolicy(
                interval_s=settings.health_interval_s,
                idle_probe_s=settings.health_idle_probe_s or None,
            ),
            served=self.probe_targets,
            first_token_s=settings.first_token_timeout_s,
            progress_s=settings.progress_timeout_s,
            canonical=self.aliases.canonical,
            memory_bytes=settings.memory_bytes,
        )

    @property
    def address(self) -> str:
        return self.backend.address

    @property
    def models(self) -> list[str]:
        """The canonical names (aliases applied) of the models served: what routing sees."""
        return list(dict.fromkeys(self.aliases.canonical(name) for name in self.served))

    @property
    def facts(self) -> list[ModelFacts]:
        """Each served model's facts under its canonical name (what routing matches)."""
        return [
            msgspec.structs.replace(facts, name=self.aliases.canonical(name))
            for name, facts in self.served_facts.items()
            if name in self.served
        ]

    def probe_targets(self) -> list[tuple[str, bool]]:
        """Each served model by its backend name, and whether it only embeds (its probe is
        one embedding then: it refuses generation)."""
        return [(name, self._embeds_only(name)) for name in self.served]

    def _embeds_only(self, served_name: str) -> bool:
        capabilities = self.capabilities(served_name)
        return COMPLETION not in capabilities and EMBEDDING in capabilities

    def capabilities(self, served_name: str) -> list[str]:
        return self.served_facts.get(served_name, ModelFacts(name=served_name)).capabilities

    async def read_facts(self, models: list[str]) -> None:
        """Ask the backend what each model can do (capabilities, digest, size, details); a
        backend that cannot say leaves the defaults (completion only), logged."""
        try:
            self.served_facts = await self.backend.model_facts(models)
        except BackendError as exc:
            log.warning("model facts unavailable; registering defaults", error=exc.message)
            self.served_facts = {}
        for model in models:
            log.info("model capabilities", model=model, capabilities=self.capabilities(model))

    def backend_name(self, model: str) -> str:
        """The name the backend knows a model by, for a canonical (or served) name."""
        for name in self.served:
            if model in (name, self.aliases.canonical(name)):
                return name
        return model

    async def discover_models(self, stop: asyncio.Event) -> list[str]:
        """Ask the backend for its models, waiting (and saying so) while it is unreachable."""
        delay = 1.0
        while True:
            try:
                served = await self.backend.list_models()
                break
            except BackendUnavailable as exc:
                log.error(
                    "backend unreachable; waiting", backend=self.backend.address, error=exc.message
                )
            if stop.is_set():
                raise BackendUnavailable(f"stopped while waiting for {self.backend.address}")
            with suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=delay)
            delay = min(delay * 2, 30.0)
        wanted = self.settings.worker_models
        models = [
            m for m in served if not wanted or m in wanted or self.aliases.canonical(m) in wanted
        ]
        missing = sorted(set(wanted) - set(served) - {self.aliases.canonical(m) for m in served})
        if missing:
            log.warning("WORKER_MODELS names models the backend does not serve", missing=missing)
        if not models:
            raise ConfigError(
                f"the backend at {self.backend.address} serves no usable model "
                f"(serves: {', '.join(served) or 'none'}; "
                f"WORKER_MODELS: {', '.join(wanted) or 'any'})"
            )
        return models

    async def sanity_check(self, models: list[str]) -> list[str]:
        """Run a tiny prompt on each model; keep those that answer, fail the start if none do."""
        if not self.settings.sanity_check:
            return models
        passed: list[str] = []
        reasons: list[str] = []
        for model in models:
            try:
                total_ms = await self._sanity_run(model)
            except BackendError as exc:
                log.error("model left out: sanity run failed", model=model, error=exc.message)
                reasons.append(f"{model}: {exc.code}: {exc.message}")
                continue
            log.info("model passed its sanity run", model=model, total_ms=round(total_ms, 1))
            passed.append(model)
            # What each load leaves in memory: the most held at once is what routing takes
            # for the backend's limits when WORKER_MEMORY_GB is unset.
            await self.probe.read_resident()
        if not passed:
            raise ConfigError(
                f"no model passed its sanity run on {self.backend.address}: " + "; ".join(reasons)
            )
        return passed

    async def _sanity_run(self, model: str) -> float:
        """One tiny generation, or for an embedding-only model (which refuses generation) one
        tiny embedding; returns its total milliseconds."""
        if self._embeds_only(model):
            embedded = await self.backend.embed(
                model, embedding_work(["OK"]), timeout_s=self.settings.sanity_timeout_s
            )
            return embedded.durations.total_ms
        result = await self.backend.generate(
            model, SANITY_WORK, timeout_s=self.settings.sanity_timeout_s
        )
        return result.durations.total_ms

    def queues(self) -> list[Queue]:
        """The worker's own queues (one task in flight, enforced by the server), then the
        shared CPU queue for CPU workers (every such worker binds the same consumer)."""
        worker_id = self.settings.worker_id
        own = own_queue(worker_id)
        if not self.settings.shared_queue or "cpu_inference" not in self.supports:
            return [own]
        return [own, CPU_POOL]

    async def prepare(self, stop: asyncio.Event) -> None:
        """Follow the aliases, learn the models and their facts, keep those that pass."""
        await self.aliases.start()
        discovered = await self.discover_models(stop)
        await self.read_facts(discovered)
        self.served = await self.sanity_check(discovered)
        self.probe.restart()
        await self.probe.read_resident()  # the sanity runs loaded what fits

    def serves(self, task: TaskMessage) -> bool:
        """A shared task is for this worker if it has the model with what the task needs."""
        return task.model in self.models and not missing(
            needs_of(task.work), self.capabilities(self.backend_name(task.model))
        )

    async def close(self) -> None:
        await self.aliases.stop()

    async def run(self, attempt: Attempt) -> TaskCompleted | TaskFailed:
        """One backend call; a backend error is the task's failure, one another worker may
        run again (`runs_elsewhere`) unless output of it was streamed already."""
        task = attempt.task
        if task.work.task_type == "model_change":
            return await self._change_models(attempt)
        started = time.perf_counter()
        streamed = False
        on_chunk = attempt.on_chunk
        if on_chunk is not None:
            passed_on = on_chunk

            async def noted(
                response: str, thinking: str, tool_calls: list[ToolCall] | None = None
            ) -> None:
                nonlocal streamed
                streamed = True
                await passed_on(response, thinking, tool_calls)

            on_chunk = noted
        try:
            with tracer.start_as_current_span(
                "backend embed" if task.work.task_type == "embedding" else "backend generate",
                kind=trace.SpanKind.CLIENT,
                attributes={"server.address": self.backend.address, "model": task.model},
            ):
                result = await self._call_backend(task, attempt.progress, on_chunk)
        except BackendError as exc:
            self.probe.task_ended(failure_of(exc))
            return self._failed(task, exc, started, retryable=runs_elsewhere(exc, streamed))
        self.probe.task_ended(None, self.backend_name(task.model), task.work.keep_alive)
        if isinstance(result, Embedding):
            return TaskCompleted(
                at=time.time(),
                task_id=task.task_id,
                attempt=task.attempt,
                worker=self.settings.worker_id,
                model=task.model,
                response="",
                durations=result.durations,
                tokens=result.tokens,
                embeddings=result.vectors,
            )
        return TaskCompleted(
            at=time.time(),
            task_id=task.task_id,
            attempt=task.attempt,
            worker=self.settings.worker_id,
            model=task.model,
            response=result.response,
            thinking=result.thinking,
            durations=msgspec.structs.replace(
                result.durations, first_token_ms=result.first_token_ms
            ),
            tokens=result.tokens,
            tool_calls=result.tool_calls,
            done_reason=result.done_reason,
        )

    async def _change_models(self, attempt: Attempt) -> TaskCompleted | TaskFailed:
        """Make the task's change to the machine's models through the backend, then list the
        models again and announce them (routing, aliases and statistics follow at once), and
        record what changed (`ModelChanged`). Never run elsewhere: a failure is the task's."""
        task, change = attempt.task, attempt.task.work.change
        started = time.perf_counter()
        try:
            if change is None:
                raise BadRequest("a model_change task carries no change")
            self._check_space(change)
            name = self._served_name(task.model) if change.op == "delete" else task.model
            source = self._served_name(change.source) if change.source else None
            if source is not None:
                change = msgspec.structs.replace(change, source=source)

            async def on_progress(step: ModelProgress) -> None:
                await attempt.progress()
                if attempt.on_model_progress is not None:
                    await attempt.on_model_progress(step)

            with tracer.start_as_current_span(
                f"backend {change.op}",
                kind=trace.SpanKind.CLIENT,
                attributes={"server.address": self.backend.address, "model": name},
            ):
                await self.backend.change_model(
                    name, change, timeout_s=task.timeout_s, on_progress=on_progress
                )
        except (BackendError, BadRequest) as exc:
            attempt.log.warning("model change failed", model=task.model, error=exc.message)
            return self._failed(task, exc, started)
        name, digest = await self._learn_changed(name)
        if attempt.announce is not None:
            with suppress(Exception):  # the next heartbeat says it anyway
                await attempt.announce()
        changed = ModelChanged(
            at=time.time(),
            worker_id=self.settings.worker_id,
            task_id=task.task_id,
            op=change.op,
            model=name,
            source=change.source,
            digest=digest,
        )
        try:
            await publish_event(
                self.js, changed, msg_id=message_ids.model_changed(task.task_id, task.attempt)
            )
        except Exception as exc:  # made, and said in the outcome: never undone or run again
            attempt.log.warning("the model change was not recorded", error=repr(exc))
        attempt.log.info("models changed", op=change.op, model=name, digest=digest)
        done = "removed" if change.op == "delete" else f"{change.op} done, digest {digest or '?'}"
        return TaskCompleted(
            at=time.time(),
            task_id=task.task_id,
            attempt=task.attempt,
            worker=self.settings.worker_id,
            model=task.model,
            response=f"{name} on {self.settings.worker_id}: {done}",
            durations=Durations(total_ms=(time.perf_counter() - started) * 1000),
        )

    def _failed(
        self, task: TaskMessage, exc: CoordinatorError, started: float, *, retryable: bool = False
    ) -> TaskFailed:
        """The task's failure for ``exc``, with the time it took since ``started``."""
        return TaskFailed(
            at=time.time(),
            task_id=task.task_id,
            attempt=task.attempt,
            worker=self.settings.worker_id,
            code=exc.code,
            reason=exc.message,
            retryable=retryable,
            durations=Durations(total_ms=(time.perf_counter() - started) * 1000),
        )

    def _check_space(self, change: ModelChange) -> None:
        """Refuse a pull the machine has no room for, before it starts (when both the model's
        size and where the backend keeps its models are known)."""
        where = self.settings.models_dir
        if change.op != "pull" or not change.size or where is None:
            return
        free = shutil.disk_usage(where).free
        if free < change.size:
            raise InsufficientStorage(
                f"{self.settings.worker_id} has {free / 1e9:.1f} GB free in {where}, and the "
                f"model takes {change.size / 1e9:.1f} GB"
            )

    def _served_name(self, model: str) -> str:
        """The name the backend lists ``model`` under (``jp`` is ``jp:latest``), if it does."""
        variants = name_variants(self.backend_name(model))
        return next((name for name in self.served if name in variants), model)

    async def _learn_changed(self, name: str) -> tuple[str, str]:
        """List the backend's models again after a change (with their facts), keeping the
        wanted ones (``WORKER_MODELS``; a model just pulled or made is served: it was asked
        for by name); ``name`` as the backend lists it now, and its digest ('' once gone)."""
        try:
            listed = await self.backend.list_models()
        except BackendError as exc:
            log.warning("models not listed again after a change", error=exc.message)
            return name, ""
        wanted = self.settings.worker_models
        changed = name_variants(name)
        kept = [m for m in listed if not wanted or m in wanted or m in changed or m in self.served]
        await self.read_facts(kept)
        self.served = kept
        listed_as = next((m for m in changed if m in self.served_facts), None)
        if listed_as is None:
            return name, ""
        return listed_as, self.served_facts[listed_as].digest

    def _call_backend(
        self, task: TaskMessage, progress: Progress, on_chunk: OnChunk | None
    ) -> Awaitable[Generation | Embedding]:
        """The backend call a task asks for: one embedding call for every input of an
        embedding task, else a generation with everything the client asked for."""
        model = self.backend_name(task.model)
        if task.work.task_type == "embedding":
            return self.backend.embed(model, task.work, timeout_s=task.timeout_s)

        def generate(alive: Progress) -> Awaitable[Generation]:
            return self.backend.generate(
                model, task.work, timeout_s=task.timeout_s, progress=alive, on_chunk=on_chunk
            )

        # Every generation within the first-token and progress timeouts: a hung backend is
        # noticed in `FIRST_TOKEN_TIMEOUT_S`, not the task's timeout.
        return watched(
            generate,
            progress,
            first_token_s=self.settings.first_token_timeout_s,
            progress_s=self.settings.progress_timeout_s,
            what=f"{model} on {self.backend.address}",
        )


def inference_loop_settings(settings: WorkerSettings, *, own_process: bool = False) -> LoopSettings:
    """The task loop's part of a worker's settings: a task goes back to its queue at a stop,
    and an idle worker may sleep. A worker that is its own process has a watchdog (one among
    other services, under ``coordinator up``, stalls with its reaper: nothing is moved)."""
    return loop_settings(
        settings,
        sleep=SleepPolicy(
            idle_shutdown_s=settings.idle_shutdown_sec,
            min_uptime_s=settings.min_uptime_sec,
            check_interval_s=settings.idle_check_interval_sec,
            shutdown_command=settings.shutdown_command,
        ),
        wol_mac=settings.wol_mac,
        watchdog_s=settings.watchdog_s if own_process and settings.watchdog_s > 0 else None,
    )


async def serve(
    nc: Client,
    settings: WorkerSettings,
    backend: Backend,
    stop: asyncio.Event,
    *,
    own_process: bool = False,
) -> None:
    """Run the inference kind on the task loop until ``stop`` (raises `LeaseLost` if taken over)."""
    kind = Inference(nc, settings, backend)
    loop = inference_loop_settings(settings, own_process=own_process)
    await TaskLoop(nc, kind, loop, health=kind.probe).run(stop)


async def run(settings: WorkerSettings, stop: asyncio.Event, *, own_process: bool = False) -> None:
    """Run one worker until ``stop`` is set; ``own_process``: it is the process's only
    service (``coordinator worker``), which gets a watchdog (`services.runtime.watchdog`)."""
    nc = await connect(
        settings.nats_url, f"coordinator-worker-{settings.worker_id}", auth=settings.nats_auth()
    )
    backend = make_backend(
        settings.worker_backend,
        ollama_host=settings.ollama_host,
        openai_base_url=settings.openai_base_url,
        openai_api_key=settings.openai_api_key,
        connect_timeout_s=settings.backend_connect_timeout_s,
    )
    try:
        await serve(nc, settings, backend, stop, own_process=own_process)
    finally:
        await stop_within("close the backend's connections", backend.aclose())
        await close_bus(nc)
