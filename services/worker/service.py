"""The worker service: one task at a time from its own queue, on its local model server.

The durable consumer has ``max_ack_pending=1``, so the server itself never hands this worker id
a second task while one is unacknowledged, however many processes bind. A task's message is
acknowledged only after its outcome event is stored: a crash in between means redelivery, and
the redelivered copy first checks whether the outcome already exists.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from contextlib import suppress

import msgspec
import nats.errors
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import BadRequestError, NotFoundError

from schemas.events import (
    TERMINAL_KINDS,
    Durations,
    TaskCompleted,
    TaskFailed,
    TaskStarted,
    WorkerRegistered,
    WorkerStopped,
    task_event_decoder,
)
from schemas.subjects import EVENTS_STREAM, TASKS_STREAM, task_event, worker_queue_filter
from schemas.tasks import TaskMessage
from schemas.workers import WorkerRecord
from services import __version__
from services.runtime.bus import connect, ensure_streams, publish_event
from services.runtime.errors import BackendError, BackendUnavailable, ConfigError
from services.runtime.lease import Lease, LeaseLost
from services.runtime.settings import WorkerSettings
from services.worker.backends import Backend
from services.worker.backends.ollama import OllamaBackend
from services.worker.backends.openai import OpenAIBackend

log = structlog.get_logger("worker")

_task_decoder = msgspec.json.Decoder(TaskMessage)
_encoder = msgspec.json.Encoder()

# A prompt any model can answer quickly; it only has to come back without an error.
SANITY_PROMPT = "Reply with the single word OK."

# How many times an outcome event is retried before the message is returned for redelivery.
OUTCOME_PUBLISH_TRIES = 5


def consumer_name(worker_id: str) -> str:
    return f"worker-{worker_id}"


class Worker:
    """Registers, heartbeats and runs tasks strictly one at a time."""

    def __init__(self, nc: Client, settings: WorkerSettings, backend: Backend) -> None:
        self.nc = nc
        self.js: JetStreamContext = nc.jetstream()
        self.settings = settings
        self.backend = backend
        self.instance_id = uuid.uuid4().hex[:12]
        self.models: list[str] = []
        self.started_at = time.time()
        self.current_task: str | None = None
        self.completed = 0
        self.failed = 0
        self.lease: Lease | None = None

    # -- start ---------------------------------------------------------------------------------

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
        models = [m for m in served if not wanted or m in wanted]
        missing = sorted(set(wanted) - set(served))
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
                result = await self.backend.generate(
                    model,
                    SANITY_PROMPT,
                    options={"num_predict": 8},
                    timeout_s=self.settings.sanity_timeout_s,
                )
            except BackendError as exc:
                log.error("model left out: sanity run failed", model=model, error=exc.message)
                reasons.append(f"{model}: {exc.code}: {exc.message}")
                continue
            log.info(
                "model passed its sanity run",
                model=model,
                total_ms=round(result.durations.total_ms, 1),
            )
            passed.append(model)
        if not passed:
            raise ConfigError(
                f"no model passed its sanity run on {self.backend.address}: " + "; ".join(reasons)
            )
        return passed

    def record(self) -> WorkerRecord:
        return WorkerRecord(
            worker_id=self.settings.worker_id,
            host=self.settings.worker_host,
            instance_id=self.instance_id,
            pid=os.getpid(),
            version=__version__,
            supports=list(self.settings.worker_supports),
            models=self.models,
            started_at=self.started_at,
            heartbeat_at=time.time(),
            state="busy" if self.current_task else "idle",
            current_task=self.current_task,
            backend=self.settings.worker_backend,
            wol_mac=self.settings.wol_mac,
        )

    async def ensure_consumer(self) -> JetStreamContext.PullSubscription:
        name = consumer_name(self.settings.worker_id)
        config = ConsumerConfig(
            durable_name=name,
            filter_subject=worker_queue_filter(self.settings.worker_id),
            ack_policy=AckPolicy.EXPLICIT,
            deliver_policy=DeliverPolicy.ALL,
            max_ack_pending=1,
            ack_wait=self.settings.ack_wait_s,
        )
        try:
            await self.js.add_consumer(TASKS_STREAM, config)
        except BadRequestError as exc:
            # Exists with other settings (an older version made it); keep it rather than
            # deleting a consumer another instance may be bound to.
            log.warning(
                "consumer exists with other settings; binding to it", consumer=name, error=str(exc)
            )
        return await self.js.pull_subscribe_bind(durable=name, stream=TASKS_STREAM)

    # -- work ----------------------------------------------------------------------------------

    async def start(self, stop: asyncio.Event) -> JetStreamContext.PullSubscription:
        """Learn the models, take the lease, bind the consumer and announce the worker."""
        self.models = await self.sanity_check(await self.discover_models(stop))
        kv = await ensure_streams(self.js, worker_ttl_s=self.settings.worker_ttl_s)
        self.lease = Lease(kv, self.settings.worker_id, self.settings.worker_ttl_s, self.record)
        await self.lease.acquire()
        sub = await self.ensure_consumer()
        await publish_event(
            self.js,
            WorkerRegistered(
                at=time.time(),
                worker_id=self.settings.worker_id,
                host=self.settings.worker_host,
                instance_id=self.instance_id,
                models=self.models,
                supports=list(self.settings.worker_supports),
                version=__version__,
            ),
        )
        log.info(
            "worker ready",
            worker_id=self.settings.worker_id,
            models=self.models,
            backend=self.backend.address,
            supports=self.settings.worker_supports,
        )
        return sub

    async def run(self, stop: asyncio.Event) -> None:
        """Start, pull tasks until ``stop`` (or the lease is lost), then stop cleanly."""
        sub = await self.start(stop)
        assert self.lease is not None
        beats = asyncio.create_task(self.lease.keep(self.settings.heartbeat_interval_s))
        try:
            await self.serve(sub, stop)
        finally:
            beats.cancel()
            with suppress(asyncio.CancelledError):
                await beats
            with suppress(Exception):
                await sub.unsubscribe()
            await self._deregister("lease lost" if self.lease.lost.is_set() else "stopped")
        log.info("worker stopped", completed=self.completed, failed=self.failed)
        if self.lease.lost.is_set():
            raise LeaseLost(f"worker '{self.settings.worker_id}' stopped: its lease was taken over")

    async def serve(self, sub: JetStreamContext.PullSubscription, stop: asyncio.Event) -> None:
        """Pull and run tasks one at a time until ``stop`` is set or the lease is lost."""
        lost = self.lease.lost if self.lease is not None else asyncio.Event()
        while not stop.is_set() and not lost.is_set():
            try:
                msgs = await sub.fetch(1, timeout=1.0)
            except (nats.errors.TimeoutError, TimeoutError):
                continue
            except Exception as exc:
                log.warning("fetch failed", error=repr(exc))
                await asyncio.sleep(0.5)
                continue
            for msg in msgs:
                await self._run_guarded(msg, stop)

    async def _run_guarded(self, msg: Msg, stop: asyncio.Event) -> None:
        """Run one task; on stop, give it ``stop_grace_s`` and then return it to the queue."""
        work = asyncio.create_task(self.handle(msg))
        stopping = asyncio.create_task(stop.wait())
        try:
            await asyncio.wait({work, stopping}, return_when=asyncio.FIRST_COMPLETED)
            if not work.done():
                done, _ = await asyncio.wait({work}, timeout=self.settings.stop_grace_s)
                if not done:
                    log.warning(
                        "stopping: returning the current task to its queue",
                        task_id=self.current_task,
                    )
                    work.cancel()
                    with suppress(asyncio.CancelledError):
                        await work
                    with suppress(Exception):
                        await msg.nak()
                    return
            await work
        finally:
            stopping.cancel()

    async def handle(self, msg: Msg) -> None:
        """Run one task message to an outcome event, then acknowledge it."""
        try:
            task = _task_decoder.decode(msg.data)
        except msgspec.DecodeError as exc:
            log.error("dropping undecodable task message", subject=msg.subject, error=str(exc))
            await msg.term()
            return
        bound = log.bind(
            task_id=task.task_id,
            attempt=task.attempt,
            subject=msg.subject,
            stream_seq=msg.metadata.sequence.stream,
        )
        if msg.metadata.num_delivered > 1 and await self._already_ended(task):
            bound.info("redelivered task had already ended; acknowledging")
            await msg.ack()
            return
        self.current_task = task.task_id
        try:
            await publish_event(
                self.js,
                TaskStarted(
                    at=time.time(),
                    task_id=task.task_id,
                    attempt=task.attempt,
                    worker=self.settings.worker_id,
                    host=self.settings.worker_host,
                ),
            )
            outcome = await self._generate(task, msg)
            await self._store_outcome(outcome)
            await msg.ack()
        except Exception as exc:
            # The outcome could not be stored: return the task so it is not lost.
            bound.error("task not finished; returned to the queue", error=repr(exc))
            with suppress(Exception):
                await msg.nak(delay=1)
            return
        finally:
            self.current_task = None
        if isinstance(outcome, TaskCompleted):
            self.completed += 1
            bound.info("task done", total_ms=round(outcome.durations.total_ms, 1))
        else:
            self.failed += 1
            bound.warning("task failed", code=outcome.code, reason=outcome.reason)

    async def _generate(self, task: TaskMessage, msg: Msg) -> TaskCompleted | TaskFailed:
        last_progress = time.monotonic()
        interval = self.settings.ack_wait_s / 3

        async def progress() -> None:
            nonlocal last_progress
            if time.monotonic() - last_progress >= interval:
                last_progress = time.monotonic()
                await msg.in_progress()

        async def keepalive() -> None:
            # Also while the backend is silent (loading a model, thinking without streaming).
            while True:
                await asyncio.sleep(interval)
                await progress()

        alive = asyncio.create_task(keepalive())
        started = time.perf_counter()
        try:
            result = await self.backend.generate(
                task.model,
                task.prompt,
                options=task.options,
                timeout_s=task.timeout_s,
                progress=progress,
            )
        except BackendError as exc:
            return TaskFailed(
                at=time.time(),
                task_id=task.task_id,
                attempt=task.attempt,
                worker=self.settings.worker_id,
                code=exc.code,
                reason=exc.message,
                retryable=exc.retryable,
                durations=Durations(total_ms=(time.perf_counter() - started) * 1000),
            )
        finally:
            alive.cancel()
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
        )

    async def _store_outcome(self, outcome: TaskCompleted | TaskFailed) -> None:
        # The message id makes a retried publish (or a redelivered task) store one outcome.
        msg_id = f"{outcome.task_id}:{outcome.attempt}:outcome"
        delay = 0.2
        for attempt in range(OUTCOME_PUBLISH_TRIES):
            try:
                await publish_event(self.js, outcome, msg_id=msg_id)
                return
            except Exception as exc:
                if attempt == OUTCOME_PUBLISH_TRIES - 1:
                    raise
                log.warning(
                    "storing the outcome failed; retrying", task_id=outcome.task_id, error=repr(exc)
                )
                await asyncio.sleep(delay)
                delay *= 2

    async def _already_ended(self, task: TaskMessage) -> bool:
        for kind in TERMINAL_KINDS:
            try:
                stored = await self.js.get_last_msg(EVENTS_STREAM, task_event(task.task_id, kind))
            except NotFoundError:
                continue
            event = task_event_decoder.decode(stored.data or b"")
            if isinstance(event, TaskCompleted | TaskFailed) and event.attempt >= task.attempt:
                return True
        return False

    async def _deregister(self, reason: str) -> None:
        if self.lease is None:
            return
        await self.lease.release()
        with suppress(Exception):
            await publish_event(
                self.js,
                WorkerStopped(
                    at=time.time(),
                    worker_id=self.settings.worker_id,
                    instance_id=self.instance_id,
                    reason=reason,
                ),
            )


def make_backend(settings: WorkerSettings) -> Backend:
    """The model-server client this worker's settings choose."""
    if settings.worker_backend == "openai":
        return OpenAIBackend(
            settings.openai_base_url,
            api_key=settings.openai_api_key,
            connect_timeout_s=settings.backend_connect_timeout_s,
        )
    return OllamaBackend(settings.ollama_host, connect_timeout_s=settings.backend_connect_timeout_s)


async def run(settings: WorkerSettings, stop: asyncio.Event) -> None:
    """Run one worker until ``stop`` is set."""
    nc = await connect(settings.nats_url, f"coordinator-worker-{settings.worker_id}")
    backend = make_backend(settings)
    try:
        await Worker(nc, settings, backend).run(stop)
    finally:
        await backend.aclose()
        with suppress(Exception):
            await nc.drain()
