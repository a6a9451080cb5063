"""The reaper service: keeps its view up to date, looks every ``REAPER_INTERVAL_S``, acts.

Feeds (DESIGN: the reaper never queries Postgres): a KV watch of ``workers`` and ``asleep``,
and an ordered consumer on ``EVENTS`` that starts ``REAPER_LOOKBACK_S`` back, so a restarted
reaper (``kill -9`` included) rebuilds what is under way from the log before it judges
anything. Each look also reads the consumer info of the queues that hold open tasks and of
every live worker's own consumer.

While the bus is away no heartbeat can arrive, so after a (re)connect liveness is judged only
once a full ``WORKER_TTL_S`` has passed: a nats-server restart does not make every worker look
dead. Each action is keyed by (task, attempt) and not repeated for `ACT_RETRY_S`, the time
its own events take to come back; if they never do (the write failed), it is tried again.
"""

from __future__ import annotations

import asyncio
import datetime
import time
from collections import Counter
from collections.abc import Awaitable, Iterable
from contextlib import suppress

import msgspec
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError
from nats.js.kv import KeyValue
from nats.micro import add_service
from nats.micro.service import Service

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
    ASLEEP_BUCKET,
    EVENTS_STREAM,
    EVENTS_SUBJECTS,
    REAPER_SERVICE,
    REAPER_STATUS,
    TASKS_STREAM,
    queue_consumer,
    worker_consumer,
)
from schemas.workers import worker_record_decoder
from services import __version__
from services.fleet.liveness import live
from services.reaper.actions import Actions, QueueIndex, SubmissionLost, copies_up_to, queue_index
from services.reaper.decisions import Fail, Move, decide
from services.reaper.detectors import (
    DuplicateFinding,
    Snapshot,
    TaskFinding,
    Thresholds,
    detect,
)
from services.reaper.view import ConsumerSample, ReaperView, TaskTrack
from services.runtime.bus import connect, ensure_bucket, ensure_streams
from services.runtime.endpoints import add_endpoint
from services.runtime.lifecycle import TaskSet
from services.runtime.outcomes import current_attempt, stored_outcome
from services.runtime.settings import ReaperSettings
from services.runtime.watch import RECONNECT_CHECK_S, follow_bucket, reconnects

log = structlog.get_logger("reaper")

_encoder = msgspec.json.Encoder()

# How long an action's own events get to come back before it is tried again.
ACT_RETRY_S = 15.0
# A duplicate that persists is reported again this often (event and error log).
DUPLICATE_REPEAT_S = 30.0
# Actions carried out at once (each is a handful of round trips to the server).
PARALLEL_ACTIONS = 8
# How long the start waits for the event log to be read back before looking anyway.
CATCH_UP_S = 60.0
# Idle heartbeat of the event log's ordered consumer: a lost consumer is noticed within two.
EVENTS_HEARTBEAT_S = 2.0


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
        self.actions = Actions(self.js)
        self.tasks = TaskSet()
        self.judging_since = time.time()
        self._reconnects = reconnects(nc)
        self._acted: dict[tuple[str, int], float] = {}
        self._reported: dict[str, float] = {}
        self._last_seq = 0
        self._events_sub: JetStreamContext.PushSubscription | None = None
        self._service: Service | None = None
        self.moved = 0
        self.failed = 0
        self.duplicates = 0

    # -- start and stop ------------------------------------------------------------------------

    async def start(self) -> None:
        """Read the registry and the recent event log, then be ready to look."""
        workers = await ensure_streams(self.js, worker_ttl_s=self.settings.worker_ttl_s)
        asleep = await ensure_bucket(self.js, ASLEEP_BUCKET, ttl_s=None)
        ready = [asyncio.Event(), asyncio.Event()]
        self.tasks.spawn(
            follow_bucket(self.nc, workers, self._on_worker, ready[0]), name="watch-workers"
        )
        self.tasks.spawn(
            follow_bucket(self.nc, asleep, self._on_asleep, ready[1]), name="watch-asleep"
        )
        since = datetime.datetime.fromtimestamp(
            time.time() - self.settings.reaper_lookback_s, tz=datetime.UTC
        )
        self._events_sub = await self._follow_events(
            ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_TIME, opt_start_time=since)
        )
        self.tasks.spawn(self._refollow_events(), name="refollow-events")
        await asyncio.wait_for(asyncio.gather(*(r.wait() for r in ready)), timeout=10)
        await self._catch_up()
        self.judging_since = time.time()
        # Answers PING (the router waits for retryable failures to move on only while it does)
        # and a status request, for people and `coordinator health`.
        self._service = await add_service(
            self.nc,
            name=REAPER_SERVICE,
            version=__version__,
            description="moves work off dead, stuck or silent workers",
        )
        await add_endpoint(self._service, "status", REAPER_STATUS, self.handle_status, self.tasks)
        log.info(
            "reaper ready",
            open_tasks=sum(1 for t in self.view.tasks.values() if t.open),
            workers=len(self.view.workers),
            interval_s=self.settings.reaper_interval_s,
            worker_ttl_s=self.settings.worker_ttl_s,
        )

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

    async def stop(self) -> None:
        if self._service is not None:
            with suppress(Exception):
                await self._service.stop()
        if self._events_sub is not None:
            with suppress(Exception):
                await self._events_sub.unsubscribe()
        await self.tasks.wait(timeout_s=1.0)
        log.info("reaper stopped", moved=self.moved, failed=self.failed, duplicates=self.duplicates)

    async def run(self, stop: asyncio.Event) -> None:
        """Look every ``REAPER_INTERVAL_S`` until ``stop``; a failed look is logged, not fatal."""
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
        """``coordinator.reaper.status``: what the reaper sees and has done since it started."""
        open_tasks = Counter(t.status for t in self.view.tasks.values() if t.open)
        return _encoder.encode(
            {
                "open_tasks": dict(sorted(open_tasks.items())),
                "workers": sorted(self.view.workers),
                "moved": self.moved,
                "failed": self.failed,
                "duplicates": self.duplicates,
                "judging_since": self.judging_since,
            }
        )

    # -- feeds ---------------------------------------------------------------------------------

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

    def _on_worker(self, entry: KeyValue.Entry) -> None:
        if entry.operation in ("DEL", "PURGE") or not entry.value:
            self.view.remove_worker(entry.key)
        else:
            self.view.put_worker(worker_record_decoder.decode(entry.value))

    def _on_asleep(self, entry: KeyValue.Entry) -> None:
        if entry.operation in ("DEL", "PURGE") or not entry.value:
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
                self.view.apply(event)
            case WorkerRegistered():
                self.view.seen(event.worker_id, event.instance_id, event.host, event.at)
            case WorkerStopped():
                self.view.stopped(event.worker_id, event.instance_id)
            case _:
                pass  # not the reaper's business

    # -- looking -------------------------------------------------------------------------------

    async def look(self) -> None:
        """One round: sample the queues, detect, act."""
        now = time.time()
        count = reconnects(self.nc)
        if count != self._reconnects or not self.nc.is_connected:
            self._reconnects = count
            self.judging_since = now
            if not self.nc.is_connected:
                return
        self.view.prune(now)
        self._acted = {k: at for k, at in self._acted.items() if now - at < ACT_RETRY_S}
        await self._sample(now)
        snapshot = Snapshot(
            now=now,
            tasks=self.view.tasks,
            workers=self.view.workers,
            asleep=self.view.asleep,
            consumers=self.view.consumers,
            instances=self.view.instances,
            judging_since=self.judging_since,
        )
        findings = detect(snapshot, self.thresholds)
        for duplicate in findings.duplicates:
            await self._report(duplicate, now)
        await self._act(findings.tasks, now)

    async def _sample(self, now: float) -> None:
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
        )

    async def _report(self, finding: DuplicateFinding, now: float) -> None:
        if now - self._reported.get(finding.worker_id, float("-inf")) < DUPLICATE_REPEAT_S:
            return
        log.error(
            "duplicate worker",
            worker_id=finding.worker_id,
            detail=finding.detail,
            num_waiting=finding.num_waiting,
            instances=list(finding.instances),
            hosts=list(finding.hosts),
        )
        try:
            await self.actions.report_duplicate(finding)
        except Exception as exc:
            log.warning("could not record the duplicate", error=repr(exc))
            return
        self._reported[finding.worker_id] = now
        self.duplicates += 1

    async def _act(self, findings: Iterable[TaskFinding], now: float) -> None:
        """Decide for every finding (routing one after the other, so moved tasks spread out),
        then carry the decisions out a few at a time."""
        depth = self.view.depth()
        plans: list[tuple[TaskFinding, TaskTrack, Move | Fail]] = []
        for finding in findings:
            key = (finding.task_id, finding.attempt)
            task = self.view.tasks.get(finding.task_id)
            if key in self._acted or task is None:
                continue
            plan = decide(
                finding,
                task,
                self.view.workers.values(),
                now=now,
                ttl_s=self.settings.worker_ttl_s,
                max_attempts=self.settings.max_attempts,
                gpu_models=self.settings.gpu_models,
                depth=depth,
            )
            if isinstance(plan, Move):
                depth[plan.decision.worker_id] = depth.get(plan.decision.worker_id, 0) + 1
            self._acted[key] = now
            plans.append((finding, task, plan))
        if not plans:
            return
        queues = sorted({t.queue for _, t, _ in plans if t.queue is not None})
        indexes = dict(
            zip(
                queues,
                await asyncio.gather(*(queue_index(self.js, q) for q in queues)),
                strict=True,
            )
        )
        limit = asyncio.Semaphore(PARALLEL_ACTIONS)

        async def limited(work: Awaitable[None]) -> None:
            async with limit:
                await work

        await asyncio.gather(*(limited(self._carry_out(f, t, p, indexes)) for f, t, p in plans))

    async def _carry_out(
        self,
        finding: TaskFinding,
        task: TaskTrack,
        plan: Move | Fail,
        indexes: dict[str, QueueIndex],
    ) -> None:
        bound = log.bind(
            task_id=task.task_id,
            attempt=task.attempt,
            reason=finding.reason,
            worker=finding.worker,
            detail=finding.detail,
        )
        try:
            if await self._settled(task):
                bound.info("task settled meanwhile; nothing to do")
                return
            index = indexes.get(task.queue or "", {})
            copies = copies_up_to(index, task.task_id, task.attempt)
            if isinstance(plan, Move):
                try:
                    await self.actions.move(plan, copies)
                except SubmissionLost as exc:
                    plan = Fail(
                        task.task_id, max(task.attempt, 1), finding.worker, exc.code, exc.message
                    )
                else:
                    self.moved += 1
                    bound.warning(
                        "task moved",
                        new_attempt=plan.attempt,
                        to_worker=plan.decision.worker_id,
                        queue=plan.decision.queue,
                        removed_copies=len(copies),
                    )
                    return
            await self.actions.fail(plan, copies)
            self.failed += 1
            bound.error(
                "task failed by the reaper",
                failed_attempt=plan.attempt,
                code=plan.code,
                error=plan.reason,
                removed_copies=len(copies),
            )
        except Exception as exc:
            # Tried again once `ACT_RETRY_S` has passed, if the task still needs it then.
            bound.warning("action failed", error=repr(exc))

    async def _settled(self, task: TaskTrack) -> bool:
        """Has the task ended, or moved on, since the view last heard (events in transit)?"""
        after = task.attempt + 1 if task.status == "retry" else task.attempt
        if await stored_outcome(self.js, task.task_id, max(after, 1)) is not None:
            return True
        current = await current_attempt(self.js, task.task_id)
        return current is not None and current > task.attempt


async def run(settings: ReaperSettings, stop: asyncio.Event) -> None:
    """Run the reaper until ``stop`` is set."""
    nc = await connect(settings.nats_url, "coordinator-reaper", auth=settings.nats_auth())
    reaper = Reaper(nc, settings)
    try:
        await reaper.start()
        await reaper.run(stop)
    finally:
        await reaper.stop()
        with suppress(Exception):
            await nc.drain()
