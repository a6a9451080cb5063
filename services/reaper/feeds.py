"""What keeps the reaper's view up to date (docs/design.md: the reaper never queries Postgres).

A KV watch of ``workers``, ``asleep`` and ``stats`` (the routing figures a moved task is
routed by), and an ordered consumer on ``EVENTS`` that starts ``REAPER_LOOKBACK_S`` back, so a
restarted reaper (``kill -9`` included) rebuilds what is under way from the log before it
judges anything. Each look also samples the consumer info of the
queues that hold open tasks and of every live worker's own consumer.

The registry's settling (`services.fleet.settling`, through the feed every judge of liveness
shares, `services.runtime.registry`) is kept here too: from a start until the
workers that hold open tasks have been heard from (at most ``WORKER_TTL_S``), and from a
reconnect until the bucket has been read again and the workers live before the outage have
heartbeated again (at most ``WORKER_TTL_S``), no worker is judged not live.
"""

from __future__ import annotations

import asyncio
import datetime
import time
from contextlib import suppress

import msgspec
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError
from nats.js.kv import KeyValue

from schemas.events import (
    TaskCompleted,
    TaskFailed,
    TaskRouted,
    TaskStarted,
    TaskSubmitted,
    WorkerRegistered,
    WorkerStopped,
    any_event_decoder,
)
from schemas.subjects import (
    EVENTS_STREAM,
    EVENTS_SUBJECTS,
    POOL_NAMES,
    TASKS_STREAM,
    queue_consumer,
    task_event_source,
    worker_consumer,
)
from services.fleet.figures import decode_figure
from services.fleet.liveness import is_live, live
from services.reaper.settings import ReaperSettings
from services.reaper.view import ConsumerSample, ReaperView
from services.runtime.lifecycle import TaskSet
from services.runtime.registry import RegistryFeed
from services.runtime.watch import RECONNECT_CHECK_S, follow_bucket, reconnects, value_of

log = structlog.get_logger("reaper")

# How long the start waits for the event log to be read back before looking anyway.
CATCH_UP_S = 60.0
# Idle heartbeat of the event log's ordered consumer: a lost consumer is noticed within two.
EVENTS_HEARTBEAT_S = 2.0


class Feeds:
    """Folds the registry, the sleepers, the event log and consumer samples into ``view``."""

    def __init__(
        self, nc: Client, js: JetStreamContext, view: ReaperView, settings: ReaperSettings
    ) -> None:
        self.nc = nc
        self.js = js
        self.view = view
        self.settings = settings
        self._last_seq = 0
        self._events_sub: JetStreamContext.PushSubscription | None = None
        self.registry = RegistryFeed(nc, view, settings.worker_ttl_s, role="reaper")

    async def start(
        self, workers: KeyValue, asleep: KeyValue, stats: KeyValue, tasks: TaskSet
    ) -> None:
        """Follow the buckets and the event log (in ``tasks``); return once they are read."""
        ready = [asyncio.Event(), asyncio.Event(), asyncio.Event()]
        self.registry.follow(self.js, workers, ready[0], tasks)
        tasks.spawn(follow_bucket(self.nc, asleep, self._on_asleep, ready[1]), name="watch-asleep")
        tasks.spawn(follow_bucket(self.nc, stats, self._on_figure, ready[2]), name="watch-stats")
        since = datetime.datetime.fromtimestamp(
            time.time() - self.settings.reaper_lookback_s, tz=datetime.UTC
        )
        self._events_sub = await self._follow_events(
            ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_TIME, opt_start_time=since)
        )
        tasks.spawn(self._refollow_events(), name="refollow-events")
        await asyncio.wait_for(asyncio.gather(*(r.wait() for r in ready)), timeout=10)
        await self._catch_up()
        self.registry.settling.wait_for(time.time(), self._holders_not_live(time.time()))

    def _holders_not_live(self, now: float) -> dict[str, float]:
        """The workers the event log says hold open tasks that the registry does not show
        live, each with the heartbeat it shows (-inf: none): a start waits for them."""
        awaited: dict[str, float] = {}
        for task in self.view.tasks.values():
            holder = task.holder
            if not task.open or holder is None or holder in POOL_NAMES:
                continue
            record = self.view.workers.get(holder)
            if record is None:
                awaited[holder] = float("-inf")
            elif not is_live(record, now, self.settings.worker_ttl_s):
                awaited[holder] = record.heartbeat_at
        return awaited

    def settled(self, now: float) -> bool:
        """May a worker be judged not live at ``now`` (`services.fleet.settling`)?"""
        return self.registry.settled(now)

    async def stop(self) -> None:
        """Stop following the event log (the bucket watches end with their tasks)."""
        if self._events_sub is not None:
            with suppress(Exception):
                await self._events_sub.unsubscribe()

    async def _catch_up(self) -> None:
        """Wait until every event up to now has been folded into the view."""
        assert self._events_sub is not None
        deadline = time.monotonic() + CATCH_UP_S
        while time.monotonic() < deadline:
            try:
                info = await self._events_sub.consumer_info()
            except Exception as exc:
                log.warning("reading the event log back: no consumer info yet", error=repr(exc))
            else:
                delivered = info.delivered.stream_seq if info.delivered else 0
                if not info.num_pending and self._last_seq >= delivered:
                    return
            await asyncio.sleep(0.05)
        log.warning("the event log was not read back in time; looking anyway", after_s=CATCH_UP_S)

    async def _follow_events(self, config: ConsumerConfig) -> JetStreamContext.PushSubscription:
        """An ordered consumer on ``EVENTS`` feeding `_on_event`."""
        return await self.js.subscribe(
            EVENTS_SUBJECTS,
            stream=EVENTS_STREAM,
            cb=self._on_event,
            ordered_consumer=True,
            idle_heartbeat=EVENTS_HEARTBEAT_S,
            config=config,
        )

    async def _refollow_events(self) -> None:
        """After a reconnect, follow the event log again from the last event seen: the server
        may have restarted and dropped the ordered consumer, which the client would notice
        only after missing two idle heartbeats. A replayed event changes nothing (fencing)."""
        seen = reconnects(self.nc)
        while True:
            await asyncio.sleep(RECONNECT_CHECK_S)
            if reconnects(self.nc) == seen or not self.nc.is_connected:
                continue
            try:
                fresh = await self._follow_events(
                    ConsumerConfig(
                        deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
                        opt_start_seq=self._last_seq + 1,
                    )
                )
            except Exception as exc:
                log.warning("following the event log again failed; retrying", error=repr(exc))
                continue
            seen = reconnects(self.nc)
            stale, self._events_sub = self._events_sub, fresh
            if stale is not None:
                with suppress(Exception):
                    await stale.unsubscribe()
            log.info("following the event log again after a reconnect", from_seq=self._last_seq + 1)

    def _on_figure(self, entry: KeyValue.Entry) -> None:
        """A figure was published; a deleted one leaves the last value in place."""
        if (data := value_of(entry)) is not None:
            self.view.figures.put(*decode_figure(data))

    def _on_asleep(self, entry: KeyValue.Entry) -> None:
        if value_of(entry) is None:
            self.view.asleep.discard(entry.key)
        else:
            self.view.asleep.add(entry.key)

    async def _on_event(self, msg: Msg) -> None:
        self._last_seq = max(self._last_seq, msg.metadata.sequence.stream)
        try:
            event = any_event_decoder.decode(msg.data)
        except msgspec.DecodeError:
            return
        match event:
            case TaskSubmitted() | TaskRouted() | TaskStarted() | TaskCompleted() | TaskFailed():
                problem = self.view.apply(event, task_event_source(msg.subject))
                if problem is not None:
                    log.warning("task event refused", task_id=event.task_id, problem=problem)
            case WorkerRegistered():
                self.view.seen(event.worker_id, event.instance_id, event.host, event.at)
            case WorkerStopped():
                self.view.stopped(event.worker_id, event.instance_id)
            case _:
                pass  # not the reaper's business

    async def sample(self, now: float) -> None:
        """Consumer info of every queue holding an open task and of every live worker."""
        names = {
            queue_consumer(t.queue)
            for t in self.view.tasks.values()
            if t.status == "queued" and t.queue is not None
        }
        alive = live(self.view.workers.values(), now, self.settings.worker_ttl_s)
        names.update(worker_consumer(w.worker_id) for w in alive)
        samples = await asyncio.gather(*(self._consumer(name) for name in sorted(names)))
        for name, (ok, sample) in zip(sorted(names), samples, strict=True):
            if ok:
                self.view.observe(name, sample, now)

    async def _consumer(self, name: str) -> tuple[bool, ConsumerSample | None]:
        """(True, sample), (True, None) when it does not exist, (False, None) when unknown."""
        try:
            info = await self.js.consumer_info(TASKS_STREAM, name)
        except NotFoundError:
            return True, None
        except Exception as exc:
            log.warning("consumer info failed", consumer=name, error=repr(exc))
            return False, None
        return True, ConsumerSample(
            num_pending=info.num_pending or 0,
            num_ack_pending=info.num_ack_pending or 0,
            num_waiting=info.num_waiting or 0,
            delivered_seq=info.delivered.stream_seq if info.delivered else 0,
            ack_floor_seq=info.ack_floor.stream_seq if info.ack_floor else 0,
            ack_wait_s=info.config.ack_wait or 30.0,
        )
