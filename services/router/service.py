"""The router service: the ``coordinator.route`` and ``coordinator.workers`` endpoints."""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from contextlib import suppress

import msgspec
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError
from nats.js.kv import KeyValue
from nats.micro import add_service
from nats.micro.service import Service

from schemas.events import (
    TERMINAL_KINDS,
    TaskCompleted,
    TaskFailed,
    TaskRouted,
    TaskSubmitted,
    encoder,
    task_event_decoder,
)
from schemas.queries import WorkersReply, WorkerView
from schemas.route import RouteReply, RouteRequest
from schemas.subjects import (
    EVENTS_STREAM,
    ROUTE,
    WORKERS,
    InvalidId,
    check_token,
    task_event,
)
from schemas.tasks import TaskMessage
from schemas.workers import worker_record_decoder
from services import __version__
from services.router import policy
from services.router.view import FleetView
from services.runtime.bus import connect, ensure_streams, publish_event
from services.runtime.endpoints import add_endpoint
from services.runtime.errors import (
    BadRequest,
    CoordinatorError,
    PromptTooLarge,
    Unavailable,
    WaitTimeout,
)
from services.runtime.lifecycle import TaskSet
from services.runtime.settings import RouterSettings

log = structlog.get_logger("router")

_route_decoder = msgspec.json.Decoder(RouteRequest)

# Extra time a waiting request allows beyond the task's own timeout: queueing and event delivery.
WAIT_MARGIN_S = 30.0


class Unsupported(CoordinatorError):
    code = "unsupported"


def new_task_id() -> str:
    """Time-ordered, unique and safe as a subject token."""
    return f"{time.time_ns():x}-{uuid.uuid4().hex[:12]}"


def parse_route_request(body: bytes, max_prompt_chars: int) -> RouteRequest:
    """Decode and check a route request; every refusal is a `BadRequest` with a clear message."""
    try:
        request = _route_decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise BadRequest(f"invalid route request: {exc}") from None
    except msgspec.DecodeError as exc:
        raise BadRequest(f"route request is not valid JSON: {exc}") from None
    if not request.prompt.strip():
        raise BadRequest("prompt must not be empty")
    if len(request.prompt) > max_prompt_chars:
        raise PromptTooLarge(
            f"prompt has {len(request.prompt)} characters, over the limit of {max_prompt_chars} "
            "(MAX_PROMPT_CHARS)"
        )
    if not request.model.strip():
        raise BadRequest("model must not be empty")
    if request.timeout_s is not None and not (
        math.isfinite(request.timeout_s) and request.timeout_s > 0
    ):
        raise BadRequest(f"timeout_s must be a positive number of seconds, got {request.timeout_s}")
    try:
        if request.worker is not None:
            check_token("worker", request.worker)
        if request.domain is not None:
            check_token("domain", request.domain)
    except InvalidId as exc:
        raise BadRequest(str(exc)) from None
    if request.stream:
        raise Unsupported("streaming replies are not available yet; send stream=false")
    return request


class Router:
    """Holds the fleet view and answers route requests."""

    def __init__(self, nc: Client, settings: RouterSettings) -> None:
        self.nc = nc
        self.js: JetStreamContext = nc.jetstream()
        self.settings = settings
        self.view = FleetView()
        self.tasks = TaskSet()
        self._waiters: dict[str, asyncio.Future[TaskCompleted | TaskFailed]] = {}
        self._kv: KeyValue | None = None
        self._events_sub: Subscription | None = None
        self._service: Service | None = None
        self._watch_ready = asyncio.Event()

    async def start(self) -> None:
        self._kv = await ensure_streams(self.js, worker_ttl_s=self.settings.worker_ttl_s)
        self._events_sub = await self.nc.subscribe("events.task.>", cb=self._on_task_event)
        self.tasks.spawn(self._watch_workers(), name="watch-workers")
        await asyncio.wait_for(self._watch_ready.wait(), timeout=10)
        self._service = await add_service(
            self.nc,
            name="coordinator-router",
            version=__version__,
            description="routes prompts to workers",
        )
        await add_endpoint(self._service, "route", ROUTE, self.handle_route, self.tasks)
        await add_endpoint(self._service, "workers", WORKERS, self.handle_workers, self.tasks)
        log.info("router ready", subjects=[ROUTE, WORKERS])

    async def stop(self) -> None:
        if self._service is not None:
            await self._service.stop()
        if self._events_sub is not None:
            with suppress(Exception):
                await self._events_sub.unsubscribe()
        await self.tasks.wait(timeout_s=1.0)

    # -- feeds ---------------------------------------------------------------------------------

    async def _watch_workers(self) -> None:
        assert self._kv is not None
        while True:
            watcher = await self._kv.watchall()
            try:
                async for entry in watcher:
                    if entry is None:
                        self._watch_ready.set()
                        continue
                    if entry.operation in ("DEL", "PURGE") or not entry.value:
                        self.view.remove_worker(entry.key)
                        continue
                    try:
                        self.view.put_worker(worker_record_decoder.decode(entry.value))
                    except msgspec.DecodeError:
                        log.warning("ignoring malformed worker record", key=entry.key)
            except asyncio.CancelledError:
                with suppress(Exception):
                    await watcher.stop()  # type: ignore[no-untyped-call]
                raise

    async def _on_task_event(self, msg: Msg) -> None:
        kind = msg.subject.rsplit(".", 1)[-1]
        if kind not in ("routed", "completed", "failed"):
            return
        try:
            event = task_event_decoder.decode(msg.data)
        except msgspec.DecodeError:
            return
        if isinstance(event, TaskRouted):
            self.view.routed(event.task_id, event.worker, event.at)
        elif isinstance(event, TaskCompleted | TaskFailed):
            self.view.ended(event.task_id)
            waiter = self._waiters.get(event.task_id)
            if waiter is not None and not waiter.done():
                waiter.set_result(event)

    # -- endpoints -----------------------------------------------------------------------------

    async def handle_workers(self, body: bytes) -> bytes:
        depth = self.view.depth()
        now = time.time()
        workers = [
            WorkerView(
                worker_id=r.worker_id,
                host=r.host,
                tier=policy.tier_label(r),
                models=r.models,
                state=r.state,
                current_task=r.current_task,
                last_heartbeat=r.heartbeat_at,
                queue_depth=depth.get(r.worker_id, 0),
            )
            for r in sorted(
                policy.live(self.view.workers.values(), now, self.settings.worker_ttl_s),
                key=lambda r: r.worker_id,
            )
        ]
        return encoder.encode(WorkersReply(workers=workers))

    async def handle_route(self, body: bytes) -> bytes:
        request = parse_route_request(body, self.settings.max_prompt_chars)
        now = time.time()
        self.view.expire(now, max_age_s=self.settings.default_timeout_s + WAIT_MARGIN_S)
        live = policy.live(self.view.workers.values(), now, self.settings.worker_ttl_s)
        if request.task_type == "web_search":
            decision = policy.choose_web(live)
        else:
            decision = policy.choose(
                request.model,
                live,
                designated=request.worker,
                gpu_models=self.settings.gpu_models,
                depth=self.view.depth(),
            )
        task_id = new_task_id()
        timeout_s = request.timeout_s or self.settings.default_timeout_s
        waiter: asyncio.Future[TaskCompleted | TaskFailed] | None = None
        if request.wait:
            # Registered before anything is published, so the end cannot be missed.
            waiter = asyncio.get_running_loop().create_future()
            self._waiters[task_id] = waiter
        try:
            await self._submit(request, decision, task_id, timeout_s, now)
            log.info(
                "routed",
                task_id=task_id,
                model=request.model,
                worker=decision.worker_id,
                queue=decision.queue,
                reason=decision.reason,
            )
            if waiter is None:
                return encoder.encode(
                    RouteReply(
                        task_id=task_id,
                        status="queued",
                        queue=decision.queue,
                        worker=decision.worker_id,
                    )
                )
            outcome = await self._wait(task_id, waiter, timeout_s + WAIT_MARGIN_S)
        finally:
            self._waiters.pop(task_id, None)
        if isinstance(outcome, TaskCompleted):
            reply = RouteReply(
                task_id=task_id,
                status="done",
                queue=decision.queue,
                worker=outcome.worker,
                response=outcome.response,
                thinking=outcome.thinking,
            )
        else:
            reply = RouteReply(
                task_id=task_id,
                status="failed",
                queue=decision.queue,
                worker=outcome.worker or decision.worker_id,
                error=f"{outcome.code}: {outcome.reason}",
            )
        return encoder.encode(reply)

    async def _submit(
        self,
        request: RouteRequest,
        decision: policy.Decision,
        task_id: str,
        timeout_s: float,
        now: float,
    ) -> None:
        try:
            await publish_event(
                self.js,
                TaskSubmitted(
                    at=now,
                    task_id=task_id,
                    model=request.model,
                    prompt=request.prompt,
                    task_type=request.task_type,
                    domain=request.domain,
                    options=request.options,
                    requested_worker=request.worker,
                    timeout_s=timeout_s,
                ),
                msg_id=f"{task_id}:submitted",
            )
        except Exception as exc:
            raise Unavailable(f"could not record the task: {exc or type(exc).__name__}") from exc
        try:
            await publish_event(
                self.js,
                TaskRouted(
                    at=time.time(),
                    task_id=task_id,
                    attempt=1,
                    worker=decision.worker_id,
                    queue=decision.queue,
                    reason=decision.reason,
                ),
                msg_id=f"{task_id}:routed:1",
            )
            message = TaskMessage(
                task_id=task_id,
                attempt=1,
                model=request.model,
                prompt=request.prompt,
                task_type=request.task_type,
                domain=request.domain,
                options=request.options,
                timeout_s=timeout_s,
                stream=request.stream,
                submitted_at=now,
            )
            await self.js.publish(
                decision.queue, encoder.encode(message), headers={"Nats-Msg-Id": f"{task_id}:1"}
            )
        except Exception as exc:
            reason = f"could not queue the task on {decision.queue}: {exc or type(exc).__name__}"
            with suppress(Exception):
                await publish_event(
                    self.js,
                    TaskFailed(
                        at=time.time(),
                        task_id=task_id,
                        attempt=1,
                        worker=decision.worker_id,
                        code=Unavailable.code,
                        reason=reason,
                        retryable=True,
                    ),
                    msg_id=f"{task_id}:failed:router",
                )
            raise Unavailable(f"task {task_id}: {reason}") from exc

    async def _wait(
        self, task_id: str, waiter: asyncio.Future[TaskCompleted | TaskFailed], timeout_s: float
    ) -> TaskCompleted | TaskFailed:
        try:
            return await asyncio.wait_for(asyncio.shield(waiter), timeout=timeout_s)
        except TimeoutError:
            pass
        # The end event may have been missed during a reconnect: ask the stream itself.
        for kind in TERMINAL_KINDS:
            try:
                stored = await self.js.get_last_msg(EVENTS_STREAM, task_event(task_id, kind))
            except NotFoundError:
                continue
            event = task_event_decoder.decode(stored.data or b"")
            if isinstance(event, TaskCompleted | TaskFailed):
                return event
        raise WaitTimeout(
            f"task {task_id} has not ended after {timeout_s:.0f} s; it may still finish: "
            f"ask coordinator.task for {task_id}"
        )


async def run(settings: RouterSettings, stop: asyncio.Event) -> None:
    """Run the router until ``stop`` is set."""
    nc = await connect(settings.nats_url, "coordinator-router")
    router = Router(nc, settings)
    try:
        await router.start()
        await stop.wait()
    finally:
        await router.stop()
        await nc.drain()
