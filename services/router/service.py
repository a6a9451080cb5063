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
from collections.abc import Callable, Collection
from contextlib import suppress

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
from schemas.queries import AliasMap
from schemas.route import (
    RouteRequest,
)
from schemas.subjects import (
    ALIAS_MAP,
    ASLEEP_BUCKET,
    CANCEL,
    CANCELS_FROM,
    CHUNKS,
    LAST_EVENT,
    OWN_CONSUMER,
    ROUTE,
    STATS_BUCKET,
    WORKERS,
    task_event_source,
)
from services import __version__
from services.errors import (
    CoordinatorError,
    Forbidden,
    NoWorker,
    Unavailable,
    UnsupportedCapability,
)
from services.fleet import liveness
from services.fleet.binding import refusal
from services.fleet.identity import Owner, asker_of, is_operator, may_change_models, may_see
from services.router.backlog import Backlog
from services.router.cancelling import Canceller
from services.router.consumers import own_consumer
from services.router.decide import Plan, Submission, decide, submission
from services.router.ending import recheck_ends
from services.router.eventreads import last_event
from services.router.feeds import apply_figure, apply_sleeper
from services.router.following import UNSUBMITTED, Follower, Unsubmitted, task_owner
from services.router.listing import Problems, workers_reply
from services.router.peers import Peers
from services.router.reaper_watch import ReaperWatch
from services.router.records import outcome_reply, queued_reply
from services.router.relay import ChunkRelay
from services.router.requests import Admitted, admit, parse_workers_query
from services.router.settings import RouterSettings
from services.router.submit import AlreadySubmitted, record_refusal
from services.router.submitting import WAIT_MARGIN_S, Submitter
from services.router.view import FleetView
from services.router.waiting import Waiter
from services.router.waking import Waker
from services.runtime.aliases import AliasFollower
from services.runtime.bus import (
    connect,
    ensure_bucket,
    ensure_streams,
    fences_by_subject,
    flush_written,
    started,
)
from services.runtime.endpoints import add_endpoint, reply_subject
from services.runtime.lifecycle import TaskSet, close_bus, stop_within
from services.runtime.registry import RegistryFeed
from services.runtime.request import new_task_id
from services.runtime.watch import follow_bucket

log = structlog.get_logger("router")

_duplicate_decoder = msgspec.json.Decoder(WorkerDuplicate)


# In-flight tasks whose end was missed are forgotten at most this often (see FleetView.expire).
EXPIRE_INTERVAL_S = 1.0


# How long `coordinator.workers` waits for the owners of the running tasks (each read at once).
OWNERS_READ_S = 1.0


class Router:
    """Holds the fleet view and answers route requests."""

    def __init__(self, nc: Client, settings: RouterSettings) -> None:
        self.nc = nc
        self.js: JetStreamContext = nc.jetstream()
        self.settings = settings
        self.view = FleetView()
        # Until the registry has been read (again, after a reconnect), no request is refused
        # for want of a live worker (`services.fleet.settling`).
        self.registry = RegistryFeed(nc, self.view, settings.worker_ttl_s, role="router")
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
        self.submitter = Submitter(
            nc,
            settings,
            self.waker,
            self.relay,
            waiters=self._waiters,
            waiting_on=self._waiting_on,
            moves_on=self.reaper.runs,
            supports=self.supports,
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
        self.tasks.spawn(recheck_ends(self.js, self._waiters), name="recheck-ends")
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
        await add_endpoint(
            self._service, "cancel-from", CANCELS_FROM, self.canceller.handle, self.tasks
        )
        # What a worker with credentials may not do itself: read its tasks' events, make its
        # own consumer, follow the aliases.
        for name, subject, handler in (
            ("last-event", LAST_EVENT, last_event),
            ("own-consumer", OWN_CONSUMER, own_consumer),
        ):
            endpoint = functools.partial(handler, self.js)
            await add_endpoint(self._service, name, subject, endpoint, self.tasks)
        await add_endpoint(self._service, "aliases", ALIAS_MAP, self.handle_aliases, self.tasks)
        await flush_written(self.nc)  # in place for every client before anyone is told
        log.info(
            "router ready",
            subjects=[ROUTE, WORKERS, CANCEL, CANCELS_FROM, LAST_EVENT, OWN_CONSUMER, ALIAS_MAP],
        )

    async def stop(self) -> None:
        """Stop answering and following; every step bounded, none raising (the bus may be
        away)."""
        if self._service is not None:
            await stop_within("router endpoints", self._service.stop())
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

    async def handle_aliases(self, body: bytes) -> bytes:
        """The alias map as this router follows it (for workers that may not follow it)."""
        return encoder.encode(AliasMap(aliases=dict(self.aliases.aliases)))

    async def handle_workers(self, body: bytes) -> bytes:
        query = parse_workers_query(body)
        shown = await self._tasks_shown(Owner.asking(reply_subject.get(), query.client))
        now = time.time()
        reply = workers_reply(
            self.view,
            self.problems,
            self.aliases.aliases,
            self.aliases.canonical,
            now=now,
            ttl_s=self.settings.worker_ttl_s,
            settling=not self.registry.settled(now),
            shown=shown,
        )
        return encoder.encode(reply)

    async def _tasks_shown(self, viewer: Owner) -> Callable[[str], bool]:
        """Which running tasks' ids ``viewer`` may see: all for the operator, else those whose
        ``submitted`` says they are its own (one read each, at once, within
        `OWNERS_READ_S`). One whose read fails is not shown: the listing answers without
        JetStream, as it always has (a test of outages asks it while JetStream is away)."""
        if is_operator(viewer.asker):
            return lambda _: True
        running = sorted({r.current_task for r in self.view.workers.values() if r.current_task})
        if not running:
            return lambda _: False
        reads = [asyncio.ensure_future(task_owner(self.js, t)) for t in running]
        _, late = await asyncio.wait(reads, timeout=OWNERS_READ_S)
        for read in late:
            read.cancel()
        await asyncio.gather(*late, return_exceptions=True)
        mine = set()
        for task_id, read in zip(running, reads, strict=True):
            owner = None if read.cancelled() or read.exception() else read.result()
            if owner is not None and may_see(owner, viewer):  # unknown: the operator's only
                mine.add(task_id)
        return mine.__contains__

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
        asker = asker_of(reply_subject.get())
        if admitted.routed.task_type == "model_change" and not may_change_models(asker):
            raise Forbidden(f"only the operator may change the machines' models (not {asker})")
        with self.peers.arrived(admitted.routed.task_id):
            return await self._handle_route(admitted)

    async def _handle_route(self, admitted: Admitted) -> bytes | None:
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
            try:
                plan = self._decide(admitted.routed, now)
            except (NoWorker, UnsupportedCapability) as refused:
                followed = await self._known_elsewhere(admitted.routed, refused)
                if not isinstance(followed, Unsubmitted):
                    return followed
                raise
        task = self._new_task(admitted, plan, now)
        try:
            async with self.submitter.tracking(task) as tracking:
                await self.submitter.submit(task, tracking)
                if tracking.waiter is None:
                    return encoder.encode(queued_reply(task))
                outcome = await self.submitter.wait(task, tracking.waiter)
        except AlreadySubmitted:
            # Another router took the same request a moment before: its routing stands.
            followed = await self._follow(admitted.routed, task.task_id)
            if isinstance(followed, Unsubmitted):
                raise Unavailable(
                    f"task {task.task_id} could not be submitted; ask again"
                ) from None
            return followed
        return encoder.encode(outcome_reply(task, outcome))

    async def _known_elsewhere(
        self, request: RouteRequest, refused: CoordinatorError
    ) -> bytes | Unsubmitted | None:
        """Before refusing, for want of a live worker, a request that names its task: is the
        task held by another router, or in the log? A client asked again, of this router,
        while the router it asked first was still storing the task (an election holds its
        writes), or the copy of the log this router read first lagged (a node that just
        rejoined): refused here, the client would be told ``no_worker`` for a task that then
        runs. Held elsewhere: silent (None), the client asks again; in the log, read from the
        stream's leader: answered as that task. Neither: the refusal is stored, so that no
        router can store the task after it (a router that held it while its connection moved
        to another server did not answer), and `UNSUBMITTED` says refuse; stored meanwhile
        after all: followed again, or silent. Asked only for a model some registered worker
        serves (its workers silent, not an unknown model): the peers' silence costs up to a
        second. Asked too when no worker is registered at all: the registry's entries expire
        while its leader is elected, and the fleet's workers with them."""
        task_id = request.task_id
        registered = [
            record
            for group in (self.view.workers.values(), self.view.sleepers.values())
            for record in group
        ]
        if task_id is None or (
            registered and not any(request.model in record.models for record in registered)
        ):
            return UNSUBMITTED
        if await self.peers.holder_of(task_id=task_id) == task_id:
            log.info("asked again; another router holds the task", task_id=task_id)
            return None
        followed = await self._follow(request, task_id, leader=True)
        if not isinstance(followed, Unsubmitted) or not fences_by_subject(self.nc):
            return followed
        if await record_refusal(self.js, task_id, refused):
            return UNSUBMITTED
        log.info("refusing, found the task stored meanwhile", task_id=task_id)
        followed = await self._follow(request, task_id, leader=True)
        return None if isinstance(followed, Unsubmitted) else followed

    async def _follow(
        self, request: RouteRequest, task_id: str, *, leader: bool = False
    ) -> bytes | Unsubmitted | None:
        reply = await self.follower.answer(request, task_id, reply_subject.get(), leader=leader)
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


async def run(settings: RouterSettings, stop: asyncio.Event) -> None:
    """Run the router until ``stop`` is set."""
    nc = await connect(settings.nats_url, "coordinator-router", auth=settings.nats_auth())
    router: Router | None = None
    try:
        router = await started(lambda: Router(nc, settings), "the router's start")
        await stop.wait()
    finally:
        if router is not None:
            await router.stop()
        await close_bus(nc)
