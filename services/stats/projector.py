"""Applying events to the read model's tables, on one connection inside the caller's transaction.

The live projection (`store.Store.apply_batch`) and the rebuild (`rebuild.py`) share this
code, so a rebuild produces exactly the tables the live projection would have: the tables are a
function of the event log. The connection's ``search_path`` says which tables: the live ones,
or the fresh ones a rebuild fills in the schema ``stats_next``.

A batch is applied in stream order:

1. The tracking rows ``('tasks', stream_seq, digest)`` go in first (`track`); a position
   already there with the same event was applied before (a redelivery) and is skipped; one
   there with another event means ``EVENTS`` was recreated or restored from an older copy:
   the rows from there on are set aside and the events applied (`tracking.sort_positions`).
2. Task events are folded into the task rows with the pure `projection.evolve`, in memory; an
   attempt that ends adds a row to ``outcomes`` (model keyed by its canonical name). A
   worker's event that its recorder may not give (`services.fleet.binding`: not where the
   attempt was routed) is logged and changes nothing.
3. Any other event first writes the pending task rows, so it sees the tables as they were at
   its position (`other_events`): worker events update ``workers_seen``; alias changes re-key
   ``outcomes`` and ``bench_results`` (old figures move to the canonical name); exclusions and
   quality verdicts are recorded; bench events fill ``bench_runs`` and ``bench_results``.
4. The figures of every (model, domain, worker) touched are recomputed from ``outcomes``,
   ``exclusions`` and ``quality`` (`figure_rows`; a rebuild does this once, at the end, for
   all keys). The tables' names, locks and row shapes are in `rows`.

Exclusions and aliases thus apply to history as well as to what comes after them, live and on
a rebuild alike.

An event that decodes but cannot be applied (`tracking.parks` says which) is recorded instead
(`park`: its tracking row and a ``parked_events`` row), so it is never tried for ever and
never holds up the events after it.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Final, NamedTuple

import structlog

from schemas.events import (
    AnyEvent,
    TaskCompleted,
    TaskFailed,
    TaskRouted,
    TaskStarted,
    TaskSubmitted,
    WorkerRegistered,
    any_event_decoder,
    encoder,
    kind_of,
    subject_for,
)
from schemas.subjects import EVENTS_STREAM, task_event_source
from services.fleet.aliases import resolve
from services.fleet.binding import refusal
from services.stats.other_events import apply_other
from services.stats.projection import Outcome, TaskState, evolve, outcome_of, routing
from services.stats.rows import (
    TASK_COLUMNS,
    TASK_LOCK_SPACE,
    TASKS_PROJECTION,
    Connection,
    FigureKey,
    clean,
    outcome_values,
    row_from_state,
    state_from_row,
)
from services.stats.tracking import Positions, event_digest, sort_positions

log = structlog.get_logger("stats")

TASK_EVENTS = (TaskSubmitted, TaskRouted, TaskStarted, TaskCompleted, TaskFailed)
WORKERS_EVENTS = (TaskStarted, TaskCompleted, TaskFailed)


class Item(NamedTuple):
    """One event to apply: its stream position, itself, its subject, and what identifies it at
    that position (`tracking.event_digest`)."""

    seq: int
    event: AnyEvent
    subject: str
    digest: bytes

    @property
    def source(self) -> str | None:
        """The worker its subject names (`schemas.subjects.task_event_source`; None for
        anything else)."""
        return task_event_source(self.subject)


def item_of(seq: int, subject: str, data: bytes) -> Item:
    """The event a stream message holds, at its position; raises `msgspec.DecodeError` when
    it is not a known event."""
    return Item(seq, any_event_decoder.decode(data), subject, event_digest(subject, data))


def item_for(seq: int, event: AnyEvent, source: str | None = None) -> Item:
    """``event`` at ``seq`` as it is published (`schemas.events.subject_for`, by ``source``):
    for an event not read from the stream."""
    subject = subject_for(event, source)
    return Item(seq, event, subject, event_digest(subject, encoder.encode(event)))


_SELECT_TASKS: Final = (
    f"SELECT {', '.join(TASK_COLUMNS)} FROM tasks WHERE task_id = ANY($1::text[]) FOR UPDATE"
)
_UPSERT_TASK: Final = (
    f"INSERT INTO tasks ({', '.join(TASK_COLUMNS)}, updated_seq) "
    f"VALUES ({', '.join(f'${i}' for i in range(1, len(TASK_COLUMNS) + 2))}) "
    "ON CONFLICT (task_id) DO UPDATE SET "
    + ", ".join(f"{c} = EXCLUDED.{c}" for c in (*TASK_COLUMNS[1:], "updated_seq"))
)
_LOCK_TASKS: Final = """
SELECT pg_advisory_xact_lock($1, hashtext(t))
FROM (SELECT DISTINCT t FROM unnest($2::text[]) AS t ORDER BY t) AS ordered
"""
_TRACK: Final = """
INSERT INTO projection_tracking (projection, stream_seq, digest)
SELECT $1, seq, digest FROM unnest($2::bigint[], $3::bytea[]) AS incoming (seq, digest)
ON CONFLICT DO NOTHING
RETURNING stream_seq
"""
_TRACKED: Final = """
SELECT stream_seq, digest FROM projection_tracking
WHERE projection = $1 AND stream_seq = ANY($2::bigint[])
"""
# The rows of events the log no longer holds at their positions, moved aside (but for those
# the batch has just written).
_SET_ASIDE: Final = """
WITH moved AS (
    DELETE FROM projection_tracking
    WHERE projection = $1 AND stream_seq >= $2 AND NOT (stream_seq = ANY($3::bigint[]))
    RETURNING stream_seq, digest
)
INSERT INTO replaced_tracking (projection, stream_seq, digest, replaced_from, replaced_at)
SELECT $1, stream_seq, digest, $2, now() FROM moved
"""
_PARK: Final = """
INSERT INTO parked_events (stream, stream_seq, digest, subject, kind, error, parked_at)
VALUES ($1, $2, $3, $4, $5, $6, now())
ON CONFLICT DO NOTHING
"""
# A parked event's error, as recorded: enough to say what went wrong.
PARKED_ERROR_CHARS: Final = 2000
_INSERT_OUTCOME: Final = """
INSERT INTO outcomes (task_id, attempt, model, raw_model, domain, worker, ok, total_ms, load_ms,
                      eval_ms, eval_tokens, first_token_ms, ended_at, stream_seq)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14)
ON CONFLICT (task_id, attempt) DO NOTHING
"""


@dataclass
class Projected:
    """What applying a batch did."""

    applied: int = 0
    """Positions applied for the first time."""
    fresh: set[int] = field(default_factory=set)
    """Those positions."""
    duplicates: int = 0
    """Positions applied before (redeliveries): nothing changed."""
    refused: int = 0
    """Workers' task events their recorder may not give (`services.fleet.binding`): logged,
    nothing changed."""
    touched: set[FigureKey] = field(default_factory=set)
    """Figure keys whose figures may have changed."""


async def project(
    conn: Connection,
    items: Sequence[Item],
    *,
    lock_tasks: bool = True,
) -> Projected:
    """Apply ``items`` (stream position, event) in order, each position at most once.

    Runs in the caller's transaction. ``lock_tasks`` takes an advisory lock per task (live
    projection, where several writers may run). The figures of the keys it touched
    (``touched``) are left to `refresh_figures`: the live projection recomputes them at most
    once a second, a rebuild all of them at the end.
    """
    result = Projected()
    if not items:
        return result
    positions = await track(conn, items)
    todo = [item for item, fresh in zip(items, positions.fresh, strict=True) if fresh]
    result.fresh = {item.seq for item in todo}
    result.applied = len(todo)
    result.duplicates = len(items) - len(todo)
    if not todo:
        return result

    batch = _Batch(conn, result.touched)
    task_ids = sorted({i.event.task_id for i in todo if isinstance(i.event, TASK_EVENTS)})
    if task_ids:
        if lock_tasks:
            await conn.execute(_LOCK_TASKS, TASK_LOCK_SPACE, task_ids)
        for row in await conn.fetch(_SELECT_TASKS, task_ids):
            batch.states[row["task_id"]] = state_from_row(row)
    batch.aliases = await load_aliases(conn)
    if any(i.source is not None for i in todo):
        batch.supports = await load_supports(conn)

    for item in todo:
        seq, event, source = item.seq, item.event, item.source
        if isinstance(event, TASK_EVENTS):
            before = batch.states.get(event.task_id)
            if isinstance(event, WORKERS_EVENTS):
                problem = refusal(event, source, routing(before), batch.supports.get)
                if problem is not None:
                    log.warning("task event refused", task_id=event.task_id, problem=problem)
                    result.refused += 1
                    continue
            after = evolve(before, event)
            if after is before:
                continue
            batch.states[event.task_id] = after
            batch.task_rows[event.task_id] = (after, seq)
            outcome = outcome_of(before, after)
            if outcome is not None:
                batch.outcomes.append((outcome, seq))
        else:
            await batch.flush()
            await apply_other(batch.conn, seq, event, aliases=batch.aliases, touched=batch.touched)
            if isinstance(event, WorkerRegistered):
                batch.supports[event.worker_id] = event.supports
    await batch.flush()
    return result


async def track(conn: Connection, items: Sequence[Item]) -> Positions:
    """Write the tracking rows of ``items`` and say which are fresh (`tracking.sort_positions`);
    when the log holds other events than the ones applied, set the rows from there on aside
    first. In the caller's transaction."""
    seqs = [item.seq for item in items]
    written = {row[0] for row in await conn.fetch(_TRACK, TASKS_PROJECTION, seqs, _digests(items))}
    if len(written) == len(items):
        return Positions((True,) * len(items))
    others = [seq for seq in seqs if seq not in written]
    tracked = {row[0]: row[1] for row in await conn.fetch(_TRACKED, TASKS_PROJECTION, others)}
    positions = sort_positions([(i.seq, i.digest) for i in items], written, tracked)
    replaced_from = positions.replaced_from
    if replaced_from is not None:
        set_aside = await conn.execute(_SET_ASIDE, TASKS_PROJECTION, replaced_from, list(written))
        log.warning(
            "the event log holds other events than the ones applied from here on (EVENTS was "
            "recreated, or restored from an older copy): their tracking rows are set aside and "
            "the log's events applied; what the old ones counted stays until a rebuild",
            from_seq=replaced_from,
            set_aside=int(set_aside.split()[-1]),
        )
        renewed = [i for i in items if i.seq >= replaced_from and i.seq not in written]
        await conn.execute(_TRACK, TASKS_PROJECTION, [i.seq for i in renewed], _digests(renewed))
    return positions


def _digests(items: Sequence[Item]) -> list[bytes]:
    return [item.digest for item in items]


async def park(conn: Connection, item: Item, error: str, stream: str = EVENTS_STREAM) -> bool:
    """Record ``item`` as parked (it cannot be applied: ``error``) with its tracking row, so
    that it is handled, once; False when its position was handled before. In the caller's
    transaction."""
    if not (await track(conn, [item])).fresh[0]:
        return False
    await conn.execute(
        _PARK,
        stream,
        item.seq,
        item.digest,
        clean(item.subject),
        kind_of(item.event),
        clean(error)[:PARKED_ERROR_CHARS],
    )
    return True


async def load_aliases(conn: Connection) -> dict[str, str]:
    """The alias map as the tables hold it (alias → the name it was set to)."""
    return {row["alias"]: row["canonical"] for row in await conn.fetch(_ALIASES)}


_ALIASES: Final = "SELECT alias, canonical FROM aliases"


async def load_supports(conn: Connection) -> dict[str, Collection[str]]:
    """What each worker ever registered supports, as of its latest registration."""
    return {row["worker_id"]: row["supports"] for row in await conn.fetch(_SUPPORTS)}


_SUPPORTS: Final = "SELECT worker_id, supports FROM workers_seen"


@dataclass
class _Batch:
    """Task rows and outcomes waiting to be written, plus what the batch has seen."""

    conn: Connection
    touched: set[FigureKey]
    states: dict[str, TaskState] = field(default_factory=dict)
    task_rows: dict[str, tuple[TaskState, int]] = field(default_factory=dict)
    outcomes: list[tuple[Outcome, int]] = field(default_factory=list)
    aliases: dict[str, str] = field(default_factory=dict)
    supports: dict[str, Collection[str]] = field(default_factory=dict)

    async def flush(self) -> None:
        if self.task_rows:
            await self.conn.executemany(
                _UPSERT_TASK,
                [(*row_from_state(state), seq) for state, seq in self.task_rows.values()],
            )
            self.task_rows.clear()
        if self.outcomes:
            values = []
            for outcome, seq in self.outcomes:
                model = resolve(self.aliases, outcome.model)
                self.touched.add((model, outcome.domain, outcome.worker))
                values.append(outcome_values(outcome, model, seq))
            await self.conn.executemany(_INSERT_OUTCOME, values)
            self.outcomes.clear()
