"""The stats service: a durable consumer projecting ``EVENTS`` into PostgreSQL, the routing
figures in the KV bucket ``stats``, and the query and operator endpoints.

This module wires the three parts together and owns their lifecycle: ``consumer`` (the live
projection: fetch, apply, ack), ``publisher`` (figure rows and the KV bucket kept in step) and
``endpoints`` (the handlers). A rebuild pauses the projection between batches through the
consumer's batch lock, and then has the publisher bring the whole bucket in line.

Any number may run; one projects (`services.runtime.leadership`: the ``stats`` lease in the
``leaders`` bucket). Only that one fetches from the durable consumer and publishes figures.
Every instance answers every endpoint: those that read PostgreSQL or record an event itself,
and ``coordinator.stats`` and ``.rebuild`` (`endpoints.PROJECTING_ONLY`) by passing them on
to the projecting one (``coordinator.stats.projecting.<endpoint>``, where only it listens),
whose answer it returns; ``unavailable`` while none projects (a takeover under way). Taking
over, an instance brings every figure in line with its facts, gives tracking rows from before
digests were kept theirs (`ProjectionConsumer.fill_digests`), applies in order what the
previous one had in hand (`ProjectionConsumer.catch_up`), then fetches on from where the
consumer stands; the tracking rows keep every event applied once.
"""

from __future__ import annotations

import asyncio
from contextlib import suppress
from typing import Final

import nats.errors
import structlog
from nats.aio.client import Client
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.micro import add_service
from nats.micro.service import Service

from schemas.subjects import (
    EVENTS_STREAM,
    LEADERS_BUCKET,
    STATS_BUCKET,
    STATS_CONSUMER,
    STATS_PROJECTING,
    STATS_ROLE,
)
from services import __version__
from services.errors import Unavailable
from services.runtime.bus import (
    connect,
    ensure_bucket,
    ensure_streams,
    flush_written,
    started,
)
from services.runtime.endpoints import Handler, add_endpoint, serve_subject
from services.runtime.leadership import Leadership
from services.runtime.lifecycle import TaskSet, close_bus, stop_within
from services.runtime.request import raise_if_error
from services.stats.consumer import ProjectionConsumer
from services.stats.endpoints import PROJECTING_ONLY, StatsEndpoints
from services.stats.publisher import FigurePublisher
from services.stats.settings import StatsSettings
from services.stats.store import Store

log = structlog.get_logger("stats")

SERVICE_NAME: Final = "coordinator-stats"

# How long a stop waits for the batch in hand before cancelling it.
STOP_GRACE_S: Final = 30.0
# How long an instance that stands by waits for the projecting one's answer to a request it
# passed on (a rebuild replays the whole log).
PASS_ON_TIMEOUT_S: Final = {"stats": 30.0, "rebuild": 3600.0}


class StatsService:
    """Projects events into the store (while it holds the role), publishes routing figures,
    answers the endpoints.

    The caller owns the NATS connection and the store; `stop` leaves both open.
    """

    def __init__(self, nc: Client, store: Store, settings: StatsSettings) -> None:
        self.nc = nc
        self.js: JetStreamContext = nc.jetstream()
        self.store = store
        self.settings = settings
        self.tasks = TaskSet()
        self._stopping = asyncio.Event()
        self.publisher = FigurePublisher(store, self._stopping)
        self.projection = ProjectionConsumer(
            self.js,
            store,
            batch_size=settings.batch_size,
            stopping=self._stopping,
            touched=self.publisher.note_touched,
        )
        self.endpoints = StatsEndpoints(
            self.js, store, self.publisher, pause=self.projection.batch_lock
        )
        self.leadership: Leadership | None = None
        self._service: Service | None = None

    async def start(self) -> None:
        """Set up streams, consumer and buckets, then serve the endpoints; `run` projects
        once this instance holds the stats role."""
        await ensure_streams(self.js)
        self.publisher.kv = await ensure_bucket(self.js, STATS_BUCKET, ttl_s=None)
        leaders = await ensure_bucket(self.js, LEADERS_BUCKET, ttl_s=self.settings.worker_ttl_s)
        self.leadership = Leadership(
            leaders,
            STATS_ROLE,
            ttl_s=self.settings.worker_ttl_s,
            interval_s=self.settings.heartbeat_interval_s,
        )
        await self.projection.ensure_consumer()
        self._service = await add_service(
            self.nc,
            name=SERVICE_NAME,
            version=__version__,
            description="task and figure queries from the stats read model",
        )
        routes = self.endpoints.routes()
        for name, subject, handler in routes:
            answer = self._passed_on(name, handler) if name in PROJECTING_ONLY else handler
            await add_endpoint(self._service, name, subject, answer, self.tasks)
        await flush_written(self.nc)  # in place for every client before anyone is told
        log.info("stats ready", consumer=STATS_CONSUMER, subjects=[s for _, s, _ in routes])
        if await self.store.predates_outcomes():
            log.warning(
                "the figures do not count the tasks projected before this version; "
                "run `coordinator stats rebuild` once to count them"
            )

    def _passed_on(self, name: str, handler: Handler) -> Handler:
        """``handler`` here while this instance projects; else the request passed on to the
        instance that does, and its answer (or error) returned."""
        subject = f"{STATS_PROJECTING}.{name}"

        async def handle(body: bytes) -> bytes | None:
            if self.leadership is not None and self.leadership.active:
                return await handler(body)
            try:
                reply = await self.nc.request(subject, body, timeout=PASS_ON_TIMEOUT_S[name])
            except nats.errors.NoRespondersError:
                raise Unavailable(
                    "no stats instance projects just now (one takes over within "
                    f"WORKER_TTL_S, {self.settings.worker_ttl_s:g} s); ask again"
                ) from None
            except nats.errors.TimeoutError:
                raise Unavailable(
                    f"the projecting stats instance did not answer {name} in time; ask again"
                ) from None
            raise_if_error(reply.data, reply.headers or {})
            return reply.data

        return handle

    async def run(self, stop: asyncio.Event) -> None:
        """Stand by, or project while this instance holds the stats role, until ``stop``."""
        assert self.leadership is not None
        await self.leadership.run(lambda: self.project_until(stop), stop, stop_grace_s=STOP_GRACE_S)

    async def project_until(self, stop: asyncio.Event) -> None:
        """Project and publish until ``stop`` (then finish the batch in hand) or until
        cancelled (this instance no longer holds the role: the batch in hand is dropped
        unacknowledged, and whoever takes over applies it)."""
        self._stopping.clear()
        # The previous holder may have left figures behind their facts: bring them all in line.
        await self.store.refresh_figures()
        # Tracking rows from before digests were kept get theirs before anything is applied.
        await self.projection.fill_digests()
        await self.projection.catch_up()
        sub = await self.js.pull_subscribe_bind(durable=STATS_CONSUMER, stream=EVENTS_STREAM)
        self.publisher.resync()
        loop = asyncio.create_task(self.projection.run(sub), name="stats-projection")
        publisher = asyncio.create_task(self.publisher.run(), name="stats-figures")
        served: list[Subscription] = []
        try:
            for name, _, handler in self.endpoints.routes():
                if name in PROJECTING_ONLY:
                    served.append(
                        await serve_subject(
                            self.nc,
                            name,
                            f"{STATS_PROJECTING}.{name}",
                            handler,
                            queue=STATS_ROLE,
                            tasks=self.tasks,
                        )
                    )
            log.info("stats projecting", consumer=STATS_CONSUMER)
            await stop.wait()
            self._stopping.set()
            await loop  # the batch in hand (the leadership cancels it after STOP_GRACE_S)
            self.publisher.wake()
            await asyncio.wait_for(publisher, timeout=5.0)
        finally:
            self._stopping.set()
            for task in (loop, publisher):
                task.cancel()
            await asyncio.gather(loop, publisher, return_exceptions=True)
            for subscription in served:
                with suppress(Exception):
                    await asyncio.wait_for(subscription.unsubscribe(), timeout=2.0)
            with suppress(Exception):
                await asyncio.wait_for(sub.unsubscribe(), timeout=2.0)

    async def stop(self) -> None:
        """Stop the endpoints; log one summary line (`run` has stopped projecting)."""
        if self._service is not None:
            await stop_within("stats endpoints", self._service.stop())
        await self.tasks.wait(timeout_s=1.0)
        c = self.projection.counters
        log.info(
            "stats stopped",
            projected=c.projected,
            duplicates=c.duplicates,
            terminated=c.terminated,
            retried=c.retried,
            parked=c.parked,
        )


async def run(settings: StatsSettings, stop: asyncio.Event) -> None:
    """Run the stats service until ``stop`` is set, then close the bus and the pool."""
    store = await Store.connect(settings.pg_dsn)
    try:
        await store.apply_schema()
        nc = await connect(settings.nats_url, SERVICE_NAME, auth=settings.nats_auth())
        service: StatsService | None = None
        try:
            service = await started(
                lambda: StatsService(nc, store, settings), "the stats service's start"
            )
            await service.run(stop)
        finally:
            if service is not None:
                await service.stop()
            await close_bus(nc)
    finally:
        # The pool's connections in use get 2 s, then are terminated (within the step's time).
        await stop_within("close the database pool", store.close(timeout_s=2.0))
