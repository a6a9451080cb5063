"""The worker service: one task at a time from its own queue, on its local model server.

The durable consumer has ``max_ack_pending=1``, so the server itself never hands this worker id
a second task while one is unacknowledged, however many processes bind. A task's message is
acknowledged only after its outcome event is stored: a crash in between means redelivery, and
the redelivered copy first checks whether the outcome already exists.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable
from contextlib import suppress

import msgspec
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import BadRequestError
from opentelemetry import trace
from structlog.typing import FilteringBoundLogger

from schemas.events import (
    Durations,
    TaskCompleted,
    TaskFailed,
    TaskStarted,
    WorkerAsleep,
    WorkerRegistered,
)
from schemas.models import COMPLETION, EMBEDDING, ModelFacts, missing
from schemas.route import CHUNK_HEADER, CancelRequest, StreamChunk, ToolCall
from schemas.subjects import (
    ASLEEP_BUCKET,
    CANCEL_NOTICES,
    SHARED_CONSUMER,
    SHARED_CPU_QUEUE,
    TASKS_STREAM,
    task_event,
    worker_consumer,
    worker_queue_filter,
)
from schemas.tasks import TaskMessage, needs_of
from schemas.workers import WorkerRecord
from services import __version__
from services.backends import Backend, Embedding, Generation, OnChunk, Progress
from services.backends.ollama import OllamaBackend
from services.backends.openai import OpenAIBackend
from services.runtime.aliases import AliasFollower
from services.runtime.bus import (
    connect,
    ensure_bucket,
    ensure_streams,
    fences_by_subject,
    is_wrong_last_sequence,
    publish_event,
)
from services.runtime.errors import (
    BackendError,
    BackendUnavailable,
    Cancelled,
    ConfigError,
    TooLarge,
)
from services.runtime.lease import Lease, LeaseLost, deregister
from services.runtime.outcomes import KeepAlive, current_attempt, store_outcome, stored_outcome
from services.runtime.pull import pull_one
from services.runtime.settings import WorkerSettings
from services.runtime.tracing import extract_context
from services.worker.idle import should_sleep

log = structlog.get_logger("worker")
tracer = trace.get_tracer("coordinator.worker")

_task_decoder = msgspec.json.Decoder(TaskMessage)
_cancel_decoder = msgspec.json.Decoder(CancelRequest)
_encoder = msgspec.json.Encoder()

# A prompt any model can answer quickly; it only has to come back without an error.
SANITY_PROMPT = "Reply with the single word OK."
# What headers and the event's own fields add to an outcome beyond its answer: an outcome is
# checked against the server's max_payload with this much room left.
OUTCOME_HEADROOM_BYTES = 1024


SHARED_MAX_ACK_PENDING = 1_000
# Long-poll times: the own queue long (tasks for this worker), the shared one short (so a task
# routed to this worker waits at most this long while the worker looks at the shared queue).
OWN_POLL_S = 1.0
SHARED_POLL_S = 0.2
# Cancel notices kept for tasks this worker may take later (queued ones); oldest forgotten first.
CANCEL_MEMORY = 1024


def _refused(claim: asyncio.Future[bool]) -> bool:
    """Has the attempt's claim come back refused (a stale copy)?"""
    if not claim.done() or claim.cancelled() or claim.exception() is not None:
        return False
    return not claim.result()


class Worker:
    """Registers, heartbeats and runs tasks strictly one at a time."""

    def __init__(self, nc: Client, settings: WorkerSettings, backend: Backend) -> None:
        self.nc = nc
        self.js: JetStreamContext = nc.jetstream()
        self.settings = settings
        self.backend = backend
        self.instance_id = uuid.uuid4().hex[:12]
        # Model names as the backend serves them; registrations use their canonical names.
        self.served: list[str] = []
        # What the backend says of each served model, by its served name.
        self.served_facts: dict[str, ModelFacts] = {}
        self.aliases = AliasFollower(self.js)
        self.started_at = time.time()
        self.current_task: str | None = None
        self._running: asyncio.Task[bool] | None = None  # the task `_stop_watch` may cancel
        self.current_model: str | None = None
        self.completed = 0
        self.failed = 0
        self.cancelled = 0
        # task id -> why it was cancelled, from `CANCEL_NOTICES`.
        self._cancels: OrderedDict[str, str] = OrderedDict()
        self._generation: asyncio.Future[Generation | Embedding] | None = None
        self._cancel_sub: Subscription | None = None
        self.lease: Lease | None = None
        self.last_activity = self.started_at
        self.asleep = asyncio.Event()

    # -- start ---------------------------------------------------------------------------------

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
        if not passed:
            raise ConfigError(
                f"no model passed its sanity run on {self.backend.address}: " + "; ".join(reasons)
            )
        return passed

    async def _sanity_run(self, model: str) -> float:
        """One tiny generation, or for an embedding-only model (which refuses generation) one
        tiny embedding; returns its total milliseconds."""
        capabilities = self.capabilities(model)
        if COMPLETION not in capabilities and EMBEDDING in capabilities:
            embedded = await self.backend.embed(
                model, ["OK"], timeout_s=self.settings.sanity_timeout_s
            )
            return embedded.durations.total_ms
        result = await self.backend.generate(
            model,
            SANITY_PROMPT,
            options={"num_predict": 8},
            timeout_s=self.settings.sanity_timeout_s,
        )
        return result.durations.total_ms

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
            current_model=self.current_model if self.current_task else None,
            backend=self.settings.worker_backend,
            backend_url=self.backend.address,
            wol_mac=self.settings.wol_mac,
            facts=self.facts,
        )

    async def ensure_consumer(self) -> JetStreamContext.PullSubscription:
        """This worker's own queues: one task in flight, enforced by the server."""
        name = worker_consumer(self.settings.worker_id)
        return await self._bind(name, worker_queue_filter(self.settings.worker_id), 1)

    async def ensure_shared_consumer(self) -> JetStreamContext.PullSubscription | None:
        """The shared CPU queue, for CPU workers; every such worker binds the same consumer.

        Its ``max_ack_pending`` is the pool's: the one-at-a-time rule per worker is kept by the
        worker's loop, which holds at most one message from all its queues together.
        """
        if not self.settings.shared_queue or "cpu_inference" not in self.settings.worker_supports:
            return None
        return await self._bind(SHARED_CONSUMER, SHARED_CPU_QUEUE, SHARED_MAX_ACK_PENDING)

    async def _bind(
        self, name: str, subject: str, max_ack_pending: int
    ) -> JetStreamContext.PullSubscription:
        config = ConsumerConfig(
            # With a name, the create request names the filter in its subject
            # ($JS.API.CONSUMER.CREATE.TASKS.<name>.<filter>), which NATS permissions can pin.
            name=name,
            durable_name=name,
            filter_subject=subject,
            ack_policy=AckPolicy.EXPLICIT,
            deliver_policy=DeliverPolicy.ALL,
            max_ack_pending=max_ack_pending,
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
        kv = await ensure_streams(self.js, worker_ttl_s=self.settings.worker_ttl_s)
        await self.aliases.start()
        discovered = await self.discover_models(stop)
        await self.read_facts(discovered)
        self.served = await self.sanity_check(discovered)
        self.lease = Lease(kv, self.settings.worker_id, self.settings.worker_ttl_s, self.record)
        await self.lease.acquire()
        # Awake again: no longer a sleeper for the router to wake.
        with suppress(Exception):
            await (await ensure_bucket(self.js, ASLEEP_BUCKET, ttl_s=None)).delete(
                self.settings.worker_id
            )
        # Before the first task can arrive, so no cancel for a task taken here is missed.
        self._cancel_sub = await self.nc.subscribe(CANCEL_NOTICES, cb=self._on_cancel)
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
        shared = await self.ensure_shared_consumer()
        assert self.lease is not None
        beats = asyncio.create_task(self.lease.keep(self.settings.heartbeat_interval_s))
        idle = asyncio.create_task(self._idle_watch())
        try:
            await self.serve(sub, stop, shared)
        finally:
            for background in (beats, idle):
                background.cancel()
                with suppress(asyncio.CancelledError):
                    await background
            for bound in (sub, shared, self._cancel_sub):
                if bound is not None:
                    with suppress(Exception):
                        await bound.unsubscribe()
            if self.asleep.is_set():
                await self._go_to_sleep()
            else:
                await deregister(
                    self.lease, self.js, "lease lost" if self.lease.lost.is_set() else "stopped"
                )
            await self.aliases.stop()
        log.info(
            "worker stopped",
            completed=self.completed,
            failed=self.failed,
            cancelled=self.cancelled,
        )
        if self.lease.lost.is_set():
            raise LeaseLost(f"worker '{self.settings.worker_id}' stopped: its lease was taken over")

    async def serve(
        self,
        sub: JetStreamContext.PullSubscription,
        stop: asyncio.Event,
        shared: JetStreamContext.PullSubscription | None = None,
    ) -> None:
        """Pull and run tasks one at a time until ``stop`` is set or the lease is lost.

        The worker's own queue is asked first and longest; the shared queue briefly, and only
        when the own queue had nothing. After any task the own queue comes first again.

        With a shared queue, right after a task both queues are first looked at without
        waiting (own, then shared): at full load the router sends every task to the shared
        queue, and a worker that went back to a long poll of its empty own queue would idle
        `OWN_POLL_S` per task while the shared queue fills.
        """
        lost = self.lease.lost if self.lease is not None else asyncio.Event()
        usual = [(sub, OWN_POLL_S)] + ([(shared, SHARED_POLL_S)] if shared else [])
        after_task = [(sub, 0.0), (shared, 0.0), *usual] if shared else usual
        sources = usual
        watch = asyncio.create_task(self._stop_watch(stop))
        try:
            while not (stop.is_set() or lost.is_set() or self.asleep.is_set()):
                sources_now, sources = sources, usual
                for source, poll_s in sources_now:
                    msg = await self._fetch_one(source, poll_s)
                    if msg is not None:
                        if source is shared and not await self._serves(msg):
                            continue
                        await self._run_guarded(msg, stop)
                        sources = after_task
                        break
        finally:
            watch.cancel()

    async def _fetch_one(
        self, source: JetStreamContext.PullSubscription, poll_s: float
    ) -> Msg | None:
        """The source's next message, waiting up to ``poll_s`` (0: only one already there)."""
        try:
            return await pull_one(source, poll_s)
        except Exception as exc:
            log.warning("fetch failed", error=repr(exc))
            await asyncio.sleep(0.5)
            return None

    async def _serves(self, msg: Msg) -> bool:
        """A shared task for a model this worker lacks goes back for another worker."""
        try:
            task = _task_decoder.decode(msg.data)
        except msgspec.DecodeError:
            return True  # handle() terminates it with a log line
        if task.model in self.models and not missing(
            needs_of(task), self.capabilities(self.backend_name(task.model))
        ):
            return True
        log.info("shared task for a model not served here; returned", model=task.model)
        await msg.nak(delay=1)
        return False

    async def _run_guarded(self, msg: Msg, stop: asyncio.Event) -> None:
        """Run one task; on stop, `_stop_watch` gives it ``stop_grace_s`` and then cancels it,
        and its message goes back to the queue.

        The message is acked here once `handle` has stored the outcome: the serve loop's next
        pull then leaves in the same write as the ack. A message that arrives once ``stop`` is
        set goes back at once.
        """
        if stop.is_set():
            with suppress(Exception):
                await msg.nak()
            return
        work = asyncio.create_task(self._handle_traced(msg))
        self._running = work
        try:
            stored = await work
        except asyncio.CancelledError:
            this = asyncio.current_task()
            if not work.cancelled() or (this is not None and this.cancelling()):
                raise
            with suppress(Exception):  # stopped by `_stop_watch`
                await msg.nak()
            return
        finally:
            self._running = None
        if stored:
            try:
                await msg.ack()
            except Exception as exc:  # stored already: a redelivery is recognised and acked
                log.warning("ack failed after the outcome was stored", error=repr(exc))

    async def _stop_watch(self, stop: asyncio.Event) -> None:
        """Once ``stop`` is set, give the running task ``stop_grace_s``, then cancel it."""
        await stop.wait()
        work = self._running
        if work is None:
            return
        done, _ = await asyncio.wait({work}, timeout=self.settings.stop_grace_s)
        if not done:
            log.warning(
                "stopping: returning the current task to its queue", task_id=self.current_task
            )
            work.cancel()

    async def _handle_traced(self, msg: Msg) -> bool:
        """`handle` in a ``run task`` span continuing the router's trace (``traceparent``)."""
        with tracer.start_as_current_span(
            "run task",
            context=extract_context(msg.headers),
            kind=trace.SpanKind.CONSUMER,
            attributes={"messaging.destination.name": msg.subject},
        ):
            return await self.handle(msg)

    async def handle(self, msg: Msg) -> bool:
        """Run one task message to a stored outcome event: True, and the caller acknowledges
        the message. False when this settled the message already (acked, terminated or
        returned to the queue)."""
        try:
            task = _task_decoder.decode(msg.data)
        except msgspec.DecodeError as exc:
            log.error("dropping undecodable task message", subject=msg.subject, error=str(exc))
            await msg.term()
            return False
        bound = log.bind(
            task_id=task.task_id,
            attempt=task.attempt,
            subject=msg.subject,
            stream_seq=msg.metadata.sequence.stream,
        )
        if await self._settled(task, msg, bound):
            return False
        self.current_task = task.task_id
        self.current_model = task.model
        outcome: TaskCompleted | TaskFailed
        try:
            if task.task_id in self._cancels:
                # Cancelled while queued: not run, and no outcome for a copy that was moved on.
                if await self._moved_on(task):
                    bound.warning("stale attempt: the task was moved on; dropped unrun")
                    await msg.term()
                    return False
                outcome = self._cancelled_outcome(task, None)
            else:
                # The claim (`started`, fenced) and the backend call go out together: the
                # backend does not wait a round trip. Nothing of the attempt leaves the worker
                # before the claim is stored (stream chunks wait for it, the outcome comes
                # after it), and a stale copy's call is stopped when its claim is refused.
                claim = asyncio.ensure_future(self._claim(task))
                claim.add_done_callback(self._stop_if_refused)
                try:
                    outcome = await self._generate(task, msg, claim)
                    claimed = await claim
                finally:
                    claim.cancel()  # a no-op once done
                if not claimed:
                    bound.warning("stale attempt: the task was moved on; dropped")
                    await msg.term()
                    return False
            await self._store_outcome(outcome)
        except Exception as exc:
            # The outcome could not be stored: return the task so it is not lost.
            bound.error("task not finished; returned to the queue", error=repr(exc))
            with suppress(Exception):
                await msg.nak(delay=1)
            return False
        finally:
            self.current_task = None
            self.last_activity = time.time()
        if isinstance(outcome, TaskCompleted):
            self.completed += 1
            bound.info("task done", total_ms=round(outcome.durations.total_ms, 1))
        elif outcome.code == Cancelled.code:
            self.cancelled += 1
            bound.info("task cancelled", reason=outcome.reason)
        else:
            self.failed += 1
            bound.warning("task failed", code=outcome.code, reason=outcome.reason)
        return True

    async def _claim(self, task: TaskMessage) -> bool:
        """Store this attempt's ``started``, unless the reaper has moved the task on: False
        then (attempt fencing), and nothing is stored.

        The reaper routes attempt N+1 before it deletes attempt N's copies, so a copy that got
        here first (a worker back from the dead, a ghost queue pulled at last) is recognised.
        With the attempt's ``routed_seq`` and nats-server 2.11, the fence is the publish
        itself: stored only while that ``routed`` is the task's last one. Otherwise the
        task's last ``routed`` is looked up first. A publish that fails is tried once more (a
        second copy after a lost acknowledgement is what a redelivery would give anyway).
        """
        event = TaskStarted(
            at=time.time(),
            task_id=task.task_id,
            attempt=task.attempt,
            worker=self.settings.worker_id,
            host=self.settings.worker_host,
        )
        fence: tuple[str, int] | None = None
        if task.routed_seq is not None and fences_by_subject(self.nc):
            fence = (task_event(task.task_id, "routed"), task.routed_seq)
        elif await self._moved_on(task):
            return False
        failures = 0
        while True:
            try:
                await publish_event(self.js, event, expect_last=fence)
                return True
            except Exception as exc:
                if fence is not None and is_wrong_last_sequence(exc):
                    if await self._moved_on(task):
                        return False
                    fence = None  # its ``routed`` is gone (the log was cut): run what is held
                    continue
                failures += 1
                if failures > 1:
                    raise
                log.warning("storing the started event failed; trying again", error=repr(exc))

    async def _moved_on(self, task: TaskMessage) -> bool:
        """Does the task's last ``routed`` name a later attempt than this copy's?"""
        current = await current_attempt(self.js, task.task_id)
        return current is not None and current > task.attempt

    def _stop_if_refused(self, claim: asyncio.Future[bool]) -> None:
        """A refused claim stops the backend call at once: the copy is stale."""
        if _refused(claim) and self._generation is not None:
            self._generation.cancel()

    async def _settled(self, task: TaskMessage, msg: Msg, bound: FilteringBoundLogger) -> bool:
        """Nothing to run: a redelivered task that already ended (acknowledged)."""
        if msg.metadata.num_delivered == 1:
            return False
        try:
            ended = await self._already_ended(task)
        except Exception as exc:  # the bus is reconnecting: look again on the redelivery
            bound.warning("task state unknown; returned to the queue", error=repr(exc))
            with suppress(Exception):
                await msg.nak(delay=1)
            return True
        if ended:
            bound.info("redelivered task had already ended; acknowledging")
            await msg.ack()
        return ended

    async def _generate(
        self, task: TaskMessage, msg: Msg, claim: asyncio.Future[bool]
    ) -> TaskCompleted | TaskFailed:
        on_chunk = self._chunk_publisher(task, claim) if task.stream_subject else None
        started = time.perf_counter()
        if task.task_id in self._cancels or _refused(claim):
            return self._cancelled_outcome(task, started)
        try:
            async with KeepAlive(msg, self.settings.ack_wait_s) as alive:
                # A future of its own, so a cancel notice can stop the backend call alone.
                self._generation = asyncio.ensure_future(
                    self._call_backend(task, alive.progress, on_chunk)
                )
                with tracer.start_as_current_span(
                    "backend embed" if task.task_type == "embedding" else "backend generate",
                    kind=trace.SpanKind.CLIENT,
                    attributes={"server.address": self.backend.address, "model": task.model},
                ):
                    result = await self._generation
        except asyncio.CancelledError:
            this = asyncio.current_task()
            if this is not None and this.cancelling():
                raise  # the worker itself is stopping
            if task.task_id not in self._cancels and not _refused(claim):
                raise
            return self._cancelled_outcome(task, started)  # a stale copy's is never stored
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
            self._generation = None
        if isinstance(result, Embedding):
            completed = TaskCompleted(
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
        else:
            completed = TaskCompleted(
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
        return self._fitting(completed)

    def _call_backend(
        self, task: TaskMessage, progress: Progress, on_chunk: OnChunk | None
    ) -> Awaitable[Generation | Embedding]:
        """The backend call a task asks for: one embedding call for every input of an
        embedding task, else a generation with everything the client asked for."""
        model = self.backend_name(task.model)
        if task.task_type == "embedding":
            return self.backend.embed(
                model,
                task.input or [],
                timeout_s=task.timeout_s,
                truncate=task.truncate,
                dimensions=task.dimensions,
                keep_alive=task.keep_alive,
                options=task.options,
                normalize=task.normalize,
            )
        return self.backend.generate(
            model,
            task.prompt,
            options=task.options,
            timeout_s=task.timeout_s,
            progress=progress,
            on_chunk=on_chunk,
            messages=task.messages,
            think=task.think,
            images=task.images,
            tools=task.tools,
            format=task.format,
            keep_alive=task.keep_alive,
            suffix=task.suffix,
        )

    def _fitting(self, completed: TaskCompleted) -> TaskCompleted | TaskFailed:
        """The outcome, or an explicit failure when the answer is too large to store as one
        event (a huge batch of embeddings, say): never a publish that fails over and over."""
        limit = self.nc.max_payload - OUTCOME_HEADROOM_BYTES
        size = len(_encoder.encode(completed))
        if size <= limit:
            return completed
        return TaskFailed(
            at=time.time(),
            task_id=completed.task_id,
            attempt=completed.attempt,
            worker=completed.worker,
            code=TooLarge.code,
            reason=(
                f"the answer is {size} bytes, over what one event can hold ({limit} bytes: the "
                "NATS server's max_payload less headers); send fewer inputs per request"
            ),
            durations=completed.durations,
        )

    def _cancelled_outcome(self, task: TaskMessage, started: float | None) -> TaskFailed:
        """The outcome of a task whose client cancelled it; not retryable: nobody waits."""
        durations = (
            None if started is None else Durations(total_ms=(time.perf_counter() - started) * 1000)
        )
        return TaskFailed(
            at=time.time(),
            task_id=task.task_id,
            attempt=task.attempt,
            worker=self.settings.worker_id,
            code=Cancelled.code,
            reason=self._cancels.get(task.task_id) or "cancelled by its client",
            durations=durations,
        )

    async def _on_cancel(self, msg: Msg) -> None:
        """Remember a cancel notice; stop the backend call if it is for the running task."""
        try:
            notice = _cancel_decoder.decode(msg.data)
        except msgspec.DecodeError:
            return
        if notice.task_id is None:
            return  # the router's notices always name the task
        self._cancels[notice.task_id] = notice.reason or "cancelled by its client"
        while len(self._cancels) > CANCEL_MEMORY:
            self._cancels.popitem(last=False)
        if notice.task_id == self.current_task and self._generation is not None:
            log.info("cancelling the running task", task_id=notice.task_id, reason=notice.reason)
            self._generation.cancel()

    def _chunk_publisher(self, task: TaskMessage, claim: asyncio.Future[bool]) -> OnChunk:
        """Publish each piece to the task's stream subject (core NATS: a lost chunk is only a
        gap on the screen; the whole answer is in the outcome event), once the attempt's claim
        is stored: a stale copy sends nothing."""
        subject = task.stream_subject or ""
        seq = 0

        async def publish(
            response: str, thinking: str, tool_calls: list[ToolCall] | None = None
        ) -> None:
            nonlocal seq
            if not claim.done():
                await asyncio.wait([claim])
            if claim.cancelled() or claim.exception() is not None or not claim.result():
                return
            seq += 1
            chunk = StreamChunk(
                task_id=task.task_id,
                seq=seq,
                response=response,
                thinking=thinking,
                tool_calls=tool_calls,
            )
            await self.nc.publish(subject, _encoder.encode(chunk), headers={CHUNK_HEADER: str(seq)})

        return publish

    async def _store_outcome(self, outcome: TaskCompleted | TaskFailed) -> None:
        await store_outcome(self.js, outcome)

    async def _already_ended(self, task: TaskMessage) -> bool:
        return await stored_outcome(self.js, task.task_id, task.attempt) is not None

    async def _idle_watch(self) -> None:
        """With idle shutdown configured, set ``asleep`` once the worker has idled long enough."""
        idle_s = self.settings.idle_shutdown_sec
        if idle_s is None:
            return
        while True:
            await asyncio.sleep(self.settings.idle_check_interval_sec)
            if should_sleep(
                now=time.time(),
                started_at=self.started_at,
                last_activity=self.last_activity,
                busy=self.current_task is not None,
                idle_shutdown_s=idle_s,
                min_uptime_s=self.settings.min_uptime_sec,
            ):
                log.info("idle; going to sleep", idle_s=round(time.time() - self.last_activity))
                self.asleep.set()
                return

    async def _go_to_sleep(self) -> None:
        """Leave a wake address for the router, deregister, then run the shutdown command."""
        record = msgspec.structs.replace(self.record(), state="asleep", current_task=None)
        try:
            sleepers = await ensure_bucket(self.js, ASLEEP_BUCKET, ttl_s=None)
            await sleepers.put(self.settings.worker_id, _encoder.encode(record))
            await publish_event(
                self.js,
                WorkerAsleep(
                    at=time.time(),
                    worker_id=self.settings.worker_id,
                    instance_id=self.instance_id,
                    models=self.models,
                    wol_mac=self.settings.wol_mac,
                    idle_s=time.time() - self.last_activity,
                ),
            )
        except Exception as exc:
            log.error("could not record going to sleep", error=repr(exc))
        await deregister(self.lease, self.js, "idle shutdown")
        command = shlex.split(self.settings.shutdown_command)
        log.info("running the shutdown command", command=command)
        try:
            proc = await asyncio.create_subprocess_exec(*command)
            code = await proc.wait()
        except OSError as exc:
            log.error("shutdown command failed to start", command=command, error=str(exc))
            return
        if code != 0:
            log.error("shutdown command failed", command=command, exit_code=code)


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
    nc = await connect(
        settings.nats_url, f"coordinator-worker-{settings.worker_id}", auth=settings.nats_auth()
    )
    backend = make_backend(settings)
    try:
        await Worker(nc, settings, backend).run(stop)
    finally:
        await backend.aclose()
        with suppress(Exception):
            await nc.drain()
