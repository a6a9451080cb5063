"""The read model's tables as the projection sees them: names, locks and row shapes. Pure.

A ``tasks`` row holds a `TaskState`, column for column; timestamps are ``timestamptz`` and
text never holds NUL (PostgreSQL refuses it, a backend's output sometimes has it).
"""

from __future__ import annotations

import dataclasses
import math
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Final, TypeAlias

from services.errors import Unstorable
from services.stats.projection import Outcome, TaskState

if TYPE_CHECKING:
    import asyncpg
    from asyncpg import Record

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
    "replaced_tracking",
    "parked_events",
    "workers_seen",
)

# Advisory lock held shared by every live batch and exclusively by a rebuild while it catches
# up and swaps the tables in: no live write can fall between the rebuild's last event and the
# swap (see rebuild.py).
PROJECTION_LOCK: Final = 7_301_002

# Advisory lock space for task rows: concurrent writers (two stats instances) serialise on
# a task instead of racing on a row that does not exist yet.
TASK_LOCK_SPACE: Final = 7_301

TASK_COLUMNS: Final = tuple(f.name for f in dataclasses.fields(TaskState))
_TIMESTAMP_COLUMNS: Final = frozenset({"created_at", "started_at", "ended_at"})

SELECT_TASK: Final = f"SELECT {', '.join(TASK_COLUMNS)} FROM tasks WHERE task_id = $1"


def clean(value: str) -> str:
    """PostgreSQL text cannot hold NUL; a backend's output sometimes does."""
    return value.replace("\x00", "\ufffd")


# The epoch seconds a ``timestamptz`` column takes from here: years 1 to 9999, what Python's
# datetime holds (PostgreSQL holds more). The end is the start of year 10000, excluded: the
# last microsecond before it is no float of its own at this size.
_FIRST_S: Final = -62_135_596_800.0
_END_S: Final = 253_402_300_800.0


def timestamp(at: float) -> datetime:
    """An event's time (epoch seconds) as a ``timestamptz`` value. A time no column can hold
    (out of years 1–9999, not finite) is `Unstorable`: the event that carries it can never
    be projected, however often it is tried (``datetime.fromtimestamp`` raised
    OverflowError, ValueError or OSError for it, which said nothing of the kind)."""
    if not (math.isfinite(at) and _FIRST_S <= at < _END_S):
        raise Unstorable(f"time {at:.15g} is out of range (epoch seconds within years 1-9999)")
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


def outcome_values(outcome: Outcome, model: str, seq: int) -> tuple[Any, ...]:
    """An ``outcomes`` row (model keyed by its canonical name ``model``), at position ``seq``."""
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
