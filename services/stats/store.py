"""The stats read model in PostgreSQL (asyncpg): apply events once, answer queries.

Every event is applied in one transaction together with its tracking row
``('tasks', stream_seq)``; the pair is a primary key, so an event delivered twice is recognised
and changes nothing. The state logic itself is the pure `projection.evolve`.

Database failures leave this module as the project's own errors: `Unavailable` when retrying
may help (connection lost, server restarting, timeouts, any other server error), `Unstorable`
when this event's data can never be stored (SQLSTATE class 22 data exception or 23 integrity
violation), so the caller can retry the one and set the other aside.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import msgspec
from asyncpg import Record
from asyncpg.pool import PoolConnectionProxy

from schemas.events import (
    AliasRemoved,
    AliasSet,
    AnyEvent,
    TaskEvent,
    WorkerRegistered,
    WorkerStopped,
)
from schemas.queries import TaskView
from services.runtime.errors import CoordinatorError, Unavailable
from services.stats.projection import FigureDelta, TaskState, evolve, figures_delta, to_view

SCHEMA_PATH: Final = Path(__file__).resolve().parents[2] / "deploy/postgres/schema.sql"

# The name this projection's rows carry in ``projection_tracking``.
TASKS_PROJECTION: Final = "tasks"

# Advisory-lock namespaces, so concurrent writers (two stats instances, a schema apply at
# start) serialise instead of racing on rows that do not exist yet.
_SCHEMA_LOCK: Final = 7_301_001
_TASK_LOCK_SPACE: Final = 7_301

_TASK_COLUMNS: Final = tuple(field.name for field in dataclasses.fields(TaskState))
_TIMESTAMP_COLUMNS: Final = frozenset({"created_at", "started_at", "ended_at"})

_SELECT_TASK: Final = f"SELECT {', '.join(_TASK_COLUMNS)} FROM tasks WHERE task_id = $1"
_UPSERT_TASK: Final = (
    f"INSERT INTO tasks ({', '.join(_TASK_COLUMNS)}, updated_seq) "
    f"VALUES ({', '.join(f'${i}' for i in range(1, len(_TASK_COLUMNS) + 2))}) "
    "ON CONFLICT (task_id) DO UPDATE SET "
    + ", ".join(f"{c} = EXCLUDED.{c}" for c in (*_TASK_COLUMNS[1:], "updated_seq"))
)
_ADD_FIGURES: Final = """
INSERT INTO model_stats AS s (model, domain, worker, count, failures, total_ms_sum,
                              load_ms_sum, eval_ms_sum, eval_tokens_sum, last_at)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)
ON CONFLICT (model, domain, worker) DO UPDATE SET
    count = s.count + EXCLUDED.count,
    failures = s.failures + EXCLUDED.failures,
    total_ms_sum = s.total_ms_sum + EXCLUDED.total_ms_sum,
    load_ms_sum = s.load_ms_sum + EXCLUDED.load_ms_sum,
    eval_ms_sum = s.eval_ms_sum + EXCLUDED.eval_ms_sum,
    eval_tokens_sum = s.eval_tokens_sum + EXCLUDED.eval_tokens_sum,
    last_at = GREATEST(s.last_at, EXCLUDED.last_at)
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


class Unstorable(CoordinatorError):
    """This event's data can never be stored (for example text PostgreSQL refuses)."""

    code = "unstorable"


class ModelFigures(msgspec.Struct, frozen=True, kw_only=True):
    """One ``model_stats`` row: the outcomes of one model, domain and worker."""

    model: str
    domain: str
    worker: str
    count: int
    failures: int
    total_ms_sum: float
    load_ms_sum: float
    eval_ms_sum: float
    eval_tokens_sum: int
    last_at: float


class Store:
    """The stats read model: a pool of connections and the projection's writes and reads."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool

    @classmethod
    async def connect(
        cls, dsn: str, *, max_size: int = 4, command_timeout_s: float = 10.0
    ) -> Store:
        """Open a connection pool; an unreachable server raises `Unavailable` (no password)."""
        try:
            pool = await asyncpg.create_pool(
                dsn, min_size=1, max_size=max_size, command_timeout=command_timeout_s
            )
        except (asyncpg.PostgresError, asyncpg.InterfaceError, OSError, TimeoutError) as exc:
            raise Unavailable(
                f"cannot reach PostgreSQL at {redact_dsn(dsn)}: {exc or type(exc).__name__}"
            ) from exc
        return cls(pool)

    async def close(self, timeout_s: float = 10.0) -> None:
        """Close the pool, waiting up to ``timeout_s`` for connections in use."""
        try:
            await asyncio.wait_for(self._pool.close(), timeout=timeout_s)
        except TimeoutError:
            self._pool.terminate()

    async def apply_schema(self, path: Path = SCHEMA_PATH) -> None:
        """Create the tables if they do not exist (``deploy/postgres/schema.sql``)."""
        sql = await asyncio.to_thread(path.read_text, encoding="utf-8")
        with _database_errors():
            async with self._pool.acquire() as conn, conn.transaction():
                # Two services starting together must not race on CREATE TABLE IF NOT EXISTS.
                await conn.execute("SELECT pg_advisory_xact_lock($1)", _SCHEMA_LOCK)
                await conn.execute(sql)

    async def apply(self, stream_seq: int, event: AnyEvent) -> bool:
        """Apply one event from stream position ``stream_seq``, exactly once.

        Returns False, changing nothing, when this position was applied before (a
        redelivery). Raises `Unavailable` (retry later) or `Unstorable` (never storable).
        """
        with _database_errors(writing=True):
            async with self._pool.acquire() as conn, conn.transaction():
                first_time = await conn.fetchval(
                    "INSERT INTO projection_tracking (projection, stream_seq) VALUES ($1, $2) "
                    "ON CONFLICT DO NOTHING RETURNING true",
                    TASKS_PROJECTION,
                    stream_seq,
                )
                if not first_time:
                    return False
                match event:
                    case WorkerRegistered():
                        await conn.execute(
                            _WORKER_REGISTERED,
                            event.worker_id,
                            _clean(event.host),
                            event.instance_id,
                            [_clean(m) for m in event.models],
                            [_clean(s) for s in event.supports],
                            _clean(event.version),
                            _timestamp(event.at),
                            stream_seq,
                        )
                    case WorkerStopped():
                        await conn.execute(
                            _WORKER_STOPPED,
                            event.worker_id,
                            event.instance_id,
                            _timestamp(event.at),
                            _clean(event.reason),
                            stream_seq,
                        )
                    case AliasSet() | AliasRemoved():
                        pass  # applied to statistics keys on rebuild; tracked like any event
                    case _:
                        await self._apply_task_event(conn, stream_seq, event)
                return True

    async def _apply_task_event(
        self, conn: PoolConnectionProxy[Record], stream_seq: int, event: TaskEvent
    ) -> None:
        # The row may not exist yet, and FOR UPDATE cannot lock a missing row.
        await conn.execute(
            "SELECT pg_advisory_xact_lock($1, hashtext($2))", _TASK_LOCK_SPACE, event.task_id
        )
        row = await conn.fetchrow(_SELECT_TASK + " FOR UPDATE", event.task_id)
        before = _state_from_row(row) if row is not None else None
        after = evolve(before, event)
        if after is before:
            return
        await conn.execute(_UPSERT_TASK, *_row_from_state(after), stream_seq)
        delta = figures_delta(before, after)
        if delta is not None:
            await conn.execute(_ADD_FIGURES, *_figure_values(delta))

    async def get_task(self, task_id: str) -> TaskView | None:
        """The task as projected so far, or None if no event of it has been applied."""
        with _database_errors():
            async with self._pool.acquire() as conn:
                row = await conn.fetchrow(_SELECT_TASK, task_id)
        return to_view(_state_from_row(row)) if row is not None else None

    async def task_state(self, task_id: str) -> TaskState | None:
        """The task's full row (prompt, host, attempt, start time included), or None."""
        with _database_errors():
            async with self._pool.acquire() as conn:
                row = await conn.fetchrow(_SELECT_TASK, task_id)
        return _state_from_row(row) if row is not None else None

    async def figures(self) -> list[ModelFigures]:
        """Every ``model_stats`` row, ordered by model, domain and worker."""
        with _database_errors():
            async with self._pool.acquire() as conn:
                rows = await conn.fetch(
                    "SELECT model, domain, worker, count, failures, total_ms_sum, load_ms_sum, "
                    "eval_ms_sum, eval_tokens_sum, last_at FROM model_stats "
                    "ORDER BY model, domain, worker"
                )
        return [
            ModelFigures(
                model=r["model"],
                domain=r["domain"],
                worker=r["worker"],
                count=r["count"],
                failures=r["failures"],
                total_ms_sum=r["total_ms_sum"],
                load_ms_sum=r["load_ms_sum"],
                eval_ms_sum=r["eval_ms_sum"],
                eval_tokens_sum=r["eval_tokens_sum"],
                last_at=r["last_at"].timestamp(),
            )
            for r in rows
        ]

    async def last_seq(self) -> int:
        """The highest stream sequence this projection has applied (0 if none)."""
        with _database_errors():
            async with self._pool.acquire() as conn:
                value = await conn.fetchval(
                    "SELECT coalesce(max(stream_seq), 0) FROM projection_tracking "
                    "WHERE projection = $1",
                    TASKS_PROJECTION,
                )
        return int(value)


def redact_dsn(dsn: str) -> str:
    """The DSN without its password, fit for a log line or an error message."""
    try:
        parts = urlsplit(dsn)
    except ValueError:
        return "<unparsable dsn>"
    if parts.password is None:
        return dsn
    host = parts.hostname or ""
    netloc = f"{parts.username or ''}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


@contextmanager
def _database_errors(*, writing: bool = False) -> Iterator[None]:
    """Map asyncpg's and the socket's exceptions to `Unavailable` or `Unstorable`."""
    try:
        yield
    except asyncpg.PostgresError as exc:
        sqlstate = str(getattr(exc, "sqlstate", "") or "")
        if writing and sqlstate[:2] in {"22", "23"}:
            raise Unstorable(f"PostgreSQL refused the data ({sqlstate}): {exc}") from exc
        raise Unavailable(f"PostgreSQL error ({sqlstate or type(exc).__name__}): {exc}") from exc
    except (asyncpg.InterfaceError, asyncpg.InternalClientError, OSError, TimeoutError) as exc:
        raise Unavailable(f"PostgreSQL unreachable: {exc or type(exc).__name__}") from exc


def _clean(value: str) -> str:
    """PostgreSQL text cannot hold NUL; a backend's output sometimes does."""
    return value.replace("\x00", "\ufffd")


def _timestamp(at: float) -> datetime:
    return datetime.fromtimestamp(at, tz=UTC)


def _row_from_state(state: TaskState) -> list[Any]:
    values: list[Any] = []
    for name in _TASK_COLUMNS:
        value = getattr(state, name)
        if name in _TIMESTAMP_COLUMNS and value is not None:
            value = _timestamp(value)
        elif isinstance(value, str):
            value = _clean(value)
        values.append(value)
    return values


def _state_from_row(row: Record) -> TaskState:
    fields: dict[str, Any] = {}
    for name in _TASK_COLUMNS:
        value = row[name]
        if name in _TIMESTAMP_COLUMNS and value is not None:
            value = value.timestamp()
        fields[name] = value
    return TaskState(**fields)


def _figure_values(delta: FigureDelta) -> tuple[Any, ...]:
    return (
        _clean(delta.model),
        _clean(delta.domain),
        _clean(delta.worker),
        delta.count,
        delta.failures,
        delta.total_ms,
        delta.load_ms,
        delta.eval_ms,
        delta.eval_tokens,
        _timestamp(delta.at),
    )
