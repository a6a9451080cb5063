"""What feeds the dashboard and the metrics, from NATS: the ``workers`` bucket's watch, the
event log (``EVENTS``) through ordered consumers, and the read-only endpoints
(``coordinator.workers``, ``coordinator.stats`` and its exclusions and baselines,
``coordinator.reaper.status``), polled.

The bucket is followed as the router and the reaper follow it (`RegistryFeed`: the watch,
started again after a reconnect, and the stall check), so the dashboard judges liveness as
they do: after a reconnect the watch hands back each worker's record from before the outage,
whose heartbeat looks stale, so no worker shows ``lost`` until the view has settled
(`services.fleet.settling`; `Known.settled`).

The event log is read through JetStream, not a plain subscription on ``events.>``: only
what the stream stored is a fact (a claim the stream refused for a stale attempt, or a
publish it deduplicated, still reaches plain subscribers). One ordered consumer reads it from
``GATEWAY_EVENTS_LOOKBACK_S`` back, so the dashboard has recent history after a restart; the
metrics count only the events stored after the gateway's start (the stream's last sequence
then). Another reads the bench's events from the first, for its history. Both are named, so
their create requests carry their filter (the gateway's NATS user may create no other).

Every change marks the sections to build again; a builder encodes them at most four times a
second, and the `pulse` wakes the dashboard's streams when one changed.
"""

from __future__ import annotations

import asyncio
import datetime
import time
from collections.abc import Awaitable, Callable, Collection, Iterable
from contextlib import suppress
from typing import Any, Final

import msgspec
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig, DeliverPolicy

from schemas.events import any_event_decoder
from schemas.stats import (
    BaselinesQuery,
    BaselinesReply,
    ExclusionsQuery,
    ExclusionsReply,
    StatsQuery,
    StatsReply,
)
from schemas.subjects import (
    EVENTS_STREAM,
    EVENTS_SUBJECTS,
    REAPER_STATUS,
    STATS,
    STATS_BASELINES,
    STATS_CONSUMER,
    STATS_EXCLUSIONS,
    WORKERS,
    WORKERS_BUCKET,
)
from schemas.workers import WorkerRecord
from services.gateway.bench_history import BenchHistory
from services.gateway.board import Ended, TaskBoard
from services.gateway.bus import FleetBus
from services.gateway.common import ApiError, encoder
from services.gateway.dashboard_view import Known, forget_departed, gauges, sections
from services.gateway.metrics import FleetMetrics, Gauges
from services.gateway.settings import GatewaySettings
from services.runtime.aliases import consumer_name, rename_on_reset
from services.runtime.lifecycle import TaskSet
from services.runtime.registry import RegistryFeed

log = structlog.get_logger("gateway")

BENCH_EVENTS: Final = "events.bench.>"
# The endpoints' timeout here: a poll that waits longer only makes the page staler.
POLL_TIMEOUT_S: Final = 2.0
# Idle heartbeat of the ordered consumers: a consumer lost with its server is noticed in two.
EVENTS_HEARTBEAT_S: Final = 5.0
# An open task whose end was never read is forgotten after this (a day's timeout and more).
OPEN_FORGET_S: Final = 2 * 86400.0
# A read that failed is tried again this soon (a service that starts after the gateway).
RETRY_S: Final = 3.0
# The builder's pause after a change, so a burst of events makes one build.
COALESCE_S: Final = 0.25

_stats_decoder = msgspec.json.Decoder(StatsReply)
_exclusions_decoder = msgspec.json.Decoder(ExclusionsReply)
_baselines_decoder = msgspec.json.Decoder(BaselinesReply)
_status_decoder = msgspec.json.Decoder(dict[str, Any])
# How many times the reaper's status is asked for, to reach the active instance.
REAPER_TRIES = 4


class Pulse:
    """Wakes every waiter at once each time it fires."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def fire(self) -> None:
        self._event.set()
        self._event = asyncio.Event()

    async def wait(self, timeout_s: float) -> bool:
        """Whether it fired within ``timeout_s``."""
        event = self._event
        try:
            async with asyncio.timeout(timeout_s):
                await event.wait()
        except TimeoutError:
            return False
        return True


class KnownWorkers:
    """The dashboard's registry (`Known.records` and `Known.gone`) as `RegistryFeed` keeps a
    view (`services.runtime.registry.WorkersView`): a worker that leaves stays listed, gone
    since then, with its last record; ``changed`` is called on every change."""

    def __init__(self, known: Known, changed: Callable[[], None]) -> None:
        self.known = known
        self.changed = changed

    def put_worker(self, record: WorkerRecord) -> None:
        self.known.records[record.worker_id] = record
        self.known.gone.pop(record.worker_id, None)
        self.changed()

    def remove_worker(self, worker_id: str) -> None:
        if worker_id in self.known.records:
            self.known.gone[worker_id] = time.time()
        self.changed()

    def records(self) -> Iterable[WorkerRecord]:
        """The workers still in the registry (not gone)."""
        return [r for key, r in self.known.records.items() if key not in self.known.gone]


class Feed:
    """Keeps `known` (and the metrics) up to date, and the sections encoded."""

    def __init__(self, nc: Client, bus: FleetBus, settings: GatewaySettings) -> None:
        self.nc = nc
        self.js: JetStreamContext = nc.jetstream(timeout=POLL_TIMEOUT_S)
        self.bus = bus
        self.settings = settings
        self.known = Known(board=TaskBoard(supports=self._supports), bench=BenchHistory())
        self.metrics = FleetMetrics(self._gauges)
        self.registry = RegistryFeed(
            nc, KnownWorkers(self.known, self._mark_dirty), settings.worker_ttl_s, role="gateway"
        )
        # The sections as last built, and encoded (what every viewer but another key's gets).
        self.built: dict[str, Any] = {}
        self.encoded: dict[str, bytes] = {}
        self.versions: dict[str, int] = {}
        self.pulse = Pulse()
        self.closed = False
        self.start_seq = 0
        """The event log's last sequence when the gateway started: the metrics count later ones."""
        self._tasks = TaskSet()
        self._subs: list[Subscription] = []
        self._dirty = asyncio.Event()
        self._nudges = {name: asyncio.Event() for name in ("stats", "exclusions", "baselines")}

    def _mark_dirty(self) -> None:
        self._dirty.set()

    @property
    def ttl_s(self) -> float:
        return self.settings.worker_ttl_s

    def _supports(self, worker_id: str) -> Collection[str] | None:
        record = self.known.records.get(worker_id)
        return None if record is None else record.supports

    async def start(self) -> None:
        """Start following; returns at once (each source comes when it can, and says so on
        the page while it cannot)."""
        with suppress(Exception):
            self.start_seq = (await self.js.stream_info(EVENTS_STREAM)).state.last_seq
        self._tasks.spawn(self._follow_events(), name="dashboard-events")
        self._tasks.spawn(self._watch_workers(), name="dashboard-workers")
        # (source, longest pause, shortest pause after a nudge, read, nudged by)
        polls: list[tuple[str, float, float, Callable[[], Awaitable[None]], str | None]] = [
            (WORKERS, 1.0, 0.0, self._read_workers, None),
            (REAPER_STATUS, 2.0, 0.0, self._read_reaper, None),
            ("event log", 2.0, 0.0, self.read_log, None),
            # Figures cost the stats service a computation: at most one read in 5 s.
            (STATS, 30.0, 5.0, self._read_figures, "stats"),
            (STATS_EXCLUSIONS, 60.0, 1.0, self._read_exclusions, "exclusions"),
            (STATS_BASELINES, 300.0, 5.0, self._read_baselines, "baselines"),
        ]
        for name, period_s, min_s, read, nudge in polls:
            self._tasks.spawn(
                self._poll(name, read, period_s, min_s, self._nudges.get(nudge or "")),
                name=f"dashboard-{name}",
            )
        self._tasks.spawn(self._build(), name="dashboard-build")

    def close(self) -> None:
        """Release the dashboard's streams (before the HTTP server stops)."""
        self.closed = True
        self.pulse.fire()

    async def stop(self) -> None:
        self.close()
        for sub in self._subs:
            with suppress(Exception):
                await sub.unsubscribe()
        await self._tasks.wait(timeout_s=0.0)

    # -- the event log -------------------------------------------------------------------------

    async def _follow_events(self) -> None:
        """Both ordered consumers, tried again until the stream is there."""
        lookback = self.settings.gateway_events_lookback_s
        since = datetime.datetime.fromtimestamp(time.time() - lookback, tz=datetime.UTC)
        recent = (
            ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_TIME, opt_start_time=since)
            if lookback > 0
            else ConsumerConfig(
                deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=self.start_seq + 1
            )
        )
        for subject, config, on_msg in (
            (EVENTS_SUBJECTS, recent, self._on_event),
            (BENCH_EVENTS, ConsumerConfig(deliver_policy=DeliverPolicy.ALL), self._on_bench),
        ):
            while True:
                try:
                    self._subs.append(await self._subscribe(subject, config, on_msg))
                    break
                except Exception as exc:
                    log.warning("dashboard: event log not readable yet", error=repr(exc))
                    await asyncio.sleep(2.0)

    async def _subscribe(
        self, subject: str, config: ConsumerConfig, on_msg: Callable[[Msg], Awaitable[None]]
    ) -> Subscription:
        config.name = consumer_name("gateway")
        sub = await self.js.subscribe(
            subject,
            stream=EVENTS_STREAM,
            cb=on_msg,
            ordered_consumer=True,
            idle_heartbeat=EVENTS_HEARTBEAT_S,
            config=config,
        )
        rename_on_reset(sub, "gateway")
        return sub

    async def _on_event(self, msg: Msg) -> None:
        seq = msg.metadata.sequence.stream
        if seq <= self.known.projected_seq:
            return  # delivered again after the consumer was reset
        self.known.projected_seq = seq
        try:
            event = any_event_decoder.decode(msg.data)
        except msgspec.DecodeError:
            log.warning("dashboard: ignoring a malformed event", subject=msg.subject, seq=seq)
            return
        changes = self.known.board.apply(event, msg.subject)
        if any(isinstance(change, Ended) for change in changes):
            self._nudges["stats"].set()
        if seq > self.start_seq:
            self.metrics.read(msg.subject)
            for change in changes:
                self.metrics.count(change)
        if msg.subject.startswith("events.stats."):
            self._nudges["exclusions"].set()
            self._nudges["stats"].set()
        self._dirty.set()

    async def _on_bench(self, msg: Msg) -> None:
        try:
            event = any_event_decoder.decode(msg.data)
        except msgspec.DecodeError:
            return
        if self.known.bench.apply(event):
            self._nudges["baselines"].set()
            self._dirty.set()

    # -- the registry --------------------------------------------------------------------------

    async def _watch_workers(self) -> None:
        while True:
            try:
                kv = await self.js.key_value(WORKERS_BUCKET)
                break
            except Exception as exc:
                log.warning("dashboard: the workers bucket is not readable yet", error=repr(exc))
                await asyncio.sleep(2.0)
        self.registry.follow(self.js, kv, asyncio.Event(), self._tasks)

    def _settle(self, now: float) -> None:
        """Whether the view of the registry has settled at ``now``, for the sections and the
        gauges (a reconnect not noticed yet is noticed here)."""
        self.known.settled = self.registry.settled(now)

    def _gauges(self) -> Gauges:
        now = time.time()
        self._settle(now)
        return gauges(self.known, now, self.ttl_s)

    # -- the endpoints ---------------------------------------------------------------------------

    async def _poll(
        self,
        name: str,
        read: Callable[[], Awaitable[None]],
        period_s: float,
        min_s: float,
        nudge: asyncio.Event | None,
    ) -> None:
        """``read`` every ``period_s``, or on a ``nudge`` but not within ``min_s`` of the last;
        while it fails, the page says why (`Known.unavailable`) and it is tried again within
        `RETRY_S`."""
        nudge = nudge or asyncio.Event()
        while True:
            nudge.clear()  # a nudge from here on asks for the next read
            try:
                await read()
                self.known.unavailable.pop(name, None)
                pause_s = period_s
            except ApiError as exc:
                self.known.unavailable[name] = exc.message
                pause_s = min(period_s, RETRY_S)
            except Exception as exc:
                self.known.unavailable[name] = str(exc) or type(exc).__name__
                pause_s = min(period_s, RETRY_S)
            self._dirty.set()
            await asyncio.sleep(min(min_s, pause_s))
            with suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, pause_s - min_s)):
                    await nudge.wait()

    async def _call(self, subject: str, body: Any) -> bytes:
        return await self.bus.call(subject, encoder.encode(body), POLL_TIMEOUT_S)

    async def _read_workers(self) -> None:
        fleet = await self.bus.fleet()
        self.known.views = {w.worker_id: w for w in fleet.workers}
        self.known.aliases = fleet.aliases

    async def _read_reaper(self) -> None:
        """The active reaper's status: any instance may answer (one queue group), and a
        standby's counts are its own, so a standby's answer is asked again a few times."""
        self.known.reaper = None
        for _ in range(REAPER_TRIES):
            status = _status_decoder.decode(await self._call(REAPER_STATUS, {}))
            self.known.reaper = status
            if status.get("role") != "standby":
                return

    async def _read_figures(self) -> None:
        self.known.figures = _stats_decoder.decode(await self._call(STATS, StatsQuery())).figures

    async def _read_exclusions(self) -> None:
        reply = await self._call(STATS_EXCLUSIONS, ExclusionsQuery())
        self.known.exclusions = _exclusions_decoder.decode(reply).exclusions

    async def _read_baselines(self) -> None:
        models = self.known.bench.models()
        if models:
            reply = await self._call(STATS_BASELINES, BaselinesQuery(models=models))
            self.known.baselines = _baselines_decoder.decode(reply).baselines

    async def refresh(self) -> None:
        """Read what the gauges show afresh (a scrape): the router's listing and the log's
        state; what fails keeps its last value."""
        await asyncio.gather(self._read_workers(), self.read_log(), return_exceptions=True)

    async def read_log(self) -> None:
        """The event log's size and the stats projection's lag (a scrape reads them fresh)."""
        state = (await self.js.stream_info(EVENTS_STREAM)).state
        self.known.event_log = {
            "messages": state.messages,
            "bytes": state.bytes,
            "last_seq": state.last_seq,
        }
        try:
            info = await self.js.consumer_info(EVENTS_STREAM, STATS_CONSUMER)
        except Exception:
            self.known.stats_lag = None  # no stats service has made its consumer yet
        else:
            self.known.stats_lag = (info.num_pending or 0) + (info.num_ack_pending or 0)

    # -- the sections ----------------------------------------------------------------------------

    async def _build(self) -> None:
        """Encode the sections again on a change, and at least once a second (liveness and
        elapsed times move with the clock); fire `pulse` when one changed."""
        last_sample = 0
        while True:
            with suppress(TimeoutError):
                async with asyncio.timeout(1.0):
                    await self._dirty.wait()
            self._dirty.clear()
            now = time.time()
            self._settle(now)
            forget_departed(self.known, now, self.ttl_s)
            self.known.board.prune(now - OPEN_FORGET_S)
            changed = self.build(now)
            newest = self.known.board.samples[-1].index if self.known.board.samples else 0
            if changed or newest != last_sample:
                last_sample = newest
                self.pulse.fire()
            await asyncio.sleep(COALESCE_S)

    def build(self, now: float) -> bool:
        """Encode every section; whether any changed (its version goes up)."""
        changed = False
        self._settle(now)
        self.built = sections(self.known, now, self.ttl_s)
        for name, value in self.built.items():
            data = encoder.encode(value)
            if data != self.encoded.get(name):
                self.encoded[name] = data
                self.versions[name] = self.versions.get(name, 0) + 1
                changed = True
        return changed
