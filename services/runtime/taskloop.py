"""The task loop every worker kind runs on: one task at a time, nothing lost, nothing stale.

A kind (inference, web search) says what it serves and what it does with a claimed task
(`Kind`); the loop does everything else, the same way for every kind:

- start: the kind's preparation (models, sanity runs), the lease (one process per worker id),
  cancel notices, the consumers, the ``registered`` event;
- pull: the first queue long, the others briefly, at most one message held over all of them;
  a message a kind cannot serve (a shared queue's) goes back at once;
- a redelivered message: acknowledged when its outcome is stored; for a kind that never runs
  a task twice, failed when its starter is gone (`services.fleet.takeover`);
- the claim: the attempt's ``started``, fenced on its ``routed`` so a stale copy is dropped,
  stored while the work begins; nothing of the attempt (a stream chunk, the outcome) leaves
  before it;
- ``in_progress`` while the work runs; a cancel notice stops the work;
- the outcome stored, then the message acknowledged;
- stop: the running task gets ``stop_grace_s``; a kind that can wrap up is then told to
  (``Attempt.cut``) and given ``wrap_up_s`` to record what it has; whatever still runs goes
  back to its queue;
- out of touch with the bus (no heartbeat stored for nearly a TTL: a partition, an outage):
  the running task's work is stopped and the task held, nothing is pulled until the lease is
  renewed, and the held task runs again then unless it was moved on meanwhile
  (`services.runtime.touch`); a task whose work was done stores its outcome once the bus is
  back, unless it was moved on meanwhile;
- settlements (ack, nak, term) confirmed by the server and sent again through an outage, and a
  delivery lost in a reconnect handed out again at once (`services.runtime.acks`);
- a watchdog process, for a worker that is its own process: a worker that stops running while
  a task's work runs is killed, so its backend stops before the task may be moved
  (`services.runtime.watchdog`);
- idle sleep, for kinds with a `SleepPolicy`.

This module is the worker's life (start, pull, stop); one task's way through is
`services.runtime.taskrun`; what a kind provides is `services.runtime.taskkind`.

The durable consumers have ``max_ack_pending=1`` (the own queue), so the server never hands a
worker id a second task while one is unacknowledged, however many processes bind.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from contextlib import suppress
from dataclasses import dataclass
from functools import partial

import msgspec
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext

from schemas import message_ids
from schemas.events import WorkerRegistered
from schemas.subjects import CANCEL_NOTICES
from schemas.tasks import task_decoder
from schemas.workers import WorkerRecord
from services import __version__
from services.errors import LeaseLost
from services.runtime.acks import ACK, NAK, STOP_SETTLE_S, recover_lost_delivery, settle
from services.runtime.bus import answered, ensure_streams, flush_written, publish_event
from services.runtime.consumers import Queue, bind, own_consumer
from services.runtime.lease import Lease, deregister
from services.runtime.lifecycle import stop_within
from services.runtime.pull import holds_delivery, pull_one
from services.runtime.sleep import forget_sleeping, go_to_sleep, watch_idle
from services.runtime.taskkind import HealthWatch, Kind, LoopSettings
from services.runtime.taskrun import TaskRunner
from services.runtime.touch import TOUCH_LOOK_S, Touch
from services.runtime.watch import reconnects
from services.runtime.watchdog import Watchdog

log = structlog.get_logger("taskloop")

_task_decoder = task_decoder
_encoder = msgspec.json.Encoder()

# Long-poll times: the first queue long (tasks for this worker), the others short (so a task
# routed to this worker waits at most this long while the worker looks at a shared queue).
FIRST_POLL_S = 1.0
OTHER_POLL_S = 0.2
# How often a degraded worker (which pulls nothing) asks whether a probe is due.
DEGRADED_LOOK_S = 0.5


@dataclass(frozen=True, slots=True)
class Source:
    """A bound queue."""

    queue: Queue
    sub: JetStreamContext.PullSubscription


class TaskLoop:
    """Registers a worker of one kind, heartbeats, and runs its tasks strictly one at a time."""

    def __init__(
        self, nc: Client, kind: Kind, settings: LoopSettings, health: HealthWatch | None = None
    ) -> None:
        self.nc = nc
        self.health = health
        self.js: JetStreamContext = nc.jetstream()
        self.kind = kind
        self.settings = settings
        self.instance_id = uuid.uuid4().hex[:12]
        self.runner = TaskRunner(nc, self.js, kind, settings)
        self.started_at = self.runner.last_activity
        self.lease: Lease | None = None
        self.asleep = asyncio.Event()
        self.touch: Touch | None = None  # once the lease is taken
        self._running: asyncio.Task[bool] | None = None  # what a stop may cancel
        self._confirming: set[asyncio.Task[bool]] = set()  # acks awaiting the server's word
        self._cancel_sub: Subscription | None = None

    def record(self) -> WorkerRecord:
        s = self.settings
        health = self.health.health if self.health is not None else None
        return WorkerRecord(
            worker_id=s.worker_id,
            host=s.host,
            instance_id=self.instance_id,
            pid=os.getpid(),
            version=__version__,
            supports=list(self.kind.supports),
            models=self.kind.models,
            started_at=self.started_at,
            heartbeat_at=time.time(),
            state="busy" if self.runner.current_task else "idle",
            current_task=self.runner.current_task,
            current_model=self.runner.current_model if self.runner.current_task else None,
            backend=self.kind.backend_kind,
            backend_url=self.kind.address,
            wol_mac=s.wol_mac,
            facts=self.kind.facts,
            health=health.status if health is not None else "healthy",
            health_reason=health.reason if health is not None else None,
            health_since=health.since if health is not None else None,
            resident=self.health.resident if self.health is not None else None,
            model_memory=self.health.model_memory if self.health is not None else {},
            memory_bytes=self.health.memory_bytes if self.health is not None else None,
            max_resident=self.health.max_resident if self.health is not None else None,
        )

    # -- start and stop ------------------------------------------------------------------------

    async def start(self, stop: asyncio.Event) -> list[Source]:
        """Prepare the kind, take the lease, bind the queues and announce the worker."""
        s = self.settings
        self.runner.registry = await ensure_streams(self.js, worker_ttl_s=s.worker_ttl_s)
        # The lease first: a second process with this id is refused before it puts any load
        # on the backend (sanity runs). Until they pass, the entry lists no model, so nothing
        # is routed here; then it is renewed at once with them.
        self.lease = Lease(self.runner.registry, s.worker_id, s.worker_ttl_s, self.record)
        self.runner.announce = self.lease.renew
        # Its bucket may still be electing a leader: taking the key again is safe (a create
        # whose answer was lost is found to be this process's own).
        await answered(self.lease.acquire, f"the lease of worker '{s.worker_id}'")
        try:
            if s.through_router and any(queue.one_at_a_time for queue in self.kind.queues()):
                # While its entry lists no model: nothing is routed to a worker whose consumer
                # no router has made yet (none answers).
                await own_consumer(self.nc, s.worker_id, s.ack_wait_s)
            await self.kind.prepare(stop)
            await answered(self.lease.renew, f"the lease of worker '{s.worker_id}'")
        except BaseException:
            await self.lease.release()  # never registered: nothing to record
            raise
        if s.sleep is not None:
            await forget_sleeping(self.js, s.worker_id)
        # Before the first task can arrive, so no cancel for a task taken here is missed.
        self._cancel_sub = await self.nc.subscribe(CANCEL_NOTICES, cb=self.runner.on_cancel)
        queues = self.kind.queues()
        sources = [
            Source(
                queue,
                await answered(
                    partial(bind, self.js, queue, s.ack_wait_s), f"the consumer {queue.consumer}"
                ),
            )
            for queue in queues
        ]
        registered = WorkerRegistered(
            at=time.time(),
            worker_id=s.worker_id,
            host=s.host,
            instance_id=self.instance_id,
            models=self.kind.models,
            supports=list(self.kind.supports),
            version=__version__,
        )
        # Stored once, however often it is asked (its id within the duplicate window).
        await answered(
            lambda: publish_event(
                self.js, registered, msg_id=message_ids.registered(self.instance_id)
            ),
            "the worker's registration",
        )
        await flush_written(self.nc)  # the cancel notices' subscription is in place
        log.info(
            "worker ready",
            worker_id=s.worker_id,
            supports=self.kind.supports,
            models=self.kind.models,
            backend=self.kind.address,
            queues=[queue.subject for queue in queues],
        )
        return sources

    async def run(self, stop: asyncio.Event) -> None:
        """Start, pull tasks until ``stop`` (or the lease is lost, or sleep), then stop cleanly."""
        try:
            sources = await self.start(stop)
        except BaseException:
            await self.kind.close()
            raise
        assert self.lease is not None
        s = self.settings
        self.touch = Touch(self.lease, self.runner, s.heartbeat_interval_s, s.ack_wait_s)
        background = [
            asyncio.create_task(self.lease.keep(s.heartbeat_interval_s)),
            asyncio.create_task(self.touch.watch()),
        ]
        watchdog = Watchdog(s.watchdog_s) if s.watchdog_s is not None else None
        if watchdog is not None:
            await watchdog.start()
            self.runner.on_working = watchdog.mark
            background.append(asyncio.create_task(watchdog.feed(lambda: self.runner.working)))
        if self.settings.sleep is not None:
            background.append(
                asyncio.create_task(
                    watch_idle(
                        self.settings.sleep,
                        started_at=self.started_at,
                        last_activity=lambda: self.runner.last_activity,
                        busy=lambda: self.runner.current_task is not None,
                        asleep=self.asleep,
                    )
                )
            )
        try:
            await self.serve(sources, stop)
        finally:
            for job in background:
                job.cancel()
                with suppress(asyncio.CancelledError):
                    await job
            for sub in (*(source.sub for source in sources), self._cancel_sub):
                if sub is not None:
                    with suppress(Exception):
                        await sub.unsubscribe()
            try:
                if self.asleep.is_set() and self.settings.sleep is not None:
                    idle_s = time.time() - self.runner.last_activity
                    await go_to_sleep(
                        self.js, self.lease, self.record(), self.settings.sleep, idle_s=idle_s
                    )
                else:
                    # Bounded: with the bus gone, each of its writes would wait out its timeout,
                    # and the entry expires after a TTL anyway.
                    why = "lease lost" if self.lease.lost.is_set() else "stopped"
                    await stop_within("goodbye", deregister(self.lease, self.js, why))
            finally:
                # Whatever became of the goodbye (a bus away, a stop cut short), the backend's
                # connections are closed.
                await self.kind.close()
                if watchdog is not None:
                    await watchdog.close()
        log.info("worker stopped", worker_id=self.settings.worker_id, **self.runner.counts)
        if self.lease.lost.is_set():
            raise LeaseLost(f"worker '{self.settings.worker_id}' stopped: its lease was taken over")

    # -- pulling -------------------------------------------------------------------------------

    async def serve(self, sources: list[Source], stop: asyncio.Event) -> None:
        """Pull and run tasks one at a time until ``stop``, a lost lease or sleep.

        The first queue is asked first and longest; the others briefly, and only when the
        first had nothing. After any task the first queue comes first again.

        With more than one queue, right after a task every queue is first looked at without
        waiting: at full load the router sends every task to the shared queue, and a worker
        that went back to a long poll of its empty own queue would idle `FIRST_POLL_S` per
        task while the shared queue fills.
        """
        lost = self.lease.lost if self.lease is not None else asyncio.Event()
        touch = self.touch
        usual = [(src, FIRST_POLL_S if i == 0 else OTHER_POLL_S) for i, src in enumerate(sources)]
        after_task = [(src, 0.0) for src in sources] + usual if len(sources) > 1 else usual
        polls = usual
        connection = reconnects(self.nc)
        watch = asyncio.create_task(self._stop_watch(stop))
        try:
            while not (stop.is_set() or lost.is_set() or self.asleep.is_set()):
                if touch is not None and touch.adrift.is_set():
                    with suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), timeout=TOUCH_LOOK_S)
                    continue  # out of touch: nothing pulled until the lease is renewed
                if touch is not None and touch.parked is not None:
                    if (held := await touch.take_parked()) is not None:
                        await self._run_guarded(held, stop)
                        polls = after_task
                    continue
                if reconnects(self.nc) != connection:
                    # Nothing held, no pull waiting: a task in flight was lost on its way.
                    connection = reconnects(self.nc)
                    await self._recover(sources)
                if not await self._healthy(stop):
                    continue  # degraded: nothing pulled (the reaper moves what waits here)
                polls_now, polls = polls, usual
                for source, poll_s in polls_now:
                    msg = await self._fetch_one(source.sub, poll_s)
                    if msg is None:
                        continue
                    if source.queue.checked and not await self._serves(msg):
                        continue
                    await self._run_guarded(msg, stop)
                    polls = after_task
                    break
        finally:
            watch.cancel()
            if touch is not None:
                await touch.let_go()
            if self._confirming:  # what is not confirmed by then comes back after its ack wait
                await asyncio.wait(set(self._confirming), timeout=STOP_SETTLE_S)

    async def _healthy(self, stop: asyncio.Event) -> bool:
        """Between tasks: run the backend probe that is due (stopped by ``stop``); False
        while the backend is degraded, after a short wait."""
        if self.health is None:
            return True
        if self.health.due():
            probe = asyncio.create_task(self.health.check())
            stopping = asyncio.create_task(stop.wait())
            try:
                await asyncio.wait({probe, stopping}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                stopping.cancel()
                probe.cancel()  # a no-op once it is done; stopped midway by a stop
            if probe.done() and not probe.cancelled() and probe.exception() is not None:
                log.warning("backend probe failed", error=repr(probe.exception()))
        if self.health.health.status == "healthy":
            return True
        with suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=DEGRADED_LOOK_S)
        return False

    async def _fetch_one(
        self, source: JetStreamContext.PullSubscription, poll_s: float
    ) -> Msg | None:
        """The source's next message, waiting up to ``poll_s`` (0: only one already there)."""
        try:
            return await pull_one(source, poll_s)
        except Exception as exc:
            log.warning("fetch failed", error=repr(exc))
            await asyncio.sleep(0.5)
            return None

    async def _serves(self, msg: Msg) -> bool:
        """A shared task this worker cannot run goes back for another worker."""
        try:
            task = _task_decoder.decode(msg.data)
        except msgspec.DecodeError:
            return True  # handle() terminates it with a log line
        if self.kind.serves(task):
            return True
        log.info("shared task for a model not served here; returned", model=task.model)
        await settle(self.nc, msg, NAK, delay_s=1)
        return False

    async def _run_guarded(self, msg: Msg, stop: asyncio.Event) -> None:
        """Run one task; on stop, `_stop_watch` gives it its grace and then cancels it, and
        its message goes back to the queue.

        The message is acked here once `handle` has stored the outcome: the serve loop's next
        pull then leaves in the same write as the ack. A message that arrives once ``stop`` is
        set goes back at once.
        """
        if stop.is_set():
            await settle(self.nc, msg, NAK, within_s=STOP_SETTLE_S)
            return
        work = asyncio.create_task(self.runner.handle_traced(msg))
        self._running = work
        try:
            stored = await work
        except asyncio.CancelledError:
            this = asyncio.current_task()
            if not work.cancelled() or (this is not None and this.cancelling()):
                raise
            if self.touch is not None and self.touch.stopping and not stop.is_set():
                self.touch.park(msg)  # stopped for want of touch with the bus: held
                return
            await settle(self.nc, msg, NAK, within_s=STOP_SETTLE_S)  # stopped by `_stop_watch`
            return
        finally:
            self._running = None
            if self.touch is not None:
                self.touch.stopping = False
        if stored:
            # Confirmed by the server, through an outage: until it takes the ack, the worker's
            # own queue hands it nothing more. One never taken comes back after its ack wait,
            # and the redelivery is recognised by its stored outcome and acked. The
            # confirmation is awaited beside the next pull, which leaves in the same write as
            # the ack, so a task costs no extra round trip.
            confirming = asyncio.create_task(settle(self.nc, msg, ACK))
            self._confirming.add(confirming)
            confirming.add_done_callback(self._confirming.discard)

    async def _recover(self, sources: list[Source]) -> None:
        """After a reconnect, return to its queue a task the server handed out as the
        connection went down (`recover_lost_delivery`), rather than wait out its ack wait."""
        for source in sources:
            if not source.queue.one_at_a_time or holds_delivery(source.sub):
                continue
            try:
                await recover_lost_delivery(self.nc, self.js, source.queue.consumer)
            except Exception as exc:  # the bus is away again: the next reconnect looks again
                log.warning("lost delivery not looked for", error=repr(exc))

    async def _stop_watch(self, stop: asyncio.Event) -> None:
        """Once ``stop`` is set, give the running task its grace (and a kind that can wrap up
        its wrap-up time), then cancel it."""
        await stop.wait()
        work = self._running
        if work is None:
            return
        done, _ = await asyncio.wait({work}, timeout=self.settings.stop_grace_s)
        if not done and self.settings.wrap_up_s is not None:
            log.warning("stop grace over: wrapping up the task", task_id=self.runner.current_task)
            self.runner.cut.set()
            done, _ = await asyncio.wait({work}, timeout=self.settings.wrap_up_s)
        if not done:
            log.warning(
                "stopping: returning the current task to its queue",
                task_id=self.runner.current_task,
            )
            work.cancel()
