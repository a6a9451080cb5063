"""The web-search worker: one task at a time from the shared ``tasks.web`` queue.

Every web worker binds the one durable pull consumer ``web`` on ``tasks.web`` and fetches one
message at a time, finishing it (outcome stored, message acknowledged) before fetching the
next: each worker runs one task at a time while any number of them share the queue, and the
server never hands one message to two of them at once. A task ends:

- ``done`` with the model's answer, its sources and who did the work;
- ``done`` with the plain list of results and a ``note`` when the summary failed or ran out
  of time (the search is what was asked for; the summary is a convenience);
- ``failed`` with the reason when SearXNG failed (refused, timed out, 429, 5xx, not JSON, no
  results), or when the worker that began it was lost (`takeover.py`).

Web-search tasks are never run twice (DESIGN lesson 8): their failures surface.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import Awaitable
from contextlib import suppress
from typing import TypeVar, assert_never

import msgspec
import nats.errors
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import BadRequestError, KeyNotFoundError
from nats.js.kv import KeyValue
from structlog.typing import FilteringBoundLogger

from schemas.events import (
    Durations,
    TaskCompleted,
    TaskFailed,
    TaskStarted,
    Tokens,
    WorkerRegistered,
)
from schemas.subjects import TASKS_STREAM, WEB_CONSUMER, WEB_QUEUE
from schemas.tasks import TaskMessage
from schemas.workers import WorkerRecord, worker_record_decoder
from services import __version__
from services.backends import Backend, Generation
from services.backends.ollama import OllamaBackend
from services.backends.openai import OpenAIBackend
from services.runtime.bus import connect, ensure_streams, publish_event
from services.runtime.errors import (
    BackendError,
    BackendTimeout,
    CoordinatorError,
    SearchError,
    WorkerLost,
)
from services.runtime.lease import Lease, LeaseLost, deregister
from services.runtime.outcomes import KeepAlive, last_started, store_outcome, stored_outcome
from services.runtime.settings import WebSearchSettings
from services.web_search.searxng import SearxngClient
from services.web_search.summary import (
    fallback_note,
    fallback_response,
    is_served,
    summary_budget,
    summary_model,
    summary_prompt,
)
from services.web_search.takeover import Lost, Run, Wait, on_redelivery

log = structlog.get_logger("web_search")

T = TypeVar("T")

_task_decoder = msgspec.json.Decoder(TaskMessage)

# Tasks in flight across all web workers together; each worker holds at most one (or two for a
# moment, when a fetch's message arrives just after the fetch gave up), so this allows dozens.
WEB_MAX_ACK_PENDING = 64
# Once a stop's grace period is over, how long the current task gets to record what it has
# (the failure of an unfinished search, or the results without their summary).
WRAP_UP_S = 5.0


class WorkerStopping(CoordinatorError):
    """The worker was stopped and its grace period ran out before this step finished."""

    code = "worker_stopped"


def make_summary_backend(settings: WebSearchSettings) -> Backend:
    """The model-server client ``SUMMARY_BACKEND`` chooses (the workers' own clients)."""
    if settings.summary_backend == "openai":
        return OpenAIBackend(
            settings.openai_base_url,
            api_key=settings.openai_api_key,
            connect_timeout_s=settings.backend_connect_timeout_s,
        )
    return OllamaBackend(settings.ollama_host, connect_timeout_s=settings.backend_connect_timeout_s)


class WebSearchWorker:
    """Registers as a ``web_search`` worker, heartbeats, and answers web-search tasks."""

    def __init__(
        self, nc: Client, settings: WebSearchSettings, searxng: SearxngClient, backend: Backend
    ) -> None:
        self.nc = nc
        self.js: JetStreamContext = nc.jetstream()
        self.settings = settings
        self.searxng = searxng
        self.backend = backend
        self.instance_id = uuid.uuid4().hex[:12]
        self.started_at = time.time()
        self.current_task: str | None = None
        self.completed = 0
        self.fallbacks = 0
        self.failed = 0
        self.lease: Lease | None = None
        self.kv: KeyValue | None = None
        # Set when a stop's grace period is over: the current step gives up and the task
        # records what it has.
        self._cut = asyncio.Event()

    # -- start ---------------------------------------------------------------------------------

    async def check_dependencies(self) -> None:
        """The start banner: version, then each dependency OK or what is wrong with it.

        Only NATS is required to start (without it the worker cannot register). SearXNG or the
        summary backend being down is logged loudly and the worker starts anyway: tasks then
        fail (no SearXNG) or fall back to plain results (no summary), each saying why.
        """
        s = self.settings
        log.info(
            "coordinator web-search starting",
            version=__version__,
            worker_id=s.worker_id,
            host=s.worker_host,
            pid=os.getpid(),
        )
        log.info("NATS OK", url=s.nats_url, server_version=str(self.nc.connected_server_version))
        try:
            await self.searxng.check(timeout_s=s.search_timeout_s)
        except SearchError as exc:
            log.warning(
                "SearXNG NOT OK: web-search tasks will fail until it answers",
                url=self.searxng.address,
                error=f"{exc.code}: {exc.message}",
            )
        else:
            log.info("SearXNG OK", url=self.searxng.address)
        problem = await self._backend_problem()
        if problem:
            log.warning(
                "backend NOT OK: answers will be plain result lists until it is",
                backend=s.summary_backend,
                url=self.backend.address,
                model=s.ollama_model,
                error=problem,
            )
        else:
            log.info(
                "backend OK",
                backend=s.summary_backend,
                url=self.backend.address,
                model=s.ollama_model,
            )

    async def _backend_problem(self) -> str | None:
        try:
            served = await self.backend.list_models()
        except BackendError as exc:
            return f"{exc.code}: {exc.message}"
        if not is_served(self.settings.ollama_model, served):
            return (
                f"OLLAMA_MODEL '{self.settings.ollama_model}' is not served "
                f"(serves: {', '.join(served) or 'none'})"
            )
        return None

    def record(self) -> WorkerRecord:
        return WorkerRecord(
            worker_id=self.settings.worker_id,
            host=self.settings.worker_host,
            instance_id=self.instance_id,
            pid=os.getpid(),
            version=__version__,
            supports=["web_search"],
            models=[self.settings.ollama_model],
            started_at=self.started_at,
            heartbeat_at=time.time(),
            state="busy" if self.current_task else "idle",
            current_task=self.current_task,
            backend=self.settings.summary_backend,
            backend_url=self.backend.address,
        )

    async def ensure_consumer(self) -> JetStreamContext.PullSubscription:
        """Create (or find) the shared ``web`` consumer and bind to it."""
        config = ConsumerConfig(
            # Named: the create request then names the filter, which NATS permissions can pin.
            name=WEB_CONSUMER,
            durable_name=WEB_CONSUMER,
            filter_subject=WEB_QUEUE,
            ack_policy=AckPolicy.EXPLICIT,
            deliver_policy=DeliverPolicy.ALL,
            max_ack_pending=WEB_MAX_ACK_PENDING,
            ack_wait=self.settings.ack_wait_s,
        )
        try:
            await self.js.add_consumer(TASKS_STREAM, config)
        except BadRequestError as exc:
            # Another web worker made it with other settings (ACK_WAIT_S): share it as it is.
            log.warning(
                "consumer exists with other settings; binding to it",
                consumer=WEB_CONSUMER,
                error=str(exc),
            )
        return await self.js.pull_subscribe_bind(durable=WEB_CONSUMER, stream=TASKS_STREAM)

    async def start(self) -> JetStreamContext.PullSubscription:
        """Banner, lease (a second process with this WORKER_ID is refused), consumer, announce."""
        await self.check_dependencies()
        self.kv = await ensure_streams(self.js, worker_ttl_s=self.settings.worker_ttl_s)
        self.lease = Lease(
            self.kv, self.settings.worker_id, self.settings.worker_ttl_s, self.record
        )
        await self.lease.acquire()
        sub = await self.ensure_consumer()
        await publish_event(
            self.js,
            WorkerRegistered(
                at=time.time(),
                worker_id=self.settings.worker_id,
                host=self.settings.worker_host,
                instance_id=self.instance_id,
                models=[self.settings.ollama_model],
                supports=["web_search"],
                version=__version__,
            ),
        )
        log.info(
            "web-search worker ready",
            worker_id=self.settings.worker_id,
            queue=WEB_QUEUE,
            consumer=WEB_CONSUMER,
        )
        return sub

    # -- the loop ------------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Start, take tasks until ``stop`` (or the lease is lost), then stop cleanly."""
        sub = await self.start()
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
            await deregister(
                self.lease, self.js, "lease lost" if self.lease.lost.is_set() else "stopped"
            )
        log.info(
            "web-search worker stopped",
            completed=self.completed,
            fallbacks=self.fallbacks,
            failed=self.failed,
        )
        if self.lease.lost.is_set():
            raise LeaseLost(f"worker '{self.settings.worker_id}' stopped: its lease was taken over")

    async def serve(self, sub: JetStreamContext.PullSubscription, stop: asyncio.Event) -> None:
        """Fetch one message, finish it, fetch the next, until ``stop`` or the lease is lost."""
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
        """Run one task; on stop, give it ``stop_grace_s``, then make it wrap up."""
        work = asyncio.create_task(self.handle(msg))
        stopping = asyncio.create_task(stop.wait())
        try:
            await asyncio.wait({work, stopping}, return_when=asyncio.FIRST_COMPLETED)
            if not work.done():
                done, _ = await asyncio.wait({work}, timeout=self.settings.stop_grace_s)
                if not done:
                    log.warning("stop grace over: wrapping up the task", task_id=self.current_task)
                    self._cut.set()
                    done, _ = await asyncio.wait({work}, timeout=WRAP_UP_S)
                if not done:
                    # Left unacknowledged: another web worker finds it lost and fails it.
                    log.error("task did not wrap up; abandoning it", task_id=self.current_task)
                    work.cancel()
                    with suppress(asyncio.CancelledError):
                        await work
                    return
            await work
        finally:
            stopping.cancel()

    async def handle(self, msg: Msg) -> None:
        """Run one task message to a stored outcome, then acknowledge it."""
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
        if msg.metadata.num_delivered > 1:
            try:
                if await self._settled_redelivery(task, msg, bound):
                    return
            except Exception as exc:  # the bus is reconnecting: look again on the next delivery
                bound.error("redelivered task not settled; returned to the queue", error=repr(exc))
                with suppress(Exception):
                    await msg.nak(delay=1)
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
            async with KeepAlive(msg, self.settings.ack_wait_s) as alive:
                outcome = await self.answer(task, alive)
            await store_outcome(self.js, outcome)
            await msg.ack()
        except Exception as exc:
            # The outcome could not be stored: return the message (a redelivery checks what
            # the stream holds first, and never runs the task a second time).
            bound.error("task not finished; returned to the queue", error=repr(exc))
            with suppress(Exception):
                await msg.nak(delay=1)
            return
        finally:
            self.current_task = None
        if isinstance(outcome, TaskFailed):
            self.failed += 1
            bound.warning("task failed", code=outcome.code, reason=outcome.reason)
            return
        if outcome.note is not None:
            self.fallbacks += 1
        else:
            self.completed += 1
        bound.info(
            "task done",
            model=outcome.model,
            sources=len(outcome.sources or []),
            summary=outcome.note is None,
            note=outcome.note,
            total_ms=round(outcome.durations.total_ms, 1),
        )

    async def _settled_redelivery(
        self, task: TaskMessage, msg: Msg, bound: FilteringBoundLogger
    ) -> bool:
        """Deal with a message delivered before; False means it is a first run after all."""
        if await stored_outcome(self.js, task.task_id, task.attempt) is not None:
            bound.info("redelivered task had already ended; acknowledging")
            await msg.ack()
            return True
        started = await last_started(self.js, task.task_id, task.attempt)
        starter = await self._registry_entry(started.worker) if started is not None else None
        decision = on_redelivery(
            started, starter, now=time.time(), ttl_s=self.settings.worker_ttl_s
        )
        match decision:
            case Run():
                return False
            case Wait(delay_s=delay_s):
                bound.info("redelivered task is still running elsewhere", recheck_s=delay_s)
                await msg.nak(delay=delay_s)
                return True
            case Lost(reason=reason):
                assert started is not None
                await store_outcome(
                    self.js,
                    TaskFailed(
                        at=time.time(),
                        task_id=task.task_id,
                        attempt=task.attempt,
                        worker=started.worker,
                        code=WorkerLost.code,
                        reason=reason,
                        retryable=False,
                    ),
                )
                await msg.ack()
                self.failed += 1
                bound.warning("task lost by its worker; failed", lost_by=started.worker)
                return True
            case _:
                assert_never(decision)

    async def _registry_entry(self, worker_id: str) -> WorkerRecord | None:
        if self.kv is None:
            return None
        try:
            entry = await self.kv.get(worker_id)
        except KeyNotFoundError:
            return None
        try:
            return worker_record_decoder.decode(entry.value or b"")
        except msgspec.DecodeError:
            return None

    # -- the work ------------------------------------------------------------------------------

    async def answer(self, task: TaskMessage, alive: KeepAlive) -> TaskCompleted | TaskFailed:
        """Search, then summarise; a failed summary falls back to the plain results."""
        s = self.settings
        began = time.perf_counter()
        try:
            sources = await self._unless_cut(
                self.searxng.search(
                    task.prompt,
                    limit=s.searxng_results,
                    timeout_s=min(s.search_timeout_s, task.timeout_s),
                    categories=s.searxng_categories,
                    language=s.searxng_language,
                ),
                step="the search",
            )
        except (SearchError, WorkerStopping) as exc:
            return TaskFailed(
                at=time.time(),
                task_id=task.task_id,
                attempt=task.attempt,
                worker=s.worker_id,
                code=exc.code,
                reason=exc.message,
                retryable=False,  # web-search tasks are never run twice
                durations=Durations(total_ms=_ms_since(began)),
            )
        model = summary_model(task.model, s.ollama_model)
        budget = summary_budget(
            task_timeout_s=task.timeout_s,
            elapsed_s=time.perf_counter() - began,
            summary_timeout_s=s.summary_timeout_s,
        )
        generation: Generation | None = None
        note: str | None = None
        if budget == 0:
            note = fallback_note(
                BackendTimeout.code,
                f"no time left for a summary within the task's timeout of {task.timeout_s:g} s",
            )
        else:
            try:
                generation = await self._unless_cut(
                    self.backend.generate(
                        model,
                        summary_prompt(task.prompt, sources),
                        options=task.options,
                        timeout_s=budget,
                        progress=alive.progress,
                    ),
                    step="the summary",
                )
                if not generation.response.strip():
                    raise BackendError(f"{model} returned an empty answer")
            except (BackendError, WorkerStopping) as exc:
                generation = None
                note = fallback_note(exc.code, exc.message)
        total_ms = _ms_since(began)
        if generation is None:
            response, thinking = fallback_response(sources), None
            durations, tokens = Durations(total_ms=total_ms), Tokens()
        else:
            response, thinking = generation.response.strip(), generation.thinking
            durations = msgspec.structs.replace(
                generation.durations, total_ms=total_ms, first_token_ms=generation.first_token_ms
            )
            tokens = generation.tokens
        return TaskCompleted(
            at=time.time(),
            task_id=task.task_id,
            attempt=task.attempt,
            worker=s.worker_id,
            model=model,
            response=response,
            thinking=thinking,
            durations=durations,
            tokens=tokens,
            host=s.worker_host,
            sources=sources,
            note=note,
        )

    async def _unless_cut(self, step_work: Awaitable[T], *, step: str) -> T:
        """Await ``step_work``; if the stop's grace runs out first, cancel it and raise
        `WorkerStopping`."""
        work = asyncio.ensure_future(step_work)
        cut = asyncio.create_task(self._cut.wait())
        try:
            await asyncio.wait({work, cut}, return_when=asyncio.FIRST_COMPLETED)
            if work.done():
                return work.result()
            raise WorkerStopping(
                f"web worker '{self.settings.worker_id}' on host {self.settings.worker_host} "
                f"was stopped and its grace period (STOP_GRACE_S={self.settings.stop_grace_s:g})"
                f" ran out during {step}"
            )
        finally:
            cut.cancel()
            if not work.done():
                work.cancel()
                with suppress(asyncio.CancelledError):
                    await work


def _ms_since(began: float) -> float:
    return (time.perf_counter() - began) * 1000


async def run(settings: WebSearchSettings, stop: asyncio.Event) -> None:
    """Run one web-search worker until ``stop`` is set."""
    nc = await connect(
        settings.nats_url,
        f"coordinator-web-search-{settings.worker_id}",
        auth=settings.nats_auth(),
    )
    searxng = SearxngClient(
        settings.searxng_url, connect_timeout_s=settings.backend_connect_timeout_s
    )
    backend = make_summary_backend(settings)
    try:
        await WebSearchWorker(nc, settings, searxng, backend).run(stop)
    finally:
        await searxng.aclose()
        await backend.aclose()
        with suppress(Exception):
            await nc.drain()
