"""The stats service: a durable consumer projecting ``EVENTS`` into PostgreSQL, and the
``coordinator.task`` endpoint answering from that read model.

Delivery is at least once and the store applies each stream position once, so the rule is
simple: ack only after the event's transaction has committed. When PostgreSQL is away the rest
of the batch is nak'ed with a delay and fetching pauses with a growing backoff; nothing is
acked that was not stored. A message that is not a known event is terminated (logged), so it
never blocks the stream.
"""

from __future__ import annotations

import asyncio
from contextlib import suppress
from dataclasses import dataclass
from typing import Final

import msgspec
import nats.errors
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.micro import add_service
from nats.micro.service import Service

from schemas.events import (
    AnyEvent,
    WorkerRegistered,
    WorkerStopped,
    any_event_decoder,
    encoder,
    kind_of,
)
from schemas.queries import TaskQuery
from schemas.subjects import EVENTS_STREAM, EVENTS_SUBJECTS, TASK
from services import __version__
from services.runtime.bus import connect, ensure_streams
from services.runtime.endpoints import add_endpoint
from services.runtime.errors import BadRequest, NotFound, Unavailable
from services.runtime.lifecycle import TaskSet
from services.runtime.settings import StatsSettings
from services.stats.store import Store, Unstorable

log = structlog.get_logger("stats")

CONSUMER: Final = "stats"
SERVICE_NAME: Final = "coordinator-stats"

# An idle fetch returns after this long, which bounds how late a stop is noticed.
FETCH_TIMEOUT_S: Final = 1.0
# Redelivery delay for events not stored because PostgreSQL was away.
NAK_DELAY_S: Final = 1.0
# Pauses between attempts while PostgreSQL (or the bus) is away: 1, 2, 4, 5, 5… seconds.
BACKOFF_FIRST_S: Final = 1.0
BACKOFF_MAX_S: Final = 5.0
# How long a stop waits for the batch in hand before cancelling it.
STOP_GRACE_S: Final = 30.0

_task_query_decoder = msgspec.json.Decoder(TaskQuery)


def consumer_config(*, max_ack_pending: int = 1000, ack_wait_s: float = 30.0) -> ConsumerConfig:
    """The durable ``stats`` consumer: every event from the start, acked one by one."""
    return ConsumerConfig(
        durable_name=CONSUMER,
        description="stats projection into PostgreSQL",
        filter_subject=EVENTS_SUBJECTS,
        deliver_policy=DeliverPolicy.ALL,
        ack_policy=AckPolicy.EXPLICIT,
        ack_wait=ack_wait_s,
        max_ack_pending=max_ack_pending,
    )


def parse_task_query(body: bytes) -> TaskQuery:
    """Decode a ``coordinator.task`` request; every refusal is a `BadRequest`."""
    try:
        query = _task_query_decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise BadRequest(f'invalid task query (expected {{"task_id": "..."}}): {exc}') from None
    except msgspec.DecodeError as exc:
        raise BadRequest(f"task query is not valid JSON: {exc}") from None
    if not query.task_id.strip():
        raise BadRequest("task_id must not be empty")
    return query


@dataclass
class Counters:
    """What the projection did, for the summary line at stop."""

    projected: int = 0
    duplicates: int = 0
    terminated: int = 0
    retried: int = 0


class StatsService:
    """Projects events into the store and answers ``coordinator.task``.

    The caller owns the NATS connection and the store; `stop` leaves both open.
    """

    def __init__(self, nc: Client, store: Store, settings: StatsSettings) -> None:
        self.nc = nc
        self.js: JetStreamContext = nc.jetstream()
        self.store = store
        self.settings = settings
        self.tasks = TaskSet()
        self.counters = Counters()
        self._stopping = asyncio.Event()
        self._sub: JetStreamContext.PullSubscription | None = None
        self._service: Service | None = None
        self._loop: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Set up streams and the consumer, start projecting, then serve the endpoint."""
        await ensure_streams(self.js)
        await self._ensure_consumer()
        self._sub = await self.js.pull_subscribe_bind(durable=CONSUMER, stream=EVENTS_STREAM)
        self._loop = asyncio.create_task(self._project(), name="stats-projection")
        self._service = await add_service(
            self.nc,
            name=SERVICE_NAME,
            version=__version__,
            description="task and figure queries from the stats read model",
        )
        await add_endpoint(self._service, "task", TASK, self.handle_task, self.tasks)
        log.info("stats ready", consumer=CONSUMER, subjects=[TASK])

    async def stop(self) -> None:
        """Stop fetching, finish the batch in hand, stop the endpoint; log one summary line."""
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
        if self._sub is not None:
            with suppress(Exception):
                await self._sub.unsubscribe()
        c = self.counters
        log.info(
            "stats stopped",
            projected=c.projected,
            duplicates=c.duplicates,
            terminated=c.terminated,
            retried=c.retried,
        )

    # -- projection --------------------------------------------------------------------------

    async def _ensure_consumer(self) -> None:
        """Create the durable consumer, or bring an existing one to this configuration."""
        await self.js.add_consumer(EVENTS_STREAM, consumer_config())

    async def _project(self) -> None:
        """Fetch and apply batches until stopped; trouble pauses the loop, never ends it."""
        assert self._sub is not None
        backoff_s = BACKOFF_FIRST_S
        while not self._stopping.is_set():
            try:
                msgs = await self._sub.fetch(self.settings.batch_size, timeout=FETCH_TIMEOUT_S)
            except (nats.errors.TimeoutError, TimeoutError):
                continue  # idle
            except Exception as exc:
                # Reconnecting, or the consumer was deleted under us: recreate it and go on.
                log.warning("fetching events failed", error=repr(exc))
                await self._pause(backoff_s)
                backoff_s = min(backoff_s * 2, BACKOFF_MAX_S)
                with suppress(Exception):
                    await self._ensure_consumer()
                continue
            if await self._apply_batch(msgs):
                backoff_s = BACKOFF_FIRST_S
            else:
                await self._pause(backoff_s)
                backoff_s = min(backoff_s * 2, BACKOFF_MAX_S)

    async def _apply_batch(self, msgs: list[Msg]) -> bool:
        """Apply ``msgs`` in order; False when PostgreSQL failed and the rest was nak'ed."""
        for index, msg in enumerate(msgs):
            try:
                await self._apply_one(msg)
            except Unavailable as exc:
                rest = msgs[index:]
                log.warning(
                    "database unavailable; events will be redelivered",
                    error=exc.message,
                    nak_count=len(rest),
                )
                self.counters.retried += len(rest)
                for pending in rest:
                    with suppress(Exception):
                        await pending.nak(delay=NAK_DELAY_S)
                return False
            except Exception:
                # A bug, not the database: set this one event aside for a while, go on.
                log.exception("projecting an event failed", stream_seq=_stream_seq(msg))
                self.counters.retried += 1
                with suppress(Exception):
                    await msg.nak(delay=BACKOFF_MAX_S)
        return True

    async def _apply_one(self, msg: Msg) -> None:
        """Decode, store and ack one message, with one log line saying what happened."""
        seq = msg.metadata.sequence.stream
        with structlog.contextvars.bound_contextvars(subject=msg.subject, stream_seq=seq):
            try:
                event = any_event_decoder.decode(msg.data)
            except msgspec.DecodeError as exc:
                log.error("undecodable event; terminated", error=str(exc))
                self.counters.terminated += 1
                await msg.term()
                return
            task_id = None if isinstance(event, WorkerRegistered | WorkerStopped) else event.task_id
            with structlog.contextvars.bound_contextvars(task_id=task_id):
                await self._store_and_ack(msg, seq, event)

    async def _store_and_ack(self, msg: Msg, seq: int, event: AnyEvent) -> None:
        try:
            applied = await self.store.apply(seq, event)
        except Unstorable as exc:
            log.error("event cannot be stored; terminated", error=exc.message)
            self.counters.terminated += 1
            await msg.term()
            return
        try:
            await msg.ack()
        except Exception as exc:
            # Committed already: a redelivery will be recognised and acked then.
            log.warning("ack failed after commit", error=repr(exc))
        if applied:
            self.counters.projected += 1
        else:
            self.counters.duplicates += 1
        log.info("event projected", kind=kind_of(event), duplicate=not applied)

    async def _pause(self, seconds: float) -> None:
        """Sleep ``seconds``, or less if a stop is requested."""
        with suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), timeout=seconds)

    # -- endpoint ----------------------------------------------------------------------------

    async def handle_task(self, body: bytes) -> bytes:
        """``coordinator.task``: the task as projected so far."""
        query = parse_task_query(body)
        view = await self.store.get_task(query.task_id)
        if view is None:
            raise NotFound(f"no task '{query.task_id}' (it may not be projected yet)")
        return encoder.encode(view)


def _stream_seq(msg: Msg) -> int | None:
    try:
        return msg.metadata.sequence.stream
    except Exception:
        return None


async def run(settings: StatsSettings, stop: asyncio.Event) -> None:
    """Run the stats service until ``stop`` is set, then close the bus and the pool."""
    store = await Store.connect(settings.pg_dsn)
    try:
        await store.apply_schema()
        nc = await connect(settings.nats_url, SERVICE_NAME)
        service = StatsService(nc, store, settings)
        try:
            await service.start()
            await stop.wait()
        finally:
            await service.stop()
            await nc.drain()
    finally:
        await store.close()
