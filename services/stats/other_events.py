"""Applying the events that are not a task's: workers, aliases, exclusions, quality, bench.

Each runs in the projection's transaction, after the batch's pending task rows are written,
so it sees the tables as they were at its position. It adds the figure keys whose figures it
may have changed to ``touched`` and keeps ``aliases`` (the batch's alias map) current: alias
changes re-key ``outcomes`` and ``bench_results`` (old figures move to the canonical name).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Final

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
    WakeRequested,
    WorkerAsleep,
    WorkerDuplicate,
    WorkerRegistered,
    WorkerStopped,
)
from services.fleet.aliases import resolve
from services.stats.rows import Connection, FigureKey, clean, timestamp

if TYPE_CHECKING:
    from asyncpg import Record

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


async def apply_other(
    conn: Connection,
    seq: int,
    event: AnyEvent,
    *,
    aliases: dict[str, str],
    touched: set[FigureKey],
) -> None:
    """Apply one event that is not a task's, at stream position ``seq``."""
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
            aliases[event.alias] = event.canonical
            await _rekey(conn, aliases, touched)
        case AliasRemoved():
            await conn.execute("DELETE FROM aliases WHERE alias = $1", event.alias)
            aliases.pop(event.alias, None)
            await _rekey(conn, aliases, touched)
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
                touched.update(_keys(await conn.fetch(_KEYS_OF_WORKER, event.worker)))
        case ExclusionWithdrawn():
            worker = await conn.fetchval(
                "UPDATE exclusions SET withdrawn_at = $2, withdraw_reason = $3 "
                "WHERE exclusion_id = $1 AND withdrawn_at IS NULL RETURNING worker",
                event.exclusion_id,
                timestamp(event.at),
                clean(event.reason),
            )
            if worker is not None:
                touched.update(_keys(await conn.fetch(_KEYS_OF_WORKER, worker)))
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
                touched.update(
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
                clean(resolve(aliases, event.model)),
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
            raise AssertionError(f"not a non-task event: {event!r}")  # task events: projector


async def _rekey(conn: Connection, aliases: dict[str, str], touched: set[FigureKey]) -> None:
    """Key every outcome and bench result by its canonical name under ``aliases``."""
    for row in await conn.fetch("SELECT DISTINCT raw_model, model FROM outcomes"):
        target = resolve(aliases, row["raw_model"])
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
            touched.add((old, domain, worker))
            touched.add((target, domain, worker))
    for row in await conn.fetch("SELECT DISTINCT raw_model, model FROM bench_results"):
        target = resolve(aliases, row["raw_model"])
        if target != row["model"]:
            await conn.execute(
                "UPDATE bench_results SET model = $2 WHERE raw_model = $1",
                row["raw_model"],
                target,
            )


def _keys(rows: Sequence[Record]) -> set[FigureKey]:
    return {(r["model"], r["domain"], r["worker"]) for r in rows}
