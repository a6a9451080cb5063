"""The reaper service: keeps its view up to date, looks every ``REAPER_INTERVAL_S``, acts.

Its parts: ``feeds`` (the registry, the sleepers, the event log and consumer samples folded
into the view), ``detectors`` and ``decisions`` (pure: what is wrong, what to do about it),
``handling`` (carrying the decisions out, once per finding) and ``actions`` (the writes).

Any number may run; one acts (`services.runtime.leadership`: the ``reaper`` lease in the
``leaders`` bucket). A standby keeps its view up to date as the active one does, so that it
judges from a full view the moment it takes over, and answers ``coordinator.reaper.status``
(saying ``standby``, and who is active); it looks at nothing and writes nothing.

While the bus is away no heartbeat can arrive, so after a (re)connect no worker is judged not
live until the registry has settled (`services.fleet.settling`: read again, and the workers
live before heard from again, or a full ``WORKER_TTL_S`` passed): a nats-server restart does
not make every worker look dead.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from contextlib import suppress

import msgspec
import structlog
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.micro import add_service
from nats.micro.service import Service

from schemas.subjects import (
    ASLEEP_BUCKET,
    LEADERS_BUCKET,
    REAPER_ROLE,
    REAPER_SERVICE,
    REAPER_STATUS,
    STATS_BUCKET,
)
from services import __version__
from services.reaper.detectors import Snapshot, Thresholds, detect
from services.reaper.feeds import Feeds
from services.reaper.handling import FindingHandler
from services.reaper.settings import ReaperSettings
from services.reaper.view import ReaperView
from services.runtime.bus import (
    connect,
    ensure_bucket,
    ensure_streams,
    flush_written,
    started,
)
from services.runtime.endpoints import add_endpoint
from services.runtime.leadership import Leadership
from services.runtime.lifecycle import TaskSet, close_bus, stop_within

log = structlog.get_logger("reaper")

_encoder = msgspec.json.Encoder()


class Reaper:
    """Holds the view and acts on what the detectors find."""

    def __init__(self, nc: Client, settings: ReaperSettings) -> None:
        self.nc = nc
        self.js: JetStreamContext = nc.jetstream()
        self.settings = settings
        self.view = ReaperView()
        self.thresholds = Thresholds(
            dead_after_s=settings.worker_ttl_s,
            stuck_grace_s=settings.stuck_grace_s,
            ghost_after_s=settings.ghost_after_s,
            duplicate_samples=settings.duplicate_samples,
        )
        self.feeds = Feeds(nc, self.js, self.view, settings)
        self.handler = FindingHandler(nc, self.view, settings)
        self.tasks = TaskSet()
        self.leadership: Leadership | None = None
        self._service: Service | None = None

    async def start(self) -> None:
        """Read the registry and the recent event log, then be ready to look (once active)."""
        workers = await ensure_streams(self.js, worker_ttl_s=self.settings.worker_ttl_s)
        asleep = await ensure_bucket(self.js, ASLEEP_BUCKET, ttl_s=None)
        stats = await ensure_bucket(self.js, STATS_BUCKET, ttl_s=None)
        leaders = await ensure_bucket(self.js, LEADERS_BUCKET, ttl_s=self.settings.worker_ttl_s)
        self.leadership = Leadership(
            leaders,
            REAPER_ROLE,
            ttl_s=self.settings.worker_ttl_s,
            interval_s=self.settings.heartbeat_interval_s,
        )
        await self.feeds.start(workers, asleep, stats, self.tasks)
        # Answers PING (the router waits for retryable failures to move on only while it does)
        # and a status request, for people and `coordinator health`.
        self._service = await add_service(
            self.nc,
            name=REAPER_SERVICE,
            version=__version__,
            description="moves work off dead, stuck or silent workers",
        )
        await add_endpoint(self._service, "status", REAPER_STATUS, self.handle_status, self.tasks)
        await flush_written(self.nc)  # in place for every client before anyone is told
        log.info(
            "reaper ready",
            open_tasks=sum(1 for t in self.view.tasks.values() if t.open),
            workers=len(self.view.workers),
            interval_s=self.settings.reaper_interval_s,
            worker_ttl_s=self.settings.worker_ttl_s,
        )

    async def stop(self) -> None:
        """Stop answering and following; every step bounded, none raising."""
        if self._service is not None:
            await stop_within("reaper endpoints", self._service.stop())
        await self.feeds.stop()
        await self.tasks.wait(timeout_s=1.0)
        h = self.handler
        log.info("reaper stopped", moved=h.moved, failed=h.failed, duplicates=h.duplicates)

    async def run(self, stop: asyncio.Event) -> None:
        """Stand by, or look and act while this instance holds the reaper's lease, until
        ``stop``."""
        assert self.leadership is not None
        await self.leadership.run(
            lambda: self.look_until(stop), stop, stop_grace_s=self.settings.reaper_interval_s
        )

    async def look_until(self, stop: asyncio.Event) -> None:
        """Look every ``REAPER_INTERVAL_S`` until ``stop`` (or until cancelled: this instance
        no longer acts); a failed look is logged, not fatal."""
        while not stop.is_set():
            with suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=self.settings.reaper_interval_s)
            if stop.is_set():
                return
            try:
                await self.look()
            except Exception as exc:
                log.warning("look failed; trying again next time", error=repr(exc))

    async def handle_status(self, body: bytes) -> bytes:
        """``coordinator.reaper.status``: whether this instance acts (``role``: active or
        standby) and which instance does (``active``), what it sees, and what it has done
        since it started."""
        assert self.leadership is not None
        open_tasks = Counter(t.status for t in self.view.tasks.values() if t.open)
        holder = await self.leadership.holder()
        return _encoder.encode(
            {
                "role": self.leadership.state,
                "role_since": self.leadership.since,
                "instance": self.leadership.instance_id,
                "active": None
                if holder is None
                else {"instance": holder.instance_id, "host": holder.host, "pid": holder.pid},
                "open_tasks": dict(sorted(open_tasks.items())),
                "workers": sorted(self.view.workers),
                "moved": self.handler.moved,
                "failed": self.handler.failed,
                "duplicates": self.handler.duplicates,
                "settling": not self.feeds.settled(time.time()),
                "settling_since": self.feeds.registry.settling.state.since,
            }
        )

    async def look(self) -> None:
        """One round: sample the queues, detect, act."""
        now = time.time()
        if not self.nc.is_connected:
            return
        settling = not self.feeds.settled(now)
        self.view.prune(now)
        self.handler.forget_old(now)
        await self.feeds.sample(now)
        snapshot = Snapshot(
            now=now,
            tasks=self.view.tasks,
            workers=self.view.workers,
            asleep=self.view.asleep,
            consumers=self.view.consumers,
            instances=self.view.instances,
            settling=settling,
        )
        findings = detect(snapshot, self.thresholds)
        for duplicate in findings.duplicates:
            await self.handler.report(duplicate, now)
        await self.handler.act(findings.tasks, now, settling=settling)


async def run(settings: ReaperSettings, stop: asyncio.Event) -> None:
    """Run the reaper until ``stop`` is set."""
    nc = await connect(settings.nats_url, "coordinator-reaper", auth=settings.nats_auth())
    reaper: Reaper | None = None
    try:
        reaper = await started(lambda: Reaper(nc, settings), "the reaper's start")
        await reaper.run(stop)
    finally:
        if reaper is not None:
            await reaper.stop()
        await close_bus(nc)
