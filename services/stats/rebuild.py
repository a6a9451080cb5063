"""Rebuild the read model from the event log, and swap it in while queries keep answering.

Why: the tables are derived data. When they are polluted (lesson 3: a duplicate worker
doubled every duration for two nights) or the projection's code changes, they are recomputed
from ``EVENTS``, which is never edited. (Exclusions and aliases also apply to history as soon
as their events are projected; a rebuild recomputes everything from scratch, the same way.)

How, with the live projection still running:

1. Take the session advisory lock `REBUILD_LOCK` (one rebuild at a time, `RebuildBusy`
   otherwise) and create fresh, empty tables from ``schema.sql`` in the schema
   ``stats_next``.
2. Replay ``EVENTS`` from sequence 1 up to its last sequence *S1* at that moment, through an
   ordered (ephemeral, unacknowledged) consumer, into ``stats_next`` with the same code the
   live projection uses (`projector.project`), in large transactions. The live tables go on
   being updated and queried meanwhile; the durable consumer is not touched.
3. Quiesce the live projection: pause this process's projector between batches (``pause``),
   then take `PROJECTION_LOCK` exclusively. Every live batch holds that lock shared for its
   whole transaction, so once it is held no live write is in flight and none can start, in
   this process or in another stats instance.
4. Catch up: replay (*S1*, *S2*] where *S2* is the stream's last sequence now. Every event a
   live batch ever committed was in the stream before the lock was taken, so its sequence is
   at most *S2*: the fresh tables now hold everything the live ones do, tracking rows
   included.
5. Recompute every figure, then in one transaction move the live tables aside and the fresh
   ones into the live schema (``ALTER TABLE … SET SCHEMA``; DDL is transactional in
   PostgreSQL), drop the old ones, commit, release the lock.

The consumer position needs no change: the durable consumer has acked at most what the live
tables committed (≤ *S2*), and it redelivers anything unacked. An event at or below *S2* that
arrives again finds its tracking row in the new tables and is acked as a duplicate; one above
*S2* is new to them and is applied exactly once. A live batch that was waiting for the lock
starts its statements after the swap, so it writes to the new tables.

The fresh tables hold only what ``EVENTS`` holds now: what events of a log it no longer holds
counted (``replaced_tracking``) is gone after the swap. An event that cannot be projected is
parked in the fresh tables as the live projection parks it (any failure but `Unavailable`: a
replay has no later try), so it never fails the rebuild; one parked before is tried again.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Final

import asyncpg
import msgspec
import structlog
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig, DeliverPolicy

from schemas.events import kind_of
from schemas.subjects import EVENTS_STREAM, EVENTS_SUBJECTS
from services.errors import RebuildBusy, Unavailable
from services.stats.figure_rows import refresh_figures
from services.stats.projector import Item, item_of, park, project
from services.stats.rows import PROJECTION_LOCK, PROJECTION_TABLES, Connection
from services.stats.store import SCHEMA_PATH, database_errors, redact_dsn
from services.stats.tracking import UNEXPLAINED_TRIES, parked_error, parks

log = structlog.get_logger("stats.rebuild")

REBUILD_SCHEMA: Final = "stats_next"
OLD_SCHEMA: Final = "stats_old"
REBUILD_LOCK: Final = 7_301_003

# Events per transaction while replaying.
BATCH_SIZE: Final = 2000
# How long the replay waits for the next message before deciding the stream has no more.
IDLE_S: Final = 5.0


@dataclass(frozen=True)
class RebuildResult:
    events: int
    """Events applied to the fresh tables."""
    last_seq: int
    """The stream sequence the fresh tables reach."""
    seconds: float
    figures: int
    parked: int = 0
    """Events that cannot be projected, recorded as parked in the fresh tables."""

    @property
    def events_per_s(self) -> float:
        return self.events / self.seconds if self.seconds > 0 else 0.0


async def rebuild(
    js: JetStreamContext,
    dsn: str,
    *,
    pause: asyncio.Lock | None = None,
    batch_size: int = BATCH_SIZE,
) -> RebuildResult:
    """Replay ``EVENTS`` into fresh tables and swap them in (see the module docstring).

    ``pause`` is held by this process's live projector while it applies a batch; the rebuild
    holds it from the catch-up to the swap. Raises `RebuildBusy` when another rebuild runs,
    `Unavailable` when PostgreSQL or the stream fail (the live tables are then untouched).
    """
    started = time.perf_counter()
    async with _connection(dsn) as conn:
        with database_errors():
            if not await conn.fetchval("SELECT pg_try_advisory_lock($1)", REBUILD_LOCK):
                raise RebuildBusy("a rebuild is already running; wait for it to finish")
            live = str(await conn.fetchval("SELECT current_schema()"))
            await _prepare(conn)
        first_target = await _last_seq(js)
        log.info("rebuild started", up_to=first_target, live_schema=live)
        counts = _Counts()
        fresh = functools.partial(_apply, conn, counts)
        applied = await replay(js, 1, first_target, fresh, batch_size)
        async with pause if pause is not None else contextlib.nullcontext():
            with database_errors():
                await conn.execute("SELECT pg_advisory_lock($1)", PROJECTION_LOCK)
            try:
                last = await _last_seq(js)
                if last > first_target:
                    applied += await replay(js, first_target + 1, last, fresh, batch_size)
                with database_errors():
                    async with conn.transaction():
                        await refresh_figures(conn)
                    figures = int(await conn.fetchval("SELECT count(*) FROM figures"))
                    await _swap(conn, live)
            finally:
                with contextlib.suppress(Exception):
                    await conn.execute("SELECT pg_advisory_unlock($1)", PROJECTION_LOCK)
    result = RebuildResult(
        events=applied,
        last_seq=last,
        seconds=time.perf_counter() - started,
        figures=figures,
        parked=counts.parked,
    )
    log.info(
        "rebuild swapped in",
        events=result.events,
        last_seq=result.last_seq,
        seconds=round(result.seconds, 3),
        events_per_s=round(result.events_per_s),
        figures=figures,
        parked=counts.parked,
    )
    return result


@contextlib.asynccontextmanager
async def _connection(dsn: str) -> AsyncIterator[asyncpg.Connection]:
    """A connection of its own (session locks and search_path are per connection)."""
    try:
        conn = await asyncpg.connect(dsn, timeout=10)
    except (asyncpg.PostgresError, asyncpg.InterfaceError, OSError, TimeoutError) as exc:
        raise Unavailable(
            f"cannot reach PostgreSQL at {redact_dsn(dsn)}: {exc or type(exc).__name__}"
        ) from exc
    try:
        yield conn
    finally:
        # Closing also releases the session advisory locks.
        with contextlib.suppress(Exception):
            await conn.close(timeout=5)


async def _prepare(conn: Connection) -> None:
    """Empty ``stats_next`` with every table of schema.sql, and make it the search path."""
    sql = await asyncio.to_thread(SCHEMA_PATH.read_text, encoding="utf-8")
    await conn.execute(f"DROP SCHEMA IF EXISTS {REBUILD_SCHEMA} CASCADE")
    await conn.execute(f"CREATE SCHEMA {REBUILD_SCHEMA}")
    # Only the fresh schema: a table missing there must be an error, not the live one.
    await conn.execute(f"SET search_path TO {REBUILD_SCHEMA}")
    # A crash loses an unfinished rebuild anyway, so its batches need not wait for the disk;
    # the swap does (it sets this back on).
    await conn.execute("SET synchronous_commit TO off")
    async with conn.transaction():
        await conn.execute(sql)


async def _last_seq(js: JetStreamContext) -> int:
    try:
        info = await js.stream_info(EVENTS_STREAM)
    except Exception as exc:
        raise Unavailable(f"cannot read the {EVENTS_STREAM} stream: {exc!r}") from exc
    return int(info.state.last_seq or 0)


async def replay(
    js: JetStreamContext,
    start: int,
    until: int,
    apply: Callable[[list[Item]], Awaitable[int]],
    batch_size: int = BATCH_SIZE,
) -> int:
    """Read the events at sequences [start, until] in stream order, through an ordered
    consumer (nothing is acknowledged), and ``apply`` them in batches; how many it applied.

    The rebuild fills the fresh tables with it; the live projection, taking over, applies
    the events a previous instance had in hand (`consumer.ProjectionConsumer.catch_up`).
    Receiving and decoding (the subscription's callback) run while the previous batch is
    applied, so PostgreSQL and the bus are busy at the same time.
    """
    if until < start:
        return 0
    batches: asyncio.Queue[list[Item] | None] = asyncio.Queue(maxsize=4)
    batch: list[Item] = []
    finished = False
    last_seen = time.monotonic()

    async def on_message(msg: Msg) -> None:
        nonlocal batch, finished, last_seen
        if finished:
            return
        last_seen = time.monotonic()
        metadata = msg.metadata
        seq = metadata.sequence.stream
        if seq <= until:
            try:
                batch.append(item_of(seq, msg.subject, msg.data))
            except msgspec.DecodeError as exc:
                log.warning("undecodable event skipped", stream_seq=seq, error=str(exc))
        end = seq >= until or metadata.num_pending == 0
        if len(batch) >= batch_size or end:
            full, batch = batch, []
            await batches.put(full)
        if end:
            finished = True
            await batches.put(None)

    try:
        sub = await js.subscribe(
            EVENTS_SUBJECTS,
            stream=EVENTS_STREAM,
            cb=on_message,
            ordered_consumer=True,
            config=ConsumerConfig(
                deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=start
            ),
        )
    except Exception as exc:
        raise Unavailable(f"cannot replay {EVENTS_STREAM}: {exc!r}") from exc
    applied = 0
    try:
        while True:
            try:
                item = await asyncio.wait_for(batches.get(), timeout=IDLE_S)
            except TimeoutError:
                if time.monotonic() - last_seen < IDLE_S:
                    continue
                # Nothing more: the rest up to `until` has aged out of the stream.
                finished = True
                item, batch = batch, []
                applied += await apply(item)
                break
            if item is None:
                break
            applied += await apply(item)
    finally:
        finished = True
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
    return applied


@dataclass
class _Counts:
    parked: int = 0


async def _apply(conn: Connection, counts: _Counts, batch: list[Item]) -> int:
    """One transaction for the batch; if it fails, one per event, and an event that fails
    alone is parked (`tracking.parks`, as on its last try). `Unavailable` fails the rebuild."""
    if not batch:
        return 0
    try:
        return await _project(conn, batch)
    except Exception as exc:
        if not parks(exc, UNEXPLAINED_TRIES):
            raise
    applied = 0
    for item in batch:
        try:
            applied += await _project(conn, [item])
        except Exception as exc:
            if not parks(exc, UNEXPLAINED_TRIES):
                raise
            error = parked_error(exc)
            with database_errors(writing=True):
                async with conn.transaction():
                    if await park(conn, item, error):
                        counts.parked += 1
            log.error(
                "event parked: it cannot be projected",
                stream_seq=item.seq,
                subject=item.subject,
                kind=kind_of(item.event),
                error=error,
            )
    return applied


async def _project(conn: Connection, batch: list[Item]) -> int:
    with database_errors(writing=True):
        async with conn.transaction():
            return (await project(conn, batch, lock_tasks=False)).applied


def _ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


async def _swap(conn: Connection, live: str) -> None:
    """Move the fresh tables into ``live`` and the old ones out, in one transaction."""
    schema = _ident(live)
    async with conn.transaction():
        await conn.execute("SET LOCAL synchronous_commit TO on")
        await conn.execute(f"DROP SCHEMA IF EXISTS {OLD_SCHEMA} CASCADE")
        await conn.execute(f"CREATE SCHEMA {OLD_SCHEMA}")
        present = [
            table
            for table in PROJECTION_TABLES
            if await conn.fetchval("SELECT to_regclass($1)", f"{schema}.{_ident(table)}")
        ]
        for table in present:
            # Readers finish first; new readers wait the few milliseconds the swap takes.
            await conn.execute(f"LOCK TABLE {schema}.{_ident(table)} IN ACCESS EXCLUSIVE MODE")
        for table in present:
            await conn.execute(f"ALTER TABLE {schema}.{_ident(table)} SET SCHEMA {OLD_SCHEMA}")
        for table in PROJECTION_TABLES:
            await conn.execute(f"ALTER TABLE {REBUILD_SCHEMA}.{_ident(table)} SET SCHEMA {schema}")
        await conn.execute(f"DROP SCHEMA {OLD_SCHEMA} CASCADE")
        await conn.execute(f"DROP SCHEMA {REBUILD_SCHEMA} CASCADE")
