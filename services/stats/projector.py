"""Applying events to the read model's tables, on one connection inside the caller's transaction.

The live projection (`store.Store.apply_batch`) and the rebuild (`rebuild.py`) share this
code, so a rebuild produces exactly the tables the live projection would have: the tables are a
function of the event log. The connection's ``search_path`` says which tables: the live ones,
or the fresh ones a rebuild fills in the schema ``stats_next``.

A batch is applied in stream order:

1. The tracking rows ``('tasks', stream_seq)`` go in first; positions already there were
   applied before (a redelivery) and are skipped.
2. Task events are folded into the task rows with the pure `projection.evolve`, in memory; an
   attempt that ends adds a row to ``outcomes`` (model keyed by its canonical name).
3. Any other event first writes the pending task rows, so it sees the tables as they were at
   its position: worker events update ``workers_seen``; alias changes re-key ``outcomes`` and
   ``bench_results`` (old figures move to the canonical name); exclusions and quality
   verdicts are recorded; bench events fill ``bench_runs`` and ``bench_results``.
4. The figures of every (model, domain, worker) touched are recomputed from ``outcomes``,
   ``exclusions`` and ``quality`` (a rebuild does this once, at the end, for all keys).

Exclusions and aliases thus apply to history as well as to what comes after them, live and on
a rebuild alike.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Final, TypeAlias

import asyncpg
from asyncpg import Record

from schemas.events import (
    AliasRemoved,
    AliasSet,
    AnyEvent,
    BenchFinished,
    BenchResult,
    BenchStarted,
    ExclusionAdded,
    ExclusionWithdrawn,
    QualityScored,
    TaskCompleted,
    TaskFailed,
    TaskRouted,
    TaskStarted,
    TaskSubmitted,
    WakeRequested,
    WorkerAsleep,
    WorkerDuplicate,
    WorkerRegistered,
    WorkerStopped,
)
from schemas.stats import RECENT_WINDOW
from services.fleet.aliases import resolve
from services.stats.projection import Outcome, TaskState, evolve, outcome_of

# Anything asyncpg's pool or a plain connection hands out.
Connection: TypeAlias = "asyncpg.Connection[Record] | asyncpg.pool.PoolConnectionProxy[Record]"
FigureKey: TypeAlias = tuple[str, str, str]
"""(model, domain, worker) of a figure."""

# The name this projection's rows carry in ``projection_tracking``.
TASKS_PROJECTION: Final = "tasks"

# Every table of the read model, in the order a rebuild moves them. schema.sql creates them.
PROJECTION_TABLES: Final = (
    "tasks",
    "outcomes",
    "exclusions",
    "aliases",
    "quality",
    "figures",
    "bench_runs",
    "bench_results",
    "projection_tracking",
    "workers_seen",
)

# Advisory lock held shared by every live batch and exclusively by a rebuild while it catches
# up and swaps the tables in: no live write can fall between the rebuild's last event and the
# swap (see rebuild.py).
PROJECTION_LOCK: Final = 7_301_002

# Advisory lock space for task rows: concurrent writers (two stats instances) serialise on
# a task instead of racing on a row that does not exist yet.
TASK_LOCK_SPACE: Final = 7_301

TASK_EVENTS = (TaskSubmitted, TaskRouted, TaskStarted, TaskCompleted, TaskFailed)

TASK_COLUMNS: Final = tuple(f.name for f in dataclasses.fields(TaskState))
_TIMESTAMP_COLUMNS: Final = frozenset({"created_at", "started_at", "ended_at"})

SELECT_TASK: Final = f"SELECT {', '.join(TASK_COLUMNS)} FROM tasks WHERE task_id = $1"
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
_WORKER_REGISTERED: Final = """
INSERT INTO workers_seen (worker_id, host, instance_id, models, supports, version,
                          registered_at, stopped_at, stop_reason, updated_seq)
VALUES ($1, $2, $3, $4, $5, $6, $7, NULL, NULL, $8)
ON CONFLICT (worker_id) DO UPDATE SET
    host = EXCLUDED.host, instance_id = EXCLUDED.instance_id, models = EXCLUDED.models,
    supports = EXCLUDED.supports, version = EXCLUDED.version,
    registered_at = EXCLUDED.registered_at, stopped_at = NULL, stop_reason = NULL,
    updated_seq = EXCLUDED.updated_seq
"""
# Only the instance that registered may mark the worker stopped: a late `stopped` of an old
# instance must not hide the one running now.
_WORKER_STOPPED: Final = """
UPDATE workers_seen SET stopped_at = $3, stop_reason = $4, updated_seq = $5
WHERE worker_id = $1 AND instance_id = $2
"""
_KEYS_OF_WORKER: Final = "SELECT DISTINCT model, domain, worker FROM outcomes WHERE worker = $1"

# An outcome counts unless an active exclusion covers it.
NOT_EXCLUDED: Final = """NOT EXISTS (
    SELECT 1 FROM exclusions e
    WHERE e.withdrawn_at IS NULL AND e.worker = {row}.worker
      AND (e.model IS NULL OR e.model = {row}.model OR e.model = {row}.raw_model)
      AND {row}.{at} >= e.since AND (e.until IS NULL OR {row}.{at} < e.until))"""

FIGURE_COLUMNS: Final = (
    "model",
    "domain",
    "worker",
    "count",
    "failures",
    "mean_ms",
    "p50_ms",
    "p95_ms",
    "load_ms_mean",
    "load_ms_p50",
    "warm_p50_ms",
    "tokens_per_s",
    "first_token_ms_p50",
    "quality_mean",
    "quality_count",
    "recent_count",
    "recent_failures",
    "last_at",
)
# $1 is the recent window; with keys, $2-$4 are the models, domains and workers.
_FIGURES_INSERT: Final = f"""
WITH kept AS (
    SELECT o.* FROM outcomes o
    WHERE {{keys}} AND {NOT_EXCLUDED.format(row="o", at="ended_at")}
), ranked AS (
    SELECT kept.*, row_number() OVER (
        PARTITION BY model, domain, worker ORDER BY ended_at DESC, stream_seq DESC
    ) AS recency
    FROM kept
), judged AS (
    SELECT k.model, k.domain, k.worker, avg(q.score) AS quality_mean, count(*) AS quality_count
    FROM quality q JOIN kept k ON k.task_id = q.task_id AND k.attempt = q.attempt
    WHERE q.score IS NOT NULL
    GROUP BY k.model, k.domain, k.worker
)
INSERT INTO figures ({", ".join(FIGURE_COLUMNS)})
SELECT r.model, r.domain, r.worker,
    count(*),
    count(*) FILTER (WHERE NOT r.ok),
    avg(r.total_ms) FILTER (WHERE r.ok),
    percentile_cont(0.5) WITHIN GROUP (ORDER BY r.total_ms) FILTER (WHERE r.ok),
    percentile_cont(0.95) WITHIN GROUP (ORDER BY r.total_ms) FILTER (WHERE r.ok),
    avg(r.load_ms) FILTER (WHERE r.ok),
    percentile_cont(0.5) WITHIN GROUP (ORDER BY r.load_ms) FILTER (WHERE r.ok),
    percentile_cont(0.5) WITHIN GROUP (ORDER BY r.total_ms - coalesce(r.load_ms, 0))
        FILTER (WHERE r.ok),
    sum(r.eval_tokens) FILTER (WHERE r.ok AND r.eval_ms > 0 AND r.eval_tokens IS NOT NULL)
        * 1000.0
        / nullif(sum(r.eval_ms)
                 FILTER (WHERE r.ok AND r.eval_ms > 0 AND r.eval_tokens IS NOT NULL), 0),
    percentile_cont(0.5) WITHIN GROUP (ORDER BY r.first_token_ms) FILTER (WHERE r.ok),
    max(j.quality_mean),
    coalesce(max(j.quality_count), 0),
    count(*) FILTER (WHERE r.recency <= $1),
    count(*) FILTER (WHERE r.recency <= $1 AND NOT r.ok),
    max(r.ended_at)
FROM ranked r LEFT JOIN judged j
    ON j.model = r.model AND j.domain = r.domain AND j.worker = r.worker
GROUP BY r.model, r.domain, r.worker
"""
_KEYS_MATCH: Final = (
    "({alias}.model, {alias}.domain, {alias}.worker) IN "
    "(SELECT * FROM unnest(${first}::text[], ${second}::text[], ${third}::text[]))"
)
_REFRESH_KEYS_DELETE: Final = "DELETE FROM figures f WHERE " + _KEYS_MATCH.format(
    alias="f", first=1, second=2, third=3
)
_REFRESH_KEYS_INSERT: Final = _FIGURES_INSERT.replace(
    "{keys}", _KEYS_MATCH.format(alias="o", first=2, second=3, third=4)
)
_REFRESH_ALL_INSERT: Final = _FIGURES_INSERT.replace("{keys}", "true")


@dataclass
class Projected:
    """What applying a batch did."""

    applied: int = 0
    """Positions applied for the first time."""
    fresh: set[int] = field(default_factory=set)
    """Those positions."""
    duplicates: int = 0
    """Positions applied before (redeliveries): nothing changed."""
    touched: set[FigureKey] = field(default_factory=set)
    """Figure keys whose figures may have changed."""


async def project(
    conn: Connection,
    items: Sequence[tuple[int, AnyEvent]],
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
    rows = await conn.fetch(_TRACK, TASKS_PROJECTION, [seq for seq, _ in items])
    fresh = result.fresh = {row[0] for row in rows}
    todo = [(seq, event) for seq, event in items if seq in fresh]
    result.applied = len(todo)
    result.duplicates = len(items) - len(todo)
    if not todo:
        return result

    batch = _Batch(conn, result.touched)
    task_ids = sorted({e.task_id for _, e in todo if isinstance(e, TASK_EVENTS)})
    if task_ids:
        if lock_tasks:
            await conn.execute(_LOCK_TASKS, TASK_LOCK_SPACE, task_ids)
        for row in await conn.fetch(_SELECT_TASKS, task_ids):
            batch.states[row["task_id"]] = state_from_row(row)
    batch.aliases = await load_aliases(conn)

    for seq, event in todo:
        if isinstance(event, TASK_EVENTS):
            before = batch.states.get(event.task_id)
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
            await _apply_other(batch, seq, event)
    await batch.flush()
    return result


async def refresh_figures(conn: Connection, keys: set[FigureKey] | None = None) -> None:
    """Recompute the figures of ``keys`` (every key when None) from the facts tables."""
    if keys is None:
        await conn.execute("DELETE FROM figures")
        await conn.execute(_REFRESH_ALL_INSERT, RECENT_WINDOW)
        return
    if not keys:
        return
    models, domains, workers = (list(column) for column in zip(*sorted(keys), strict=True))
    await conn.execute(_REFRESH_KEYS_DELETE, models, domains, workers)
    await conn.execute(_REFRESH_KEYS_INSERT, RECENT_WINDOW, models, domains, workers)


async def load_aliases(conn: Connection) -> dict[str, str]:
    """The alias map as the tables hold it (alias → the name it was set to)."""
    return {row["alias"]: row["canonical"] for row in await conn.fetch(_ALIASES)}


_ALIASES: Final = "SELECT alias, canonical FROM aliases"


@dataclass
class _Batch:
    """Task rows and outcomes waiting to be written, plus what the batch has seen."""

    conn: Connection
    touched: set[FigureKey]
    states: dict[str, TaskState] = field(default_factory=dict)
    task_rows: dict[str, tuple[TaskState, int]] = field(default_factory=dict)
    outcomes: list[tuple[Outcome, int]] = field(default_factory=list)
    aliases: dict[str, str] = field(default_factory=dict)

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
                values.append(_outcome_values(outcome, model, seq))
            await self.conn.executemany(_INSERT_OUTCOME, values)
            self.outcomes.clear()


async def _apply_other(batch: _Batch, seq: int, event: AnyEvent) -> None:
    conn = batch.conn
    match event:
        case WorkerRegistered():
            await conn.execute(
                _WORKER_REGISTERED,
                event.worker_id,
                clean(event.host),
                event.instance_id,
                [clean(m) for m in event.models],
                [clean(s) for s in event.supports],
                clean(event.version),
                timestamp(event.at),
                seq,
            )
        case WorkerStopped():
            await conn.execute(
                _WORKER_STOPPED,
                event.worker_id,
                event.instance_id,
                timestamp(event.at),
                clean(event.reason),
                seq,
            )
        case AliasSet():
            await conn.execute(
                "INSERT INTO aliases (alias, canonical, set_at, stream_seq) "
                "VALUES ($1, $2, $3, $4) ON CONFLICT (alias) DO UPDATE SET "
                "canonical = EXCLUDED.canonical, set_at = EXCLUDED.set_at, "
                "stream_seq = EXCLUDED.stream_seq",
                clean(event.alias),
                clean(event.canonical),
                timestamp(event.at),
                seq,
            )
            batch.aliases[event.alias] = event.canonical
            await _rekey(batch)
        case AliasRemoved():
            await conn.execute("DELETE FROM aliases WHERE alias = $1", event.alias)
            batch.aliases.pop(event.alias, None)
            await _rekey(batch)
        case ExclusionAdded():
            inserted = await conn.fetchval(
                "INSERT INTO exclusions (exclusion_id, worker, model, since, until, reason, "
                "added_at, stream_seq) VALUES ($1, $2, $3, $4, $5, $6, $7, $8) "
                "ON CONFLICT (exclusion_id) DO NOTHING RETURNING true",
                event.exclusion_id,
                clean(event.worker),
                clean(event.model) if event.model is not None else None,
                timestamp(event.since),
                timestamp(event.until) if event.until is not None else None,
                clean(event.reason),
                timestamp(event.at),
                seq,
            )
            if inserted:
                batch.touched.update(_keys(await conn.fetch(_KEYS_OF_WORKER, event.worker)))
        case ExclusionWithdrawn():
            worker = await conn.fetchval(
                "UPDATE exclusions SET withdrawn_at = $2, withdraw_reason = $3 "
                "WHERE exclusion_id = $1 AND withdrawn_at IS NULL RETURNING worker",
                event.exclusion_id,
                timestamp(event.at),
                clean(event.reason),
            )
            if worker is not None:
                batch.touched.update(_keys(await conn.fetch(_KEYS_OF_WORKER, worker)))
        case QualityScored():
            inserted = await conn.fetchval(
                "INSERT INTO quality (task_id, attempt, verdict, score, rubric, judge_model, "
                "judge_host, text, reason, scored_at, stream_seq) "
                "VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11) "
                "ON CONFLICT (task_id) DO NOTHING RETURNING true",
                event.task_id,
                event.attempt,
                event.verdict,
                event.score if event.verdict == "scored" else None,
                clean(event.rubric),
                clean(event.judge_model),
                clean(event.judge_host),
                clean(event.text),
                clean(event.reason),
                timestamp(event.at),
                seq,
            )
            if inserted:
                batch.touched.update(
                    _keys(
                        await conn.fetch(
                            "SELECT model, domain, worker FROM outcomes "
                            "WHERE task_id = $1 AND attempt = $2",
                            event.task_id,
                            event.attempt,
                        )
                    )
                )
        case BenchStarted():
            await conn.execute(
                "INSERT INTO bench_runs (run_id, started_at, models, workers, prompts, "
                "stream_seq) VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT (run_id) DO NOTHING",
                event.run_id,
                timestamp(event.at),
                [clean(m) for m in event.models],
                [clean(w) for w in event.workers],
                event.prompts,
                seq,
            )
        case BenchResult():
            await conn.execute(
                "INSERT INTO bench_results (run_id, result_index, model, raw_model, worker, "
                "domain, prompt_key, prompt_name, ok, task_id, total_ms, load_ms, error, at, "
                "stream_seq) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, "
                "$14, $15) ON CONFLICT (run_id, result_index) DO NOTHING",
                event.run_id,
                event.index,
                clean(resolve(batch.aliases, event.model)),
                clean(event.model),
                clean(event.worker),
                clean(event.domain),
                clean(event.prompt_key),
                clean(event.prompt_name),
                event.ok,
                event.task_id,
                event.total_ms,
                event.load_ms,
                clean(event.error) if event.error is not None else None,
                timestamp(event.at),
                seq,
            )
        case BenchFinished():
            # A run whose start was not recorded (cut log) still gets its row.
            await conn.execute(
                "INSERT INTO bench_runs (run_id, started_at, finished_at, ok, failed, slow, "
                "stream_seq) VALUES ($1, $2, $2, $3, $4, $5, $6) ON CONFLICT (run_id) DO UPDATE "
                "SET finished_at = EXCLUDED.finished_at, ok = EXCLUDED.ok, "
                "failed = EXCLUDED.failed, slow = EXCLUDED.slow",
                event.run_id,
                timestamp(event.at),
                event.ok,
                event.failed,
                [clean(s) for s in event.slow],
                seq,
            )
        case WorkerAsleep() | WakeRequested() | WorkerDuplicate():
            pass  # facts for the router and for people; nothing in the read model
        case _:
            raise AssertionError(f"not a non-task event: {event!r}")  # task events: project()


async def _rekey(batch: _Batch) -> None:
    """Key every outcome and bench result by its canonical name under the current aliases."""
    conn = batch.conn
    for row in await conn.fetch("SELECT DISTINCT raw_model, model FROM outcomes"):
        target = resolve(batch.aliases, row["raw_model"])
        if target == row["model"]:
            continue
        moved = await conn.fetch(
            "UPDATE outcomes o SET model = $2 FROM (SELECT task_id, attempt, model AS old "
            "FROM outcomes WHERE raw_model = $1 AND model <> $2) AS before "
            "WHERE o.task_id = before.task_id AND o.attempt = before.attempt "
            "RETURNING before.old, o.domain, o.worker",
            row["raw_model"],
            target,
        )
        for old, domain, worker in moved:
            batch.touched.add((old, domain, worker))
            batch.touched.add((target, domain, worker))
    for row in await conn.fetch("SELECT DISTINCT raw_model, model FROM bench_results"):
        target = resolve(batch.aliases, row["raw_model"])
        if target != row["model"]:
            await conn.execute(
                "UPDATE bench_results SET model = $2 WHERE raw_model = $1",
                row["raw_model"],
                target,
            )


def _keys(rows: Sequence[Record]) -> set[FigureKey]:
    return {(r["model"], r["domain"], r["worker"]) for r in rows}


def clean(value: str) -> str:
    """PostgreSQL text cannot hold NUL; a backend's output sometimes does."""
    return value.replace("\x00", "\ufffd")


def timestamp(at: float) -> datetime:
    return datetime.fromtimestamp(at, tz=UTC)


def row_from_state(state: TaskState) -> list[Any]:
    """The ``tasks`` columns of a state, in `TASK_COLUMNS` order."""
    values: list[Any] = []
    for name in TASK_COLUMNS:
        value = getattr(state, name)
        if name in _TIMESTAMP_COLUMNS and value is not None:
            value = timestamp(value)
        elif isinstance(value, str):
            value = clean(value)
        values.append(value)
    return values


def state_from_row(row: Record) -> TaskState:
    """A `TaskState` from a ``tasks`` row."""
    fields: dict[str, Any] = {}
    for name in TASK_COLUMNS:
        value = row[name]
        if name in _TIMESTAMP_COLUMNS and value is not None:
            value = value.timestamp()
        fields[name] = value
    return TaskState(**fields)


def _outcome_values(outcome: Outcome, model: str, seq: int) -> tuple[Any, ...]:
    return (
        outcome.task_id,
        outcome.attempt,
        clean(model),
        clean(outcome.model),
        clean(outcome.domain),
        clean(outcome.worker),
        outcome.ok,
        outcome.total_ms,
        outcome.load_ms,
        outcome.eval_ms,
        outcome.eval_tokens,
        outcome.first_token_ms,
        timestamp(outcome.ended_at),
        seq,
    )
