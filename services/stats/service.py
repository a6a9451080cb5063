"""The stats service: a durable consumer projecting ``EVENTS`` into PostgreSQL, the routing
figures in the KV bucket ``stats``, and the query and operator endpoints.

Delivery is at least once and the store applies each stream position once, so the rule is
simple: ack only after the batch's transaction has committed. When PostgreSQL is away the
batch is nak'ed with a delay and fetching pauses with a growing backoff; nothing is acked that
was not stored. A message that is not a known event is terminated (logged), so it never blocks
the stream; an event PostgreSQL can never store is found by applying the batch one event at a
time, and terminated.

Endpoints (bodies in ``schemas/stats.py``): ``coordinator.task``, ``coordinator.stats``,
``coordinator.stats.exclude`` / ``.include`` / ``.exclusions``, ``coordinator.stats.alias.add``
/ ``.alias.remove``, ``coordinator.stats.aliases``, ``coordinator.stats.rebuild`` and
``coordinator.stats.baselines``. Operator decisions (exclusions, aliases) are published as
events and the reply comes once they are projected, so a ``coordinator stats`` right after
shows their effect.

The figures of the keys each batch touched are recomputed, and go to the KV bucket, at most
once a second per key (`PUBLISH_INTERVAL_S`), and before a ``coordinator.stats`` answer; at
start every figure is recomputed, and at start and after a rebuild the whole bucket is brought
in line with the ``figures`` table (stale keys deleted).
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from collections.abc import Awaitable, Callable
from contextlib import AbstractContextManager, suppress
from dataclasses import dataclass
from typing import Final, TypeVar

import msgspec
import nats.errors
import nats.js.errors
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.kv import KeyValue
from nats.micro import add_service
from nats.micro.service import Service
from opentelemetry import trace

from schemas.events import (
    AliasRemoved,
    AliasSet,
    AnyEvent,
    ExclusionAdded,
    ExclusionWithdrawn,
    any_event_decoder,
    encoder,
    kind_of,
)
from schemas.queries import TaskQuery
from schemas.stats import (
    AliasesReply,
    AliasRemoveRequest,
    AliasRequest,
    AliasView,
    Baseline,
    BaselinesQuery,
    BaselinesReply,
    ExcludeRequest,
    ExclusionsQuery,
    ExclusionsReply,
    ExclusionView,
    IncludeRequest,
    RebuildReply,
    RebuildRequest,
    StatsQuery,
    StatsReply,
)
from schemas.subjects import (
    ALIAS_ADD,
    ALIAS_REMOVE,
    ALIASES,
    EVENTS_STREAM,
    EVENTS_SUBJECTS,
    STATS,
    STATS_BASELINES,
    STATS_BUCKET,
    STATS_CONSUMER,
    STATS_EXCLUDE,
    STATS_EXCLUSIONS,
    STATS_INCLUDE,
    STATS_REBUILD,
    TASK,
    InvalidId,
    check_token,
)
from services import __version__
from services.fleet.aliases import check_alias
from services.runtime.bus import connect, ensure_bucket, ensure_streams, publish_event
from services.runtime.endpoints import add_endpoint
from services.runtime.errors import BadRequest, CoordinatorError, NotFound, Unavailable
from services.runtime.lifecycle import TaskSet
from services.runtime.settings import StatsSettings
from services.runtime.tracing import extract_context, spans_recorded
from services.stats.figures import kv_key, routing_figure
from services.stats.projector import FigureKey
from services.stats.rebuild import RebuildBusy, rebuild
from services.stats.store import Store, Unstorable

log = structlog.get_logger("stats")
tracer = trace.get_tracer("coordinator.stats")

SERVICE_NAME: Final = "coordinator-stats"

# An idle fetch returns after this long, which bounds how late a stop is noticed.
FETCH_TIMEOUT_S: Final = 1.0
# After a batch that did not fill up, events are left to gather this long before the next
# fetch: under load a batch then holds several tasks' events (one transaction, one pull)
# instead of one or two. An idle stream still gets its next event projected at once.
GATHER_S: Final = 0.02
# Redelivery delay for events not stored because PostgreSQL was away.
NAK_DELAY_S: Final = 1.0
# Pauses between attempts while PostgreSQL (or the bus) is away: 1, 2, 4, 5, 5… seconds.
BACKOFF_FIRST_S: Final = 1.0
BACKOFF_MAX_S: Final = 5.0
# How long a stop waits for the batch in hand before cancelling it.
STOP_GRACE_S: Final = 30.0
# Routing figures of one key go to the KV bucket at most this often.
PUBLISH_INTERVAL_S: Final = 1.0
# How long an operator request waits for its event to be projected before replying anyway.
PROJECTED_WAIT_S: Final = 5.0

W = TypeVar("W", bound=msgspec.Struct)
T = TypeVar("T")


class Conflict(CoordinatorError):
    code = "conflict"


def consumer_config(*, max_ack_pending: int = 1000, ack_wait_s: float = 30.0) -> ConsumerConfig:
    """The durable ``stats`` consumer: every event from the start, acked one by one."""
    return ConsumerConfig(
        durable_name=STATS_CONSUMER,
        description="stats projection into PostgreSQL",
        filter_subject=EVENTS_SUBJECTS,
        deliver_policy=DeliverPolicy.ALL,
        ack_policy=AckPolicy.EXPLICIT,
        ack_wait=ack_wait_s,
        max_ack_pending=max_ack_pending,
    )


def decode_request(body: bytes, kind: type[W], what: str) -> W:
    """Decode a request body (empty means ``{}``); every refusal is a `BadRequest`."""
    try:
        return msgspec.json.decode(body or b"{}", type=kind)
    except msgspec.ValidationError as exc:
        raise BadRequest(f"invalid {what}: {exc}") from None
    except msgspec.DecodeError as exc:
        raise BadRequest(f"{what} is not valid JSON: {exc}") from None


def parse_task_query(body: bytes) -> TaskQuery:
    """Decode a ``coordinator.task`` request; every refusal is a `BadRequest`."""
    try:
        query = msgspec.json.decode(body, type=TaskQuery)
    except msgspec.ValidationError as exc:
        raise BadRequest(f'invalid task query (expected {{"task_id": "..."}}): {exc}') from None
    except msgspec.DecodeError as exc:
        raise BadRequest(f"task query is not valid JSON: {exc}") from None
    if not query.task_id.strip():
        raise BadRequest("task_id must not be empty")
    return query


def check_exclusion(request: ExcludeRequest) -> None:
    """Raise `BadRequest` unless ``request`` describes a usable exclusion."""
    try:
        check_token("worker", request.worker)
    except InvalidId as exc:
        raise BadRequest(str(exc)) from None
    if request.model is not None and not request.model.strip():
        raise BadRequest("model must not be empty (leave it out to exclude every model)")
    if not math.isfinite(request.since):
        raise BadRequest("since must be a time (epoch seconds)")
    if request.until is not None and not (
        math.isfinite(request.until) and request.until > request.since
    ):
        raise BadRequest("until must be later than since")
    if not request.reason.strip():
        raise BadRequest("give a reason: it is what the next operator will read")


def new_id(prefix: str) -> str:
    """Time-ordered, unique and safe as a subject token and a message id."""
    return f"{prefix}-{time.time_ns():x}-{uuid.uuid4().hex[:8]}"


@dataclass
class Counters:
    """What the projection did, for the summary line at stop."""

    projected: int = 0
    duplicates: int = 0
    terminated: int = 0
    retried: int = 0


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
        self.counters = Counters()
        self._stopping = asyncio.Event()
        self._sub: JetStreamContext.PullSubscription | None = None
        self._service: Service | None = None
        self._loop: asyncio.Task[None] | None = None
        self._publisher: asyncio.Task[None] | None = None
        self._kv: KeyValue | None = None
        # Held while a batch is applied; a rebuild holds it from its catch-up to the swap.
        self._batch_lock = asyncio.Lock()
        self._rebuilding = False
        # Keys whose figure rows are behind their facts, and keys to put to KV. Batches do not
        # write figure rows, so a refresh runs beside them, one refresh at a time.
        self._stale: set[FigureKey] = set()
        self._refresh_lock = asyncio.Lock()
        self._dirty: set[FigureKey] = set()
        self._full_sync = True
        self._publish_now = asyncio.Event()
        self._batch_started_ns = 0

    async def start(self) -> None:
        """Set up streams, consumer and bucket, start projecting, then serve the endpoints."""
        await ensure_streams(self.js)
        self._kv = await ensure_bucket(self.js, STATS_BUCKET, ttl_s=None)
        await self._ensure_consumer()
        # A stop (or crash) can leave figures behind their facts: bring them all in line.
        await self.store.refresh_figures()
        self._sub = await self.js.pull_subscribe_bind(durable=STATS_CONSUMER, stream=EVENTS_STREAM)
        self._loop = asyncio.create_task(self._project(), name="stats-projection")
        self._publisher = asyncio.create_task(self._publish_figures(), name="stats-figures")
        self._service = await add_service(
            self.nc,
            name=SERVICE_NAME,
            version=__version__,
            description="task and figure queries from the stats read model",
        )
        endpoints: list[tuple[str, str, Callable[[bytes], Awaitable[bytes]]]] = [
            ("task", TASK, self.handle_task),
            ("stats", STATS, self.handle_stats),
            ("exclude", STATS_EXCLUDE, self.handle_exclude),
            ("include", STATS_INCLUDE, self.handle_include),
            ("exclusions", STATS_EXCLUSIONS, self.handle_exclusions),
            ("alias-add", ALIAS_ADD, self.handle_alias_add),
            ("alias-remove", ALIAS_REMOVE, self.handle_alias_remove),
            ("aliases", ALIASES, self.handle_aliases),
            ("rebuild", STATS_REBUILD, self.handle_rebuild),
            ("baselines", STATS_BASELINES, self.handle_baselines),
        ]
        for name, subject, handler in endpoints:
            await add_endpoint(self._service, name, subject, handler, self.tasks)
        log.info("stats ready", consumer=STATS_CONSUMER, subjects=[s for _, s, _ in endpoints])
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
            self._publish_now.set()
            with suppress(Exception):
                await asyncio.wait_for(self._publisher, timeout=5.0)
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
            async with self._batch_lock:
                stored = await self._apply_batch(msgs)
            if stored:
                backoff_s = BACKOFF_FIRST_S
                if len(msgs) < self.settings.batch_size:
                    await self._pause(GATHER_S)
            else:
                await self._pause(backoff_s)
                backoff_s = min(backoff_s * 2, BACKOFF_MAX_S)

    async def _apply_batch(self, msgs: list[Msg]) -> bool:
        """Apply ``msgs`` in one transaction; False when PostgreSQL failed (all nak'ed)."""
        self._batch_started_ns = time.time_ns()
        decoded: list[tuple[Msg, int, AnyEvent]] = []
        for msg in msgs:
            seq = msg.metadata.sequence.stream
            try:
                decoded.append((msg, seq, any_event_decoder.decode(msg.data)))
            except msgspec.DecodeError as exc:
                with structlog.contextvars.bound_contextvars(subject=msg.subject, stream_seq=seq):
                    log.error("undecodable event; terminated", error=str(exc))
                self.counters.terminated += 1
                with suppress(Exception):
                    await msg.term()
        if not decoded:
            return True
        try:
            projected = await self.store.apply_batch([(seq, event) for _, seq, event in decoded])
        except Unavailable as exc:
            log.warning(
                "database unavailable; events will be redelivered",
                error=exc.message,
                nak_count=len(decoded),
            )
            self.counters.retried += len(decoded)
            for msg, _, _ in decoded:
                with suppress(Exception):
                    await msg.nak(delay=NAK_DELAY_S)
            return False
        except Exception as exc:
            # One event PostgreSQL cannot store, or a bug: find it by going one by one.
            log.warning("batch not applied; applying its events one by one", error=repr(exc))
            return await self._apply_each(decoded)
        for msg, seq, event in decoded:
            await self._ack(msg, seq, event, applied=seq in projected.fresh)
        self._note_touched(projected.touched)
        log.info(
            "batch projected",
            events=len(decoded),
            fresh=len(projected.fresh),
            first_seq=decoded[0][1],
            last_seq=decoded[-1][1],
        )
        return True

    async def _apply_each(self, decoded: list[tuple[Msg, int, AnyEvent]]) -> bool:
        for index, (msg, seq, event) in enumerate(decoded):
            with _bound(msg, seq, event):
                try:
                    projected = await self.store.apply_batch([(seq, event)])
                except Unstorable as exc:
                    log.error("event cannot be stored; terminated", error=exc.message)
                    self.counters.terminated += 1
                    with suppress(Exception):
                        await msg.term()
                    continue
                except Unavailable as exc:
                    rest = decoded[index:]
                    log.warning(
                        "database unavailable; events will be redelivered",
                        error=exc.message,
                        nak_count=len(rest),
                    )
                    self.counters.retried += len(rest)
                    for pending, _, _ in rest:
                        with suppress(Exception):
                            await pending.nak(delay=NAK_DELAY_S)
                    return False
                except Exception:
                    # A bug, not the database: set this one event aside for a while, go on.
                    log.exception("projecting an event failed")
                    self.counters.retried += 1
                    with suppress(Exception):
                        await msg.nak(delay=BACKOFF_MAX_S)
                    continue
            await self._ack(msg, seq, event, applied=bool(projected.applied))
            self._note_touched(projected.touched)
        return True

    async def _ack(self, msg: Msg, seq: int, event: AnyEvent, *, applied: bool) -> None:
        """Ack a committed event, with its one (debug) log line, in a ``project event`` span
        that continues the trace the event carries (from the batch's start to its ack); no span
        when spans are not recorded (nothing exports them): this runs for every event."""
        if not spans_recorded():
            await self._ack_one(msg, seq, event, applied=applied)
            return
        with tracer.start_as_current_span(
            "project event",
            context=extract_context(msg.headers),
            start_time=self._batch_started_ns,
            kind=trace.SpanKind.CONSUMER,
            attributes={"messaging.destination.name": msg.subject, "stream_seq": seq},
        ):
            await self._ack_one(msg, seq, event, applied=applied)

    async def _ack_one(self, msg: Msg, seq: int, event: AnyEvent, *, applied: bool) -> None:
        try:
            await msg.ack()
        except Exception as exc:
            # Committed already: a redelivery will be recognised and acked then.
            with _bound(msg, seq, event):
                log.warning("ack failed after commit", error=repr(exc))
        if applied:
            self.counters.projected += 1
        else:
            self.counters.duplicates += 1
        log.debug(
            "event projected",
            kind=kind_of(event),
            duplicate=not applied,
            subject=msg.subject,
            stream_seq=seq,
            task_id=getattr(event, "task_id", None),
        )

    async def _pause(self, seconds: float) -> None:
        """Sleep ``seconds``, or less if a stop is requested."""
        with suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), timeout=seconds)

    # -- routing figures in KV ---------------------------------------------------------------

    def _note_touched(self, keys: set[FigureKey]) -> None:
        self._stale.update(keys)

    async def _refresh_stale(self) -> None:
        """Recompute the figure rows the batches since the last time touched (then to KV)."""
        async with self._refresh_lock:
            keys, self._stale = self._stale, set()
            if not keys:
                return
            try:
                await self.store.refresh_figures(keys)
            except BaseException:
                self._stale |= keys
                raise
        self._dirty |= keys

    async def _publish_figures(self) -> None:
        """Every `PUBLISH_INTERVAL_S`, put the figures of the keys touched since to KV."""
        while True:
            with suppress(TimeoutError):
                await asyncio.wait_for(self._publish_now.wait(), timeout=PUBLISH_INTERVAL_S)
            self._publish_now.clear()
            await self.publish_figures()
            if self._stopping.is_set():
                return

    async def publish_figures(self) -> None:
        """Put the dirty keys' figures (all of them after start or a rebuild) to KV now."""
        assert self._kv is not None
        try:
            await self._refresh_stale()
        except Exception as exc:
            log.warning("refreshing figures failed; will retry", error=repr(exc))
        full, self._full_sync = self._full_sync, False
        keys, self._dirty = self._dirty, set()
        if not full and not keys:
            return
        try:
            views = await self.store.figures() if full else await self.store.figures_for(keys)
            now = time.time()
            written: set[str] = set()
            for view in views:
                if not view.worker:
                    continue  # a failure no worker took: nothing to route by
                key = kv_key(view.model, view.domain, view.worker)
                await self._kv.put(key, encoder.encode(routing_figure(view, now)))
                written.add(key)
            if full:
                try:
                    stale = set(await self._kv.keys()) - written
                except nats.js.errors.NoKeysError:
                    stale = set()
            else:
                stale = {kv_key(*key) for key in keys if key[2]} - written
            for key in stale:
                await self._kv.delete(key)
            log.debug("routing figures published", put=len(written), deleted=len(stale))
        except Exception as exc:
            log.warning("publishing routing figures failed; will retry", error=repr(exc))
            self._dirty |= keys
            self._full_sync = self._full_sync or full

    # -- endpoints ---------------------------------------------------------------------------

    async def handle_task(self, body: bytes) -> bytes:
        """``coordinator.task``: the task as projected so far."""
        query = parse_task_query(body)
        view = await self.store.get_task(query.task_id)
        if view is None:
            raise NotFound(f"no task '{query.task_id}' (it may not be projected yet)")
        return encoder.encode(view)

    async def handle_stats(self, body: bytes) -> bytes:
        """``coordinator.stats``: the figures, exclusions left out, aliases applied."""
        query = decode_request(body, StatsQuery, "stats query")
        await self._refresh_stale()  # what is projected shows, not what was a second ago
        figures = await self.store.figures(query)
        active = len(await self.store.exclusions())
        return encoder.encode(StatsReply(figures=figures, active_exclusions=active))

    async def handle_exclude(self, body: bytes) -> bytes:
        """``coordinator.stats.exclude``: record an exclusion (an event), reply with it."""
        request = decode_request(body, ExcludeRequest, "exclusion")
        check_exclusion(request)
        event = ExclusionAdded(
            at=time.time(),
            exclusion_id=new_id("x"),
            worker=request.worker,
            model=request.model,
            since=request.since,
            until=request.until,
            reason=request.reason.strip(),
        )
        await self._publish(event, msg_id=event.exclusion_id)

        async def projected() -> ExclusionView | None:
            return await self.store.exclusion(event.exclusion_id)

        view = await self._when_projected(projected)
        return encoder.encode(
            view
            or ExclusionView(
                exclusion_id=event.exclusion_id,
                worker=event.worker,
                model=event.model,
                since=event.since,
                until=event.until,
                reason=event.reason,
                added_at=event.at,
            )
        )

    async def handle_include(self, body: bytes) -> bytes:
        """``coordinator.stats.include``: withdraw an exclusion (an event)."""
        request = decode_request(body, IncludeRequest, "include request")
        existing = await self.store.exclusion(request.exclusion_id)
        if existing is None:
            raise NotFound(f"no exclusion '{request.exclusion_id}'")
        if existing.withdrawn_at is not None:
            raise Conflict(f"exclusion '{request.exclusion_id}' is already withdrawn")
        event = ExclusionWithdrawn(
            at=time.time(), exclusion_id=request.exclusion_id, reason=request.reason
        )
        await self._publish(event, msg_id=f"{request.exclusion_id}:withdrawn")

        async def projected() -> ExclusionView | None:
            view = await self.store.exclusion(request.exclusion_id)
            return view if view is not None and view.withdrawn_at is not None else None

        view = await self._when_projected(projected)
        return encoder.encode(view or existing)

    async def handle_exclusions(self, body: bytes) -> bytes:
        """``coordinator.stats.exclusions``: active exclusions (all with ``withdrawn``)."""
        query = decode_request(body, ExclusionsQuery, "exclusions query")
        exclusions = await self.store.exclusions(withdrawn=query.withdrawn)
        return encoder.encode(ExclusionsReply(exclusions=exclusions))

    async def handle_alias_add(self, body: bytes) -> bytes:
        """``coordinator.stats.alias.add``: one statistics key for two names (an event)."""
        request = decode_request(body, AliasRequest, "alias request")
        alias, canonical = request.alias.strip(), request.canonical.strip()
        check_alias(await self.store.alias_map(), alias, canonical)
        await self._publish(AliasSet(at=time.time(), alias=alias, canonical=canonical))

        async def projected() -> AliasView | None:
            views = {view.alias: view for view in await self.store.aliases()}
            return views.get(alias)

        view = await self._when_projected(projected)
        return encoder.encode(
            view or AliasView(alias=alias, canonical=canonical, set_at=time.time())
        )

    async def handle_alias_remove(self, body: bytes) -> bytes:
        """``coordinator.stats.alias.remove``: the name keys its own statistics again."""
        request = decode_request(body, AliasRemoveRequest, "alias request")
        views = {view.alias: view for view in await self.store.aliases()}
        existing = views.get(request.alias)
        if existing is None:
            raise NotFound(f"'{request.alias}' is not an alias")
        await self._publish(AliasRemoved(at=time.time(), alias=request.alias))

        async def projected() -> bool | None:
            return True if request.alias not in await self.store.alias_map() else None

        await self._when_projected(projected)
        return encoder.encode(existing)

    async def handle_aliases(self, body: bytes) -> bytes:
        """``coordinator.stats.aliases``: every alias and where it leads."""
        return encoder.encode(AliasesReply(aliases=await self.store.aliases()))

    async def handle_rebuild(self, body: bytes) -> bytes:
        """``coordinator.stats.rebuild``: replay the log into fresh tables, swap them in."""
        decode_request(body, RebuildRequest, "rebuild request")
        if self._rebuilding:
            raise RebuildBusy("a rebuild is already running; wait for it to finish")
        self._rebuilding = True
        try:
            result = await rebuild(self.js, self.store.dsn, pause=self._batch_lock)
        finally:
            self._rebuilding = False
        self._full_sync = True
        self._publish_now.set()
        return encoder.encode(
            RebuildReply(
                events=result.events,
                last_seq=result.last_seq,
                seconds=result.seconds,
                events_per_s=result.events_per_s,
                figures=result.figures,
            )
        )

    async def handle_baselines(self, body: bytes) -> bytes:
        """``coordinator.stats.baselines``: each worker's earlier clean bench results."""
        query = decode_request(body, BaselinesQuery, "baselines query")
        baselines = [
            Baseline(model=model, worker=worker, prompt_key=key, median_ms=median, runs=runs)
            for model in query.models
            for worker, key, median, runs in await self.store.baselines(
                model, exclude_run=query.exclude_run
            )
        ]
        return encoder.encode(BaselinesReply(baselines=baselines))

    async def _publish(self, event: AnyEvent, msg_id: str | None = None) -> None:
        try:
            await publish_event(self.js, event, msg_id=msg_id)
        except Exception as exc:
            raise Unavailable(f"could not record the {kind_of(event)} event: {exc!r}") from exc

    async def _when_projected(self, probe: Callable[[], Awaitable[T | None]]) -> T | None:
        """``probe()`` once it returns something, or None after `PROJECTED_WAIT_S`."""
        deadline = time.monotonic() + PROJECTED_WAIT_S
        while time.monotonic() < deadline:
            result = await probe()
            if result is not None:
                return result
            await asyncio.sleep(0.05)
        log.warning("operator event not projected in time; replying anyway")
        return None


def _bound(msg: Msg, seq: int, event: AnyEvent) -> AbstractContextManager[None]:
    """The log context of one message: subject, stream position, task id when it has one."""
    return structlog.contextvars.bound_contextvars(
        subject=msg.subject, stream_seq=seq, task_id=getattr(event, "task_id", None)
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
