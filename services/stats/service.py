"""The stats service: a durable consumer projecting ``EVENTS`` into PostgreSQL, the routing
figures in the KV bucket ``stats``, and the query and operator endpoints.

This module wires the three parts together and owns their lifecycle: ``consumer`` (the live
projection: fetch, apply, ack), ``publisher`` (figure rows and the KV bucket kept in step) and
``endpoints`` (the handlers). A rebuild pauses the projection between batches through the
consumer's batch lock, and then has the publisher bring the whole bucket in line.
"""

from __future__ import annotations

import asyncio
from contextlib import suppress
from typing import Final

import structlog
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.micro import add_service
from nats.micro.service import Service

from schemas.subjects import EVENTS_STREAM, STATS_BUCKET, STATS_CONSUMER
from services import __version__
from services.runtime.bus import connect, ensure_bucket, ensure_streams
from services.runtime.endpoints import add_endpoint
from services.runtime.lifecycle import TaskSet
from services.runtime.settings import StatsSettings
from services.stats.consumer import ProjectionConsumer
from services.stats.endpoints import StatsEndpoints
from services.stats.publisher import FigurePublisher
from services.stats.store import Store

log = structlog.get_logger("stats")

SERVICE_NAME: Final = "coordinator-stats"

# How long a stop waits for the batch in hand before cancelling it.
STOP_GRACE_S: Final = 30.0


class StatsService:
    """Projects events into the store, publishes routing figures, answers the endpoints.

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
        self._sub: JetStreamContext.PullSubscription | None = None
        self._service: Service | None = None
        self._loop: asyncio.Task[None] | None = None
        self._publisher: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Set up streams, consumer and bucket, start projecting, then serve the endpoints."""
        await ensure_streams(self.js)
        self.publisher.kv = await ensure_bucket(self.js, STATS_BUCKET, ttl_s=None)
        await self.projection.ensure_consumer()
        # A stop (or crash) can leave figures behind their facts: bring them all in line.
        await self.store.refresh_figures()
        self._sub = await self.js.pull_subscribe_bind(durable=STATS_CONSUMER, stream=EVENTS_STREAM)
        self._loop = asyncio.create_task(self.projection.run(self._sub), name="stats-projection")
        self._publisher = asyncio.create_task(self.publisher.run(), name="stats-figures")
        self._service = await add_service(
            self.nc,
            name=SERVICE_NAME,
            version=__version__,
            description="task and figure queries from the stats read model",
        )
        routes = self.endpoints.routes()
        for name, subject, handler in routes:
            await add_endpoint(self._service, name, subject, handler, self.tasks)
        log.info("stats ready", consumer=STATS_CONSUMER, subjects=[s for _, s, _ in routes])
        if await self.store.predates_outcomes():
            log.warning(
                "the figures do not count the tasks projected before this version; "
                "run `coordinator stats rebuild` once to count them"
            )

    async def stop(self) -> None:
        """Stop fetching, finish the batch in hand, stop the endpoints; log one summary line."""
        self._stopping.set()
        if self._loop is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._loop), timeout=STOP_GRACE_S)
            except TimeoutError:
                log.warning("projection did not finish its batch in time; cancelling")
                self._loop.cancel()
                with suppress(asyncio.CancelledError):
                    await self._loop
            except Exception:
                log.exception("projection loop failed")
        if self._service is not None:
            await self._service.stop()
        await self.tasks.wait(timeout_s=1.0)
        if self._publisher is not None:
            self.publisher.wake()
            with suppress(Exception):
                await asyncio.wait_for(self._publisher, timeout=5.0)
        if self._sub is not None:
            with suppress(Exception):
                await self._sub.unsubscribe()
        c = self.projection.counters
        log.info(
            "stats stopped",
            projected=c.projected,
            duplicates=c.duplicates,
            terminated=c.terminated,
            retried=c.retried,
        )


async def run(settings: StatsSettings, stop: asyncio.Event) -> None:
    """Run the stats service until ``stop`` is set, then close the bus and the pool."""
    store = await Store.connect(settings.pg_dsn)
    try:
        await store.apply_schema()
        nc = await connect(settings.nats_url, SERVICE_NAME, auth=settings.nats_auth())
        service = StatsService(nc, store, settings)
        try:
            await service.start()
            await stop.wait()
        finally:
            await service.stop()
            await nc.drain()
    finally:
        await store.close()
