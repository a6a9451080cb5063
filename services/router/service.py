"""The router service: the ``coordinator.route`` and ``coordinator.workers`` endpoints."""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from collections.abc import Callable
from contextlib import suppress
from typing import Any

import msgspec
import nats.errors
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.api import PubAck
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
    WakeRequested,
    WorkerDuplicate,
    encoder,
    task_event_decoder,
)
from schemas.models import EMBEDDING, resolve_name
from schemas.queries import WorkersReply, WorkerView
from schemas.route import (
    CHUNK_HEADER,
    CancelReply,
    CancelRequest,
    RouteReply,
    RouteRequest,
    StreamChunk,
    image_problem,
)
from schemas.subjects import (
    ASLEEP_BUCKET,
    CANCEL,
    EVENTS_STREAM,
    REAPER_SERVICE,
    ROUTE,
    STATS_BUCKET,
    TASKS_STREAM,
    WORKERS,
    InvalidId,
    cancel_notice,
    check_token,
    task_event,
)
from schemas.tasks import TaskMessage, is_retryable, needs_of, work_of
from schemas.workers import WorkerRecord, worker_record_decoder
from services import __version__
from services.fleet import liveness, policy
from services.fleet.domains import classify_domain
from services.router.view import Figure, FleetView
from services.router.waiting import Waiter
from services.router.wol import send_magic_packet
from services.runtime.aliases import AliasFollower
from services.runtime.bus import connect, ensure_bucket, ensure_streams, publish_event
from services.runtime.endpoints import add_endpoint, reply_subject
from services.runtime.errors import (
    BadRequest,
    NotFound,
    NoWorker,
    PromptTooLarge,
    TooLarge,
    Unavailable,
    UnsupportedCapability,
    WaitTimeout,
)
from services.runtime.lifecycle import TaskSet
from services.runtime.settings import RouterSettings
from services.runtime.tracing import inject_context
from services.runtime.watch import follow_bucket

log = structlog.get_logger("router")

_route_decoder = msgspec.json.Decoder(RouteRequest)
_cancel_decoder = msgspec.json.Decoder(CancelRequest)
_duplicate_decoder = msgspec.json.Decoder(WorkerDuplicate)


class _FigureView(msgspec.Struct, frozen=True):
    """The fields of a ``stats`` bucket value that routing uses."""

    model: str
    domain: str
    worker: str
    recent_failure_rate: float = 0.0
    typical_ms: float | None = None


_figure_decoder = msgspec.json.Decoder(_FigureView)

# A sleeping worker is sent at most one magic packet in this many seconds.
WAKE_RESEND_S = 10.0

# In-flight tasks whose end was missed are forgotten at most this often (see FleetView.expire).
EXPIRE_INTERVAL_S = 1.0

# Extra time a waiting request allows beyond the task's own timeout: queueing and event delivery.
WAIT_MARGIN_S = 30.0

# What a task message and the ``submitted`` event add to the request itself (ids, times,
# subjects, headers), so the size check leaves room for them.
TASK_OVERHEAD_BYTES = 4096

# A problem the reaper reported is shown this long; it reports one that persists every 30 s.
PROBLEM_SHOWN_S = 90.0
# How often the router asks whether a reaper runs (to know if a retryable failure moves on).
REAPER_PING_S = 2.0


def new_task_id() -> str:
    """Time-ordered, unique and safe as a subject token."""
    return f"{time.time_ns():x}-{uuid.uuid4().hex[:12]}"


def conversation_chars(request: RouteRequest) -> int:
    """The characters ``MAX_PROMPT_CHARS`` counts: the whole conversation (its text, or every
    message's), the suffix and every embedding input, not only ``prompt``."""
    messages = sum(len(m.content) for m in request.messages or ())
    inputs = sum(len(text) for text in request.input or ())
    return max(len(request.prompt), messages, inputs) + len(request.suffix or "")


def _check_images(images: list[str] | None, where: str) -> None:
    problem = image_problem(images, where)
    if problem is not None:
        raise BadRequest(problem)


def _check_tools(tools: list[dict[str, Any]] | None) -> None:
    for index, tool in enumerate(tools or ()):
        function = tool.get("function")
        if tool.get("type", "function") != "function" or not isinstance(function, dict):
            raise BadRequest(f'tools[{index}] must be {{"type": "function", "function": {{...}}}}')
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise BadRequest(f"tools[{index}].function.name must be a non-empty string")


def parse_route_request(body: bytes, max_prompt_chars: int) -> RouteRequest:
    """Decode and check a route request; every refusal is a `BadRequest` with a clear message."""
    try:
        request = _route_decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise BadRequest(f"invalid route request: {exc}") from None
    except msgspec.DecodeError as exc:
        raise BadRequest(f"route request is not valid JSON: {exc}") from None
    if request.task_type == "embedding":
        if not request.input:
            raise BadRequest("an embedding request needs input: a non-empty list of texts")
        if not request.prompt:
            # The inputs as one text: what statistics and `coordinator task` show.
            request = msgspec.structs.replace(request, prompt="\n".join(request.input))
    elif request.input is not None:
        raise BadRequest("input is for embedding requests (task_type 'embedding') only")
    elif not request.prompt.strip():
        raise BadRequest("prompt must not be empty")
    chars = conversation_chars(request)
    if chars > max_prompt_chars:
        raise PromptTooLarge(
            f"the request holds {chars} characters of text, over the limit of "
            f"{max_prompt_chars} (MAX_PROMPT_CHARS, counted over the whole conversation)"
        )
    if not request.model.strip():
        raise BadRequest("model must not be empty")
    if request.messages is not None and not request.messages:
        raise BadRequest("messages, when given, must hold at least one message")
    if request.timeout_s is not None and not (
        math.isfinite(request.timeout_s) and request.timeout_s > 0
    ):
        raise BadRequest(f"timeout_s must be a positive number of seconds, got {request.timeout_s}")
    if request.dimensions is not None and request.dimensions <= 0:
        raise BadRequest(f"dimensions must be a positive number, got {request.dimensions}")
    _check_images(request.images, "")
    for index, message in enumerate(request.messages or ()):
        _check_images(message.images, f"messages[{index}].")
    _check_tools(request.tools)
    try:
        if request.worker is not None:
            check_token("worker", request.worker)
        if request.domain is not None:
            check_token("domain", request.domain)
    except InvalidId as exc:
        raise BadRequest(str(exc)) from None
    return request


class Router:
    """Holds the fleet view and answers route requests."""

    def __init__(self, nc: Client, settings: RouterSettings) -> None:
        self.nc = nc
        self.js: JetStreamContext = nc.jetstream()
        self.settings = settings
        self.view = FleetView()
        self.aliases = AliasFollower(self.js)
        self._woken: dict[str, float] = {}
        self.tasks = TaskSet()
        self._waiters: dict[str, Waiter] = {}
        # Reply subject of a waiting route request -> its task, so a client that never learned
        # the task id can cancel it (`CancelRequest.reply_to`).
        self._waiting_on: dict[str, str] = {}
        self._next_expiry = 0.0
        # worker id -> (time, what the reaper saw): duplicates shown by `coordinator workers`.
        self._problems: dict[str, tuple[float, str]] = {}
        self._event_subs: list[Subscription] = []
        self._problems_sub: Subscription | None = None
        self._reaper_seen = float("-inf")
        self._reaper_asked = float("-inf")
        self._service: Service | None = None

    async def start(self) -> None:
        workers = await ensure_streams(self.js, worker_ttl_s=self.settings.worker_ttl_s)
        figures = await ensure_bucket(self.js, STATS_BUCKET, ttl_s=None)
        sleepers = await ensure_bucket(self.js, ASLEEP_BUCKET, ttl_s=None)
        await self.aliases.start()
        # Only the kinds routing needs: `submitted` (the largest event) and `started` would be
        # two more deliveries per task. A woken worker's `started` is asked for per task.
        self._event_subs = [
            await self.nc.subscribe(f"events.task.*.{kind}", cb=self._on_task_event)
            for kind in ("routed", *TERMINAL_KINDS)
        ]
        self._problems_sub = await self.nc.subscribe(
            "events.worker.*.duplicate", cb=self._on_duplicate
        )
        ready = [asyncio.Event(), asyncio.Event(), asyncio.Event()]
        self.tasks.spawn(self._watch(workers, self._on_worker, ready[0]), name="watch-workers")
        self.tasks.spawn(self._watch(figures, self._on_figure, ready[1]), name="watch-stats")
        self.tasks.spawn(self._watch(sleepers, self._on_sleeper, ready[2]), name="watch-asleep")
        self.tasks.spawn(self._ping_reaper(), name="ping-reaper")
        await asyncio.wait_for(asyncio.gather(*(r.wait() for r in ready)), timeout=10)
        self._service = await add_service(
            self.nc,
            name="coordinator-router",
            version=__version__,
            description="routes prompts to workers",
        )
        await add_endpoint(self._service, "route", ROUTE, self.handle_route, self.tasks)
        await add_endpoint(self._service, "workers", WORKERS, self.handle_workers, self.tasks)
        await add_endpoint(self._service, "cancel", CANCEL, self.handle_cancel, self.tasks)
        log.info("router ready", subjects=[ROUTE, WORKERS, CANCEL])

    async def stop(self) -> None:
        if self._service is not None:
            await self._service.stop()
        for sub in (*self._event_subs, self._problems_sub):
            if sub is not None:
                with suppress(Exception):
                    await sub.unsubscribe()
        await self.aliases.stop()
        await self.tasks.wait(timeout_s=1.0)

    # -- feeds ---------------------------------------------------------------------------------

    async def _watch(
        self, kv: KeyValue, on_entry: Callable[[KeyValue.Entry], None], ready: asyncio.Event
    ) -> None:
        """Feed every value of ``kv`` (current ones first, then changes) to ``on_entry``;
        watched again after a reconnect (a restarted server has lost the watch)."""
        await follow_bucket(self.nc, kv, on_entry, ready)

    def _on_worker(self, entry: KeyValue.Entry) -> None:
        if entry.operation in ("DEL", "PURGE") or not entry.value:
            self.view.remove_worker(entry.key)
        else:
            self.view.put_worker(worker_record_decoder.decode(entry.value))

    def _on_sleeper(self, entry: KeyValue.Entry) -> None:
        if entry.operation in ("DEL", "PURGE") or not entry.value:
            self.view.remove_sleeper(entry.key)
        else:
            self.view.put_sleeper(worker_record_decoder.decode(entry.value))

    def _on_figure(self, entry: KeyValue.Entry) -> None:
        if entry.operation in ("DEL", "PURGE") or not entry.value:
            return
        value = _figure_decoder.decode(entry.value)
        figure = Figure(typical_ms=value.typical_ms, recent_failure_rate=value.recent_failure_rate)
        self.view.put_figure(value.model, value.domain, value.worker, figure)

    async def _on_task_event(self, msg: Msg) -> None:
        try:
            event = task_event_decoder.decode(msg.data)
        except msgspec.DecodeError:
            return
        waiter = self._waiters.get(event.task_id)
        if isinstance(event, TaskRouted):
            self.view.routed(event.task_id, event.worker, event.at)
            if waiter is not None:
                waiter.routed(event.attempt)
        elif isinstance(event, TaskCompleted | TaskFailed):
            self.view.ended(event.task_id)
            if waiter is not None:
                await waiter.ended(event)  # an older attempt's outcome is stale: ignored

    async def _on_duplicate(self, msg: Msg) -> None:
        try:
            event = _duplicate_decoder.decode(msg.data)
        except msgspec.DecodeError:
            return
        self._problems[event.worker_id] = (time.time(), f"duplicate_consumer: {event.reason}")

    async def _ping_reaper(self) -> None:
        """Ask every `REAPER_PING_S` whether a reaper runs, so `reaper_runs` rarely has to."""
        while True:
            await self._ask_reaper()
            await asyncio.sleep(REAPER_PING_S)

    async def _ask_reaper(self) -> None:
        try:
            await self.nc.request(f"$SRV.PING.{REAPER_SERVICE}", b"", timeout=0.5)
        except nats.errors.NoRespondersError:
            self._reaper_asked = float("-inf")  # a quick no: asking again costs nothing
        except Exception:
            self._reaper_asked = time.monotonic()  # no answer in time: not again at once
        else:
            self._reaper_seen = time.monotonic()

    async def reaper_runs(self) -> bool:
        """Does a reaper answer ``$SRV.PING`` (lately, or now)? Then a retryable failure will
        be moved on (`Waiter`)."""
        now = time.monotonic()
        if now - self._reaper_seen < 3 * REAPER_PING_S:
            return True
        if now - self._reaper_asked >= REAPER_PING_S / 4:
            await self._ask_reaper()
        return time.monotonic() - self._reaper_seen < 3 * REAPER_PING_S

    def problems(self, worker_id: str, now: float) -> list[str]:
        """What the reaper reported about the worker within `PROBLEM_SHOWN_S`."""
        seen = self._problems.get(worker_id)
        return [seen[1]] if seen is not None and now - seen[0] < PROBLEM_SHOWN_S else []

    def resolve_model(self, asked: str) -> str:
        """The canonical name a request for ``asked`` is routed as: aliases applied, and a
        bare name read as its ``:latest`` (or a ``:latest`` as the bare name an
        OpenAI-compatible server lists), whichever a live or sleeping worker serves."""
        records = (self.view.workers.values(), self.view.sleepers.values())

        def known(name: str) -> bool:
            # Scanned lazily: the name as asked is usually served, and found at the first
            # worker that has it (no set of every model built per request).
            return any(name in r.models for group in records for r in group)

        return resolve_name(asked, known, self.aliases.canonical)

    def _check_size(self, body_bytes: int) -> None:
        """Refuse a request whose task message would not fit in one NATS message, instead of
        failing on publish: images and long conversations are megabytes. The task is the
        request's fields plus ids and times, so the body's size (no second encoding) plus
        `TASK_OVERHEAD_BYTES` bounds it."""
        limit = self.nc.max_payload
        size = body_bytes + TASK_OVERHEAD_BYTES
        if size > limit:
            raise TooLarge(
                f"the request is {size} bytes as a task, over the NATS server's max_payload of "
                f"{limit} bytes; send fewer or smaller images, or raise max_payload on every "
                "server (the shipped configuration has 8MB)"
            )

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
                current_model=r.current_model,
                last_heartbeat=r.heartbeat_at,
                queue_depth=depth.get(r.worker_id, 0),
                problems=self.problems(r.worker_id, now),
                facts=r.facts,
            )
            for r in sorted(
                liveness.live(self.view.workers.values(), now, self.settings.worker_ttl_s),
                key=lambda r: r.worker_id,
            )
        ]
        aliases = {alias: self.aliases.canonical(alias) for alias in self.aliases.aliases}
        return encoder.encode(WorkersReply(workers=workers, aliases=aliases))

    async def handle_route(self, body: bytes) -> bytes:
        asked = parse_route_request(body, self.settings.max_prompt_chars)
        # Requests, registrations and statistics all use the canonical name (lesson 6).
        request = msgspec.structs.replace(asked, model=self.resolve_model(asked.model))
        if request.task_type == "embedding" and request.domain is None:
            # Embeddings have figures of their own, apart from any generation's.
            request = msgspec.structs.replace(request, domain=EMBEDDING)
        self._check_size(len(body))
        now = time.time()
        if now >= self._next_expiry:
            # A scan of every task in flight: once a second is plenty for ages of minutes.
            self._next_expiry = now + EXPIRE_INTERVAL_S
            self.view.expire(now, max_age_s=self.settings.default_timeout_s + WAIT_MARGIN_S)
        live = liveness.live(self.view.workers.values(), now, self.settings.worker_ttl_s)
        waking: WorkerRecord | None = None
        if request.task_type == "web_search":
            decision = policy.choose_web(live)
        else:
            domain = request.domain or classify_domain(request.prompt)
            needs = needs_of(request)
            candidates = [w.worker_id for w in live if request.model in w.models]
            try:
                decision = policy.choose(
                    request.model,
                    live,
                    designated=request.worker,
                    gpu_models=self.settings.gpu_models,
                    depth=self.view.depth(),
                    typical_ms=self.view.typical_ms(request.model, domain, candidates),
                    failure_rate=self.view.failure_rate(request.model, domain, candidates),
                    needs=needs,
                )
            except (NoWorker, UnsupportedCapability):
                sleeper = policy.choose_sleeper(
                    request.model,
                    self.view.sleepers.values(),
                    designated=request.worker,
                    needs=needs,
                )
                if sleeper is None:
                    raise
                decision = policy.decision_for(sleeper, "sleeping worker woken for the task")
                waking = sleeper
        task_id = new_task_id()
        timeout_s = request.timeout_s or self.settings.default_timeout_s
        waiter: Waiter | None = None
        stream_subject = reply_subject.get() if request.stream else None
        if request.stream and not stream_subject:
            raise BadRequest("stream=true needs a reply subject to send the chunks to")
        # A woken worker's start is watched from before the task is queued.
        started = (
            await self.nc.subscribe(task_event(task_id, "started"), max_msgs=1)
            if waking is not None
            else None
        )
        if request.wait or request.stream:
            # Registered before anything is published, so the end cannot be missed.
            waiter = Waiter(
                retryable_kind=is_retryable(request.task_type), moves_on=self.reaper_runs
            )
            self._waiters[task_id] = waiter
        waiting_on = reply_subject.get() if waiter is not None else ""
        if waiting_on:
            self._waiting_on[waiting_on] = task_id
        try:
            if stream_subject:
                # Before the task is queued, so it comes before any output (one connection keeps
                # the order): the client learns the task id and can cancel it from now on.
                await self.nc.publish(
                    stream_subject,
                    encoder.encode(StreamChunk(task_id=task_id, seq=0)),
                    headers={CHUNK_HEADER: "0"},
                )
            queued_seq = await self._submit(
                request,
                decision,
                task_id,
                timeout_s,
                now,
                asked_model=asked.model,
                stream_subject=stream_subject,
            )
            if waking is not None:
                assert started is not None
                await self._wake(waking, task_id, request.model, queued_seq, started)
                started = None  # watched by the wake's own task from now on
            log.info(
                "routed",
                task_id=task_id,
                model=request.model,
                worker=decision.worker_id,
                queue=decision.queue,
                reason=decision.reason,
                subject=decision.queue,
                stream_seq=queued_seq,
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
            wake_s = self.settings.wake_wait_s if waking is not None else 0.0
            outcome = await self._wait(task_id, waiter.future, timeout_s + wake_s + WAIT_MARGIN_S)
        finally:
            if started is not None:
                with suppress(Exception):
                    await started.unsubscribe()
            if waiter is not None:
                waiter.close()
            self._waiters.pop(task_id, None)
            self._waiting_on.pop(waiting_on, None)
        if isinstance(outcome, TaskCompleted):
            reply = RouteReply(
                task_id=task_id,
                status="done",
                queue=decision.queue,
                worker=outcome.worker,
                response=outcome.response,
                thinking=outcome.thinking,
                model=outcome.model,
                host=outcome.host,
                sources=outcome.sources,
                note=outcome.note,
                durations=outcome.durations,
                tokens=outcome.tokens,
                tool_calls=outcome.tool_calls,
                done_reason=outcome.done_reason,
                embeddings=outcome.embeddings,
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

    async def handle_cancel(self, body: bytes) -> bytes:
        """Pass a cancel on to the workers: the one running the task stops it, and one that has
        not taken it yet fails it unrun when it does. Refused for a task no router saw routed
        or that has ended."""
        try:
            request = _cancel_decoder.decode(body)
        except msgspec.DecodeError as exc:
            raise BadRequest(f"invalid cancel request: {exc}") from None
        if (request.task_id is None) == (request.reply_to is None):
            raise BadRequest("a cancel request names either task_id or reply_to")
        task_id = request.task_id or self._waiting_on.get(request.reply_to or "")
        if task_id is None:
            raise NotFound(f"no route request waits on {request.reply_to} (it was answered)")
        try:
            notice = cancel_notice(task_id)
        except InvalidId as exc:
            raise BadRequest(str(exc)) from None
        if task_id not in self.view.inflight and task_id not in self._waiters:
            raise NotFound(f"task {task_id} is not queued or running (it has ended, or is unknown)")
        request = CancelRequest(task_id=task_id, reason=request.reason)
        await self.nc.publish(notice, encoder.encode(request))
        log.info("cancel requested", task_id=task_id, reason=request.reason)
        return encoder.encode(CancelReply(task_id=task_id, status="cancelling"))

    async def _submit(
        self,
        request: RouteRequest,
        decision: policy.Decision,
        task_id: str,
        timeout_s: float,
        now: float,
        *,
        asked_model: str,
        stream_subject: str | None,
    ) -> int:
        """Record and queue the task; returns its message's sequence in ``TASKS``."""
        requested_model = asked_model if asked_model != request.model else None
        # Both events go out at once and their acknowledgements are awaited together: one
        # round trip instead of two. One connection keeps their order in EVENTS, and the task
        # is queued only once both are stored.
        submitted: object
        routed: PubAck | BaseException
        submitted, routed = await asyncio.gather(
            publish_event(
                self.js,
                TaskSubmitted(
                    at=now,
                    task_id=task_id,
                    model=request.model,
                    requested_worker=request.worker,
                    requested_model=requested_model,
                    timeout_s=timeout_s,
                    **work_of(request),
                ),
                msg_id=f"{task_id}:submitted",
            ),
            publish_event(
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
            ),
            return_exceptions=True,
        )
        if isinstance(submitted, BaseException):
            if not isinstance(routed, BaseException):
                # A routed task must end: the reaper would otherwise look for it.
                await self._fail_unqueued(task_id, decision, "its submission was not stored")
            reason = submitted or type(submitted).__name__
            raise Unavailable(f"could not record the task: {reason}") from submitted
        try:
            if isinstance(routed, BaseException):
                raise routed
            message = TaskMessage(
                task_id=task_id,
                attempt=1,
                model=request.model,
                timeout_s=timeout_s,
                stream=request.stream,
                stream_subject=stream_subject,
                submitted_at=now,
                **work_of(request),
                routed_seq=int(routed.seq),
            )
            ack = await self.js.publish(
                decision.queue,
                encoder.encode(message),
                # The worker continues this request's trace (traceparent).
                headers=inject_context({"Nats-Msg-Id": f"{task_id}:1"}),
            )
        except Exception as exc:
            reason = f"could not queue the task on {decision.queue}: {exc or type(exc).__name__}"
            await self._fail_unqueued(task_id, decision, reason)
            raise Unavailable(f"task {task_id}: {reason}") from exc
        return int(ack.seq)

    async def _fail_unqueued(self, task_id: str, decision: policy.Decision, reason: str) -> None:
        """Record the end of a task that was recorded but could not be queued (best effort)."""
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

    async def _wake(
        self, sleeper: WorkerRecord, task_id: str, model: str, seq: int, started: Subscription
    ) -> None:
        """Send the magic packet (at most once per `WAKE_RESEND_S` per worker), record it, and
        fail the task (its message ``seq`` in TASKS) if the worker has not started it within
        ``WAKE_WAIT_S`` (nothing on ``started``, the task's ``started`` subject)."""
        assert sleeper.wol_mac is not None
        now = time.monotonic()
        if now - self._woken.get(sleeper.worker_id, -WAKE_RESEND_S) >= WAKE_RESEND_S:
            self._woken[sleeper.worker_id] = now
            send_magic_packet(sleeper.wol_mac, self.settings.wol_broadcast, self.settings.wol_port)
            log.info("wake-on-lan sent", worker=sleeper.worker_id, mac=sleeper.wol_mac)
        await publish_event(
            self.js,
            WakeRequested(
                at=time.time(),
                worker_id=sleeper.worker_id,
                mac=sleeper.wol_mac,
                task_id=task_id,
                model=model,
            ),
        )
        self.tasks.spawn(
            self._give_up_waking(sleeper.worker_id, task_id, seq, started), name="wake-wait"
        )

    async def _give_up_waking(
        self, worker_id: str, task_id: str, seq: int, started: Subscription
    ) -> None:
        try:
            await started.next_msg(timeout=self.settings.wake_wait_s)
            return  # started in time
        except nats.errors.TimeoutError:
            pass
        finally:
            with suppress(Exception):
                await started.unsubscribe()
        try:
            # Take it out of the queue first, so a late wake cannot run a failed task.
            await self.js.delete_msg(TASKS_STREAM, seq)
        except NotFoundError:
            return  # the worker took it in the last moment
        reason = (
            f"worker '{worker_id}' was woken but did not start the task within "
            f"{self.settings.wake_wait_s:g} s (WAKE_WAIT_S)"
        )
        log.warning("wake timed out", task_id=task_id, worker=worker_id)
        await publish_event(
            self.js,
            TaskFailed(
                at=time.time(),
                task_id=task_id,
                attempt=1,
                worker=worker_id,
                code="wake_timeout",
                reason=reason,
            ),
            msg_id=f"{task_id}:failed:wake",
        )

    async def _wait(
        self, task_id: str, waiter: asyncio.Future[TaskCompleted | TaskFailed], timeout_s: float
    ) -> TaskCompleted | TaskFailed:
        try:
            # asyncio.timeout, not wait_for over a shield: three fewer hand-offs through the
            # loop per reply. A timeout cancels the future; nothing settles it afterwards.
            async with asyncio.timeout(timeout_s):
                return await waiter
        except TimeoutError:
            pass
        # The end event may have been missed during a reconnect: ask the stream itself (the
        # latest attempt's outcome, if the task was moved on).
        ended: list[TaskCompleted | TaskFailed] = []
        for kind in TERMINAL_KINDS:
            try:
                stored = await self.js.get_last_msg(EVENTS_STREAM, task_event(task_id, kind))
            except NotFoundError:
                continue
            event = task_event_decoder.decode(stored.data or b"")
            if isinstance(event, TaskCompleted | TaskFailed):
                ended.append(event)
        if ended:
            return max(ended, key=lambda e: (e.attempt, isinstance(e, TaskCompleted)))
        raise WaitTimeout(
            f"task {task_id} has not ended after {timeout_s:.0f} s; it may still finish: "
            f"ask coordinator.task for {task_id}"
        )


async def run(settings: RouterSettings, stop: asyncio.Event) -> None:
    """Run the router until ``stop`` is set."""
    nc = await connect(settings.nats_url, "coordinator-router", auth=settings.nats_auth())
    router = Router(nc, settings)
    try:
        await router.start()
        await stop.wait()
    finally:
        await router.stop()
        await nc.drain()
