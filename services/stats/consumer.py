"""The live projection: the durable ``stats`` consumer's batches applied to PostgreSQL.

Delivery is at least once and the store applies each event once (by its position and digest,
`tracking`), so the rule is simple: ack only after the batch's transaction has committed. When
PostgreSQL is away the batch is nak'ed with a delay and fetching pauses with a growing
backoff; nothing is acked that was not stored. A message that is not a known event is
terminated (logged), so it never blocks the stream. When a batch fails otherwise, its events
are applied one at a time: one that cannot be applied is parked (`tracking.parks`: recorded
with its tracking row, then terminated) at once when the failure is its own (`Unstorable`),
after `tracking.UNEXPLAINED_TRIES` deliveries when nothing explains it; the others go on.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, suppress
from dataclasses import dataclass
from typing import Final

import msgspec
import nats.errors
import structlog
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from opentelemetry import trace

from schemas.events import kind_of
from schemas.subjects import EVENTS_STREAM, EVENTS_SUBJECTS, STATS_CONSUMER
from services.errors import Unavailable
from services.runtime.tracing import extract_context, spans_recorded
from services.stats.projector import Item, item_of
from services.stats.rebuild import replay
from services.stats.rows import FigureKey
from services.stats.store import Store
from services.stats.tracking import parked_error, parks

log = structlog.get_logger("stats")
tracer = trace.get_tracer("coordinator.stats")

# An idle fetch returns after this long, which bounds how late a stop is noticed.
FETCH_TIMEOUT_S: Final = 1.0
# After a batch that did not fill up, events are left to gather this long before the next
# fetch: under load a batch then holds several tasks' events (one transaction, one pull)
# instead of one or two. An idle stream still gets its next event projected at once.
GATHER_S: Final = 0.02
# Redelivery delay for events not stored because PostgreSQL was away.
NAK_DELAY_S: Final = 1.0
# Redelivery delay for an event whose applying failed in a way nothing explains: it is tried
# again this much later (at most `tracking.UNEXPLAINED_TRIES` times), the others go on.
RETRY_DELAY_S: Final = 5.0
# Pauses between attempts while PostgreSQL (or the bus) is away: 1, 2, 4, 5, 5… seconds.
BACKOFF_FIRST_S: Final = 1.0
BACKOFF_MAX_S: Final = 5.0


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


@dataclass
class Counters:
    """What the projection did, for the summary line at stop."""

    projected: int = 0
    duplicates: int = 0
    terminated: int = 0
    retried: int = 0
    parked: int = 0


class ProjectionConsumer:
    """Fetches batches from the durable consumer, applies each in one transaction, then acks.

    ``touched`` is told the figure keys each stored batch may have changed. ``batch_lock`` is
    held while a batch is applied; a rebuild holds it from its catch-up to the swap.
    ``retry_delay_s``: how much later an event whose failure nothing explains comes again.
    """

    def __init__(
        self,
        js: JetStreamContext,
        store: Store,
        *,
        batch_size: int,
        stopping: asyncio.Event,
        touched: Callable[[set[FigureKey]], None],
        retry_delay_s: float = RETRY_DELAY_S,
    ) -> None:
        self.js = js
        self.store = store
        self.batch_size = batch_size
        self.counters = Counters()
        self.batch_lock = asyncio.Lock()
        self._stopping = stopping
        self._touched = touched
        self._retry_delay_s = retry_delay_s
        self._batch_started_ns = 0

    async def ensure_consumer(self) -> None:
        """Create the durable consumer, or bring an existing one to this configuration."""
        await self.js.add_consumer(EVENTS_STREAM, consumer_config())

    async def catch_up(self) -> int:
        """Before the first fetch of a start or a takeover: apply, in stream order, the
        events the durable consumer handed out that nobody has acknowledged (the batch a
        previous instance had in hand when it died or stood down); how many were new.

        The consumer would hand them out again only after their ack wait, behind newer
        events: a task's ``completed`` could then be applied before its ``submitted`` and
        ``routed``, and its outcome counted under the wrong domain. Read again from the
        stream here, they come in order; what the previous instance had committed is
        recognised by its tracking rows, and the redeliveries that follow are acked as
        duplicates. A catch-up that fails is logged: the redeliveries still come.
        """
        try:
            info = await self.js.consumer_info(EVENTS_STREAM, STATS_CONSUMER)
            first = info.ack_floor.stream_seq + 1 if info.ack_floor is not None else 1
            last = info.delivered.stream_seq if info.delivered is not None else 0
            if not info.num_ack_pending or last < first:
                return 0
            log.info("catching up on events handed out before", first_seq=first, last_seq=last)
            applied = await replay(self.js, first, last, self._apply_in_order, self.batch_size)
        except Exception as exc:
            log.warning(
                "catch-up failed; the events handed out before come again after their ack wait",
                error=repr(exc),
            )
            return 0
        log.info("caught up", first_seq=first, last_seq=last, fresh=applied)
        return applied

    async def _apply_in_order(self, items: list[Item]) -> int:
        """One catch-up batch, under the batch lock; one event at a time when the batch
        fails: one whose failure is its own (`Unstorable`) is parked, any other left to the
        consumer's redelivery, which counts its tries. `Unavailable` ends the catch-up."""
        async with self.batch_lock:
            try:
                results = [await self.store.apply_batch(items)]
            except Unavailable:
                raise
            except Exception:
                results = []
                for item in items:
                    try:
                        results.append(await self.store.apply_batch([item]))
                    except Unavailable:
                        raise
                    except Exception as exc:
                        if parks(exc, tries=1):
                            await self._park(item, exc, EVENTS_STREAM)
                        else:
                            log.warning(
                                "catch-up: applying an event failed; its redelivery tries again",
                                stream_seq=item.seq,
                                error=parked_error(exc),
                            )
        applied = 0
        for projected in results:
            self._touched(projected.touched)
            applied += projected.applied
        self.counters.projected += applied
        return applied

    async def fill_digests(self) -> int:
        """Before anything is applied: give the tracking rows written before digests were
        kept the digests of the events the stream holds at their positions
        (`Store.fill_digests`); how many. Rows whose events the stream no longer holds keep
        none, and an event found there later is taken for another log's (`tracking`).
        Raises `Unavailable`: projecting must not start without them."""
        span = await self.store.undigested()
        if span is None:
            return 0
        try:
            info = await self.js.stream_info(EVENTS_STREAM)
        except Exception as exc:
            raise Unavailable(f"cannot read the {EVENTS_STREAM} stream: {exc!r}") from exc
        first = max(span[0], info.state.first_seq or 1)
        last = min(span[1], info.state.last_seq or 0)
        if last < first:
            return 0
        log.info("filling in the digests of tracking rows", first_seq=first, last_seq=last)
        filled = await replay(self.js, first, last, self.store.fill_digests)
        log.info("digests filled in", first_seq=first, last_seq=last, rows=filled)
        return filled

    async def run(self, sub: JetStreamContext.PullSubscription) -> None:
        """Fetch and apply batches until stopped; trouble pauses the loop, never ends it."""
        backoff_s = BACKOFF_FIRST_S
        while not self._stopping.is_set():
            try:
                msgs = await sub.fetch(self.batch_size, timeout=FETCH_TIMEOUT_S)
            except (nats.errors.TimeoutError, TimeoutError):
                continue  # idle
            except Exception as exc:
                # Reconnecting, or the consumer was deleted under us: recreate it and go on.
                log.warning("fetching events failed", error=repr(exc))
                await self._pause(backoff_s)
                backoff_s = min(backoff_s * 2, BACKOFF_MAX_S)
                with suppress(Exception):
                    await self.ensure_consumer()
                continue
            async with self.batch_lock:
                stored = await self._apply_batch(msgs)
            if stored:
                backoff_s = BACKOFF_FIRST_S
                if len(msgs) < self.batch_size:
                    await self._pause(GATHER_S)
            else:
                await self._pause(backoff_s)
                backoff_s = min(backoff_s * 2, BACKOFF_MAX_S)

    async def _apply_batch(self, msgs: list[Msg]) -> bool:
        """Apply ``msgs`` in one transaction; False when PostgreSQL failed (all nak'ed)."""
        self._batch_started_ns = time.time_ns()
        decoded: list[tuple[Msg, Item]] = []
        for msg in msgs:
            seq = msg.metadata.sequence.stream
            try:
                decoded.append((msg, item_of(seq, msg.subject, msg.data)))
            except msgspec.DecodeError as exc:
                with structlog.contextvars.bound_contextvars(subject=msg.subject, stream_seq=seq):
                    log.error("undecodable event; terminated", error=str(exc))
                self.counters.terminated += 1
                with suppress(Exception):
                    await msg.term()
        if not decoded:
            return True
        try:
            projected = await self.store.apply_batch([item for _, item in decoded])
        except Unavailable as exc:
            await self._nak_rest(decoded, exc)
            return False
        except Exception as exc:
            # One event that cannot be applied, or a bug: find it by going one by one.
            log.warning("batch not applied; applying its events one by one", error=repr(exc))
            return await self._apply_each(decoded)
        for msg, item in decoded:
            await self._ack(msg, item, applied=item.seq in projected.fresh)
        self._touched(projected.touched)
        log.info(
            "batch projected",
            events=len(decoded),
            fresh=len(projected.fresh),
            first_seq=decoded[0][1].seq,
            last_seq=decoded[-1][1].seq,
        )
        return True

    async def _apply_each(self, decoded: list[tuple[Msg, Item]]) -> bool:
        for index, (msg, item) in enumerate(decoded):
            with _bound(msg, item):
                try:
                    projected = await self.store.apply_batch([item])
                except Unavailable as exc:
                    await self._nak_rest(decoded[index:], exc)
                    return False
                except Exception as exc:
                    tries = msg.metadata.num_delivered or 1
                    if not parks(exc, tries):
                        # Nothing explains it: set this one event aside for a while, go on.
                        log.exception("projecting an event failed; it comes again", tries=tries)
                        self.counters.retried += 1
                        with suppress(Exception):
                            await msg.nak(delay=self._retry_delay_s)
                        continue
                    try:
                        await self._park(item, exc, msg.metadata.stream)
                    except Unavailable as unavailable:
                        await self._nak_rest(decoded[index:], unavailable)
                        return False
                    with suppress(Exception):
                        await msg.term()
                    continue
            await self._ack(msg, item, applied=bool(projected.applied))
            self._touched(projected.touched)
        return True

    async def _park(self, item: Item, error: Exception, stream: str) -> None:
        """Record ``item`` as parked (`Store.park`), with its one error line."""
        reason = parked_error(error)
        if await self.store.park(item, reason, stream):
            self.counters.parked += 1
        log.error(
            "event parked: it cannot be projected",
            stream_seq=item.seq,
            subject=item.subject,
            kind=kind_of(item.event),
            error=reason,
        )

    async def _nak_rest(self, pending: list[tuple[Msg, Item]], exc: Unavailable) -> None:
        """PostgreSQL is away: every event not stored comes again (after `NAK_DELAY_S`)."""
        log.warning(
            "database unavailable; events will be redelivered",
            error=exc.message,
            nak_count=len(pending),
        )
        self.counters.retried += len(pending)
        for msg, _ in pending:
            with suppress(Exception):
                await msg.nak(delay=NAK_DELAY_S)

    async def _ack(self, msg: Msg, item: Item, *, applied: bool) -> None:
        """Ack a committed event, with its one (debug) log line, in a ``project event`` span
        that continues the trace the event carries (from the batch's start to its ack); no span
        when spans are not recorded (nothing exports them): this runs for every event."""
        if not spans_recorded():
            await self._ack_one(msg, item, applied=applied)
            return
        with tracer.start_as_current_span(
            "project event",
            context=extract_context(msg.headers),
            start_time=self._batch_started_ns,
            kind=trace.SpanKind.CONSUMER,
            attributes={"messaging.destination.name": msg.subject, "stream_seq": item.seq},
        ):
            await self._ack_one(msg, item, applied=applied)

    async def _ack_one(self, msg: Msg, item: Item, *, applied: bool) -> None:
        try:
            await msg.ack()
        except Exception as exc:
            # Committed already: a redelivery will be recognised and acked then.
            with _bound(msg, item):
                log.warning("ack failed after commit", error=repr(exc))
        if applied:
            self.counters.projected += 1
        else:
            self.counters.duplicates += 1
        log.debug(
            "event projected",
            kind=kind_of(item.event),
            duplicate=not applied,
            subject=msg.subject,
            stream_seq=item.seq,
            task_id=getattr(item.event, "task_id", None),
        )

    async def _pause(self, seconds: float) -> None:
        """Sleep ``seconds``, or less if a stop is requested."""
        with suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), timeout=seconds)


def _bound(msg: Msg, item: Item) -> AbstractContextManager[None]:
    """The log context of one message: subject, stream position, task id when it has one."""
    return structlog.contextvars.bound_contextvars(
        subject=msg.subject, stream_seq=item.seq, task_id=getattr(item.event, "task_id", None)
    )
