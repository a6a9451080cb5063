"""Applying events to the read model's tables, on one connection inside the caller's transaction.

The live projection (`store.Store.apply_batch`) and the rebuild (`rebuild.py`) share this
code, so a rebuild produces exactly the tables the live projection would have: the tables are a
function of the event log. The connection's ``search_path`` says which tables: the live ones,
or the fresh ones a rebuild fills in the schema ``stats_next``.

A batch is applied in stream order:

1. The tracking rows ``('tasks', stream_seq)`` go in first; positions already there were
   applied before (a redelivery) and are skipped.
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
)
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
    outcome_values,
    row_from_state,
    state_from_row,
)

log = structlog.get_logger("stats")

TASK_EVENTS = (TaskSubmitted, TaskRouted, TaskStarted, TaskCompleted, TaskFailed)
WORKERS_EVENTS = (TaskStarted, TaskCompleted, TaskFailed)


class Item(NamedTuple):
    """One event to apply: its stream position, itself, and the worker its subject names
    (`schemas.subjects.task_event_source`; None for anything else)."""

    seq: int
    event: AnyEvent
    source: str | None = None


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
INSERT INTO projection_tracking (projection, stream_seq)
SELECT $1, unnest($2::bigint[])
ON CONFLICT DO NOTHING
RETURNING stream_seq
"""
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
    rows = await conn.fetch(_TRACK, TASKS_PROJECTION, [item.seq for item in items])
    fresh = result.fresh = {row[0] for row in rows}
    todo = [item for item in items if item.seq in fresh]
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

    for seq, event, source in todo:
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
