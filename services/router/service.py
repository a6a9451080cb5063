"""The router service: the ``coordinator.route``, ``coordinator.workers`` and
``coordinator.cancel`` endpoints, over the fleet view its feeds keep.

A route request is decided (`services.router.decide`, pure), submitted (recorded and queued,
`services.router.submit`; a sleeping worker woken, `services.router.waking`) and answered:
at once, or with the task's outcome for a client that waits (`services.router.ending`,
`services.router.records`).
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator, Collection
from contextlib import asynccontextmanager, suppress

import msgspec
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.micro import add_service
from nats.micro.service import Service

from schemas.events import (
    TERMINAL_KINDS,
    TaskCompleted,
    TaskFailed,
    TaskRouted,
    WorkerDuplicate,
    encoder,
    task_event_decoder,
)
from schemas.models import resolve_name
from schemas.route import (
    CHUNK_HEADER,
    RouteRequest,
    StreamChunk,
)
from schemas.subjects import (
    ASLEEP_BUCKET,
    CANCEL,
    CHUNKS,
    ROUTE,
    STATS_BUCKET,
    WORKERS,
    task_event,
    task_event_source,
)
from schemas.tasks import is_retryable
from services import __version__
from services.fleet import liveness
from services.fleet.binding import refusal
from services.router.backlog import Backlog
from services.router.cancelling import Canceller
from services.router.decide import Plan, Submission, decide, submission
from services.router.ending import wait_for_end
from services.router.feeds import apply_figure, apply_sleeper
from services.router.following import Follower, Unsubmitted
from services.router.listing import Problems, workers_reply
from services.router.peers import Peers
from services.router.reaper_watch import ReaperWatch
from services.router.records import outcome_reply, queued_reply
from services.router.registry import RegistryFeed
from services.router.relay import ChunkRelay
from services.router.requests import Admitted, admit
from services.router.submit import AlreadySubmitted, submit
from services.router.view import FleetView
from services.router.waiting import Tracking, Waiter
from services.router.waking import Waker
from services.runtime.aliases import AliasFollower
from services.runtime.bus import connect, ensure_bucket, ensure_streams
from services.runtime.endpoints import add_endpoint, reply_subject
from services.runtime.errors import (
    NoWorker,
    Unavailable,
    UnsupportedCapability,
)
from services.runtime.lifecycle import TaskSet
from services.runtime.request import new_task_id
from services.runtime.settings import RouterSettings
from services.runtime.watch import follow_bucket

log = structlog.get_logger("router")

_duplicate_decoder = msgspec.json.Decoder(WorkerDuplicate)


# In-flight tasks whose end was missed are forgotten at most this often (see FleetView.expire).
EXPIRE_INTERVAL_S = 1.0

# Extra time a waiting request allows beyond the task's own timeout: queueing and event delivery.
WAIT_MARGIN_S = 30.0


class Router:
    """Holds the fleet view and answers route requests."""

    def __init__(self, nc: Client, settings: RouterSettings) -> None:
        self.nc = nc
        self.js: JetStreamContext = nc.jetstream()
        self.settings = settings
        self.view = FleetView()
        # Until the registry has been read (again, after a reconnect), no request is refused
        # for want of a live worker (`services.fleet.settling`).
        self.registry = RegistryFeed(nc, self.view, settings.worker_ttl_s)
        self.aliases = AliasFollower(self.js)
        self.tasks = TaskSet()
        self.waker = Waker(self.js, settings, self.tasks)
        self.reaper = ReaperWatch(nc)
        self._waiters: dict[str, Waiter] = {}
        # Reply subject of a waiting route request -> its task, so a client that never learned
        # the task id can cancel it (`CancelRequest.reply_to`).
        self._waiting_on: dict[str, str] = {}
        self._next_expiry = 0.0
        # What the reaper saw (duplicates), shown by `coordinator workers`.
        self.problems = Problems()
        self._event_subs: list[Subscription] = []
        self._problems_sub: Subscription | None = None
        self._chunk_sub: Subscription | None = None
        self.relay = ChunkRelay(nc, self.view.inflight)
        self.backlog = Backlog(self.js, self._on_task_event)
        # How long a task stays in the view without an end seen: its timeout and a margin.
        self._max_age_s = settings.default_timeout_s + WAIT_MARGIN_S
        # What this router holds in memory, for the others to ask, and theirs for it.
        self.peers = Peers(nc, self._waiters, self._waiting_on)
        self.follower = Follower(
            self.js,
            self._waiters,
            self._waiting_on,
            moves_on=self.reaper.runs,
            supports=self.supports,
            peers=self.peers,
        )
        self.canceller = Canceller(
            nc, self.view.inflight, self._waiters, self._waiting_on, self.peers
        )
        self._service: Service | None = None

    async def start(self) -> None:
        workers = await ensure_streams(self.js, worker_ttl_s=self.settings.worker_ttl_s)
        figures = await ensure_bucket(self.js, STATS_BUCKET, ttl_s=None)
        sleepers = await ensure_bucket(self.js, ASLEEP_BUCKET, ttl_s=None)
        await self.aliases.start()
        # Only the kinds routing needs: `submitted` (the largest event) and `started` would be
        # two more deliveries per task. A woken worker's `started` is asked for per task.
        self._event_subs = [
            await self.nc.subscribe(subject, cb=self.backlog.live)
            for subject in (
                "events.task.*.routed",
                "events.task.*.failed",  # the router's and the reaper's
                *(f"events.task.*.*.{kind}" for kind in TERMINAL_KINDS),  # the workers'
            )
        ]
        self._problems_sub = await self.nc.subscribe(
            "events.worker.*.duplicate", cb=self._on_duplicate
        )
        self._chunk_sub = await self.nc.subscribe(CHUNKS, cb=self.relay.on_chunk)
        await self.peers.start()
        ready = [asyncio.Event(), asyncio.Event(), asyncio.Event()]
        self.registry.follow(self.js, workers, ready[0], self.tasks)
        # Each bucket is watched again after a reconnect (a restarted server lost the watch).
        for kv, apply, name, done in (
            (figures, apply_figure, "watch-stats", ready[1]),
            (sleepers, apply_sleeper, "watch-asleep", ready[2]),
        ):
            self.tasks.spawn(
                follow_bucket(self.nc, kv, functools.partial(apply, self.view), done), name=name
            )
        self.tasks.spawn(self.reaper.watch(), name="ping-reaper")
        await asyncio.wait_for(asyncio.gather(*(r.wait() for r in ready)), timeout=10)
        # The tasks under way before this router started, as the other routers count them (a
        # pool member's outcome is judged by the registry: read first).
        await self.backlog.read_back(self._max_age_s)
        self._service = await add_service(
            self.nc,
            name="coordinator-router",
            version=__version__,
            description="routes prompts to workers",
        )
        await add_endpoint(self._service, "route", ROUTE, self.handle_route, self.tasks)
        await add_endpoint(self._service, "workers", WORKERS, self.handle_workers, self.tasks)
        await add_endpoint(self._service, "cancel", CANCEL, self.canceller.handle, self.tasks)
        log.info("router ready", subjects=[ROUTE, WORKERS, CANCEL])

    async def stop(self) -> None:
        if self._service is not None:
            await self._service.stop()
        for sub in (*self._event_subs, self._problems_sub, self._chunk_sub):
            if sub is not None:
                with suppress(Exception):
                    await sub.unsubscribe()
        await self.peers.stop()
        await self.aliases.stop()
        await self.tasks.wait(timeout_s=1.0)

    # -- feeds ---------------------------------------------------------------------------------

    async def _on_task_event(self, msg: Msg) -> None:
        try:
            event = task_event_decoder.decode(msg.data)
        except msgspec.DecodeError:
            return
        waiter = self._waiters.get(event.task_id)
        source = task_event_source(msg.subject)
        if isinstance(event, TaskRouted):
            self.view.routed(event.task_id, event.worker, event.at, event.model, event.domain)
            if waiter is not None:
                for refused in await waiter.routed(event.attempt, event.worker):
                    log.warning("outcome refused", task_id=event.task_id, problem=refused)
        elif isinstance(event, TaskCompleted | TaskFailed):
            problem: str | None
            if waiter is not None:
                # An older attempt's outcome is stale: ignored.
                problem = await waiter.ended(event, source)
            else:
                routed = self.view.inflight.get(event.task_id)
                where = None if routed is None else (event.attempt, routed[0])
                problem = refusal(event, source, where, self.supports)
            if problem is not None:
                log.warning("outcome refused", task_id=event.task_id, problem=problem)
                return
            self.view.ended(event.task_id)

    async def _on_duplicate(self, msg: Msg) -> None:
        try:
            event = _duplicate_decoder.decode(msg.data)
        except msgspec.DecodeError:
            return
        self.problems.report(event.worker_id, f"duplicate_consumer: {event.reason}", time.time())

    def supports(self, worker_id: str) -> Collection[str] | None:
        """What a registered worker (awake or asleep) supports; None for one not registered."""
        record = self.view.workers.get(worker_id) or self.view.sleepers.get(worker_id)
        return None if record is None else record.supports

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

    # -- endpoints -----------------------------------------------------------------------------

    async def handle_workers(self, body: bytes) -> bytes:
        now = time.time()
        reply = workers_reply(
            self.view,
            self.problems,
            self.aliases.aliases,
            self.aliases.canonical,
            now=now,
            ttl_s=self.settings.worker_ttl_s,
            settling=not self.registry.settled(now),
        )
        return encoder.encode(reply)

    async def handle_route(self, body: bytes) -> bytes | None:
        """Decide where the task goes, submit it, and reply: at once (``queued``), or with
        its outcome to a client that waits (``wait``, or ``stream`` after the chunks). A
        request naming a task already submitted is answered as that task (`Follower`)."""
        admitted = admit(
            body,
            max_prompt_chars=self.settings.max_prompt_chars,
            max_payload=self.nc.max_payload,
            resolve=self.resolve_model,
        )
        if admitted.routed.task_id is not None:
            followed = await self._follow(admitted.routed, admitted.routed.task_id)
            if not isinstance(followed, Unsubmitted):
                return followed
        now = time.time()
        try:
            plan = self._decide(admitted.routed, now)
        except (NoWorker, UnsupportedCapability):
            await self.registry.look_again(self.js)  # a refusal on a view just healed?
            now = time.time()
            plan = self._decide(admitted.routed, now)
        task = self._new_task(admitted, plan, now)
        try:
            async with self._tracking(task) as tracking:
                seq = await self._submit(task, tracking)
                self._log_routed(task, seq)
                if tracking.waiter is None:
                    return encoder.encode(queued_reply(task))
                outcome = await self._wait(task, tracking.waiter)
        except AlreadySubmitted:
            # Another router took the same request a moment before: its routing stands.
            followed = await self._follow(admitted.routed, task.task_id)
            if isinstance(followed, Unsubmitted):
                raise Unavailable(
                    f"task {task.task_id} could not be submitted; ask again"
                ) from None
            return followed
        return encoder.encode(outcome_reply(task, outcome))

    async def _follow(self, request: RouteRequest, task_id: str) -> bytes | Unsubmitted | None:
        reply = await self.follower.answer(request, task_id, reply_subject.get())
        if reply is None or isinstance(reply, Unsubmitted):
            return reply
        log.info("followed", task_id=task_id, status=reply.status)
        return encoder.encode(reply)

    def _decide(self, request: RouteRequest, now: float) -> Plan:
        """Where the task goes, by the fleet as the view has it ``now``."""
        if now >= self._next_expiry:
            # A scan of every task in flight: once a second is plenty for ages of minutes.
            self._next_expiry = now + EXPIRE_INTERVAL_S
            self.view.expire(now, max_age_s=self._max_age_s)
        live = liveness.live(self.view.workers.values(), now, self.settings.worker_ttl_s)
        try:
            plan = decide(
                request,
                live,
                self.view.sleepers.values(),
                self.view,
                gpu_models=self.settings.gpu_models,
                gpu_preference=self.settings.gpu_preference,
            )
        except (NoWorker, UnsupportedCapability) as exc:
            # A refusal for want of a live worker, judged on a view still being re-read, may
            # be wrong: the client is told to retry instead, and nothing is stored.
            self.registry.refuse_while_settling(now, f"a live worker can take it ({exc.message})")
            raise
        if plan.waking is not None:
            # Nor is a machine woken because its live peers have not been heard from yet.
            self.registry.refuse_while_settling(now, f"a live worker serves {request.model}")
        return plan

    def _new_task(self, admitted: Admitted, plan: Plan, now: float) -> Submission:
        return submission(
            admitted.routed.task_id or new_task_id(),
            admitted.routed,
            plan,
            asked_model=admitted.asked_model,
            now=now,
            default_timeout_s=self.settings.default_timeout_s,
            reply_to=reply_subject.get(),
        )

    @asynccontextmanager
    async def _tracking(self, task: Submission) -> AsyncIterator[Tracking]:
        """Follow the task while its request is handled: a woken worker's start is watched
        from before the task is queued, and a waiting client's end is registered before
        anything is published, so neither can be missed. Dropped when the request is done."""
        tracking = Tracking()
        if task.plan.waking is not None:
            tracking.started = await self.nc.subscribe(
                task_event(task.task_id, "started", task.plan.waking.worker_id), max_msgs=1
            )
        if task.waits:
            tracking.waiter = Waiter(
                retryable_kind=is_retryable(task.request.task_type),
                moves_on=self.reaper.runs,
                routed_to=task.decision.worker_id,
                supports=self.supports,
            )
            self._waiters[task.task_id] = tracking.waiter
            tracking.waiting_on = reply_subject.get()
            if tracking.waiting_on:
                self._waiting_on[tracking.waiting_on] = task.task_id
        if task.stream_subject:
            self.relay.open(task.task_id, task.stream_subject)
        try:
            yield tracking
        finally:
            if tracking.started is not None:
                with suppress(Exception):
                    await tracking.started.unsubscribe()
            if tracking.waiter is not None:
                tracking.waiter.close()
            self._waiters.pop(task.task_id, None)
            self._waiting_on.pop(tracking.waiting_on, None)
            self.relay.close(task.task_id)

    async def _submit(self, task: Submission, tracking: Tracking) -> int:
        """Queue the task (a stream first learns its id) and wake the sleeping worker it goes
        to; returns its message's sequence in ``TASKS``."""
        if task.stream_subject:
            # Before the task is queued, so it comes before any output (one connection keeps
            # the order): the client learns the task id and can cancel it from now on.
            await self.nc.publish(
                task.stream_subject,
                encoder.encode(StreamChunk(task_id=task.task_id, seq=0)),
                headers={CHUNK_HEADER: "0"},
            )
        seq = await submit(self.js, task)
        sleeper = task.plan.waking
        if sleeper is not None:
            assert tracking.started is not None
            await self.waker.wake(sleeper, task.task_id, task.request.model, seq, tracking.started)
            tracking.started = None  # watched by the wake's own task from now on
        return seq

    def _log_routed(self, task: Submission, seq: int) -> None:
        decision = task.decision
        log.info(
            "routed",
            task_id=task.task_id,
            model=task.request.model,
            worker=decision.worker_id,
            queue=decision.queue,
            reason=decision.reason,
            subject=decision.queue,
            stream_seq=seq,
        )

    async def _wait(self, task: Submission, waiter: Waiter) -> TaskCompleted | TaskFailed:
        """The task's outcome, allowing its timeout, a woken worker's wake and a margin."""
        wake_s = self.settings.wake_wait_s if task.plan.waking is not None else 0.0
        budget_s = task.timeout_s + wake_s + WAIT_MARGIN_S
        return await wait_for_end(self.js, task.task_id, waiter, budget_s)


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
