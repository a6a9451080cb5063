"""The stats read model in PostgreSQL (asyncpg): apply events once, answer queries.

Events are applied in batches, each in one transaction together with its tracking rows
``('tasks', stream_seq, digest)``; the position is a primary key and the digest says which
event was applied there (`tracking`), so an event delivered twice is recognised and changes
nothing, and another event at a position already applied is not taken for it. The writes
themselves are `projector.project`, shared with the rebuild; the state logic is the pure
`projection.evolve`. An event that cannot be applied is parked (`park`).

Database failures leave this module as the project's own errors: `Unavailable` when retrying
may help (connection lost, server restarting, timeouts, any other server error), `Unstorable`
when this event's data can never be stored (SQLSTATE class 22 data exception or 23 integrity
violation), so the caller can retry the one and set the other aside.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Final, Self
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import structlog
from asyncpg import Record

from schemas.events import AnyEvent
from schemas.stats import (
    PARKED_LISTED,
    AliasView,
    ExclusionView,
    FigureView,
    ParkedView,
    StatsQuery,
)
from schemas.subjects import EVENTS_STREAM
from services.errors import Unavailable, Unstorable
from services.fleet.aliases import resolve
from services.stats.figure_rows import FIGURE_COLUMNS, NOT_EXCLUDED, refresh_figures
from services.stats.projection import TaskState
from services.stats.projector import Item, Projected, item_for, load_aliases, park, project
from services.stats.rows import (
    PROJECTION_LOCK,
    SELECT_TASK,
    TASK_COLUMNS,
    TASKS_PROJECTION,
    Connection,
    FigureKey,
    state_from_row,
)

log = structlog.get_logger("stats")

SCHEMA_PATH: Final = Path(__file__).resolve().parents[2] / "deploy/postgres/schema.sql"

# Two services starting together must not race on CREATE TABLE IF NOT EXISTS.
_SCHEMA_LOCK: Final = 7_301_001
# How long one try at applying the schema waits for a table's lock, and how many tries.
SCHEMA_LOCK_TIMEOUT_S: Final = 2.0
SCHEMA_TRIES: Final = 30

_SELECT_FIGURES: Final = f"SELECT {', '.join(FIGURE_COLUMNS)} FROM figures"
_SELECT_EXCLUSIONS: Final = (
    "SELECT exclusion_id, worker, model, since, until, reason, added_at, withdrawn_at, "
    "withdraw_reason FROM exclusions"
)
_BASELINES: Final = f"""
SELECT b.worker, b.prompt_key,
       percentile_cont(0.5) WITHIN GROUP (ORDER BY b.total_ms) AS median_ms,
       count(DISTINCT b.run_id) AS runs
FROM bench_results b
WHERE b.model = $1 AND b.ok AND b.total_ms IS NOT NULL
  AND ($2::text IS NULL OR b.run_id <> $2)
  AND {NOT_EXCLUDED.format(row="b", at="at")}
GROUP BY b.worker, b.prompt_key
ORDER BY b.worker, b.prompt_key
"""
_UNSCORED: Final = (
    f"SELECT {', '.join(TASK_COLUMNS)} FROM tasks t "
    "WHERE t.status = 'done' AND t.response IS NOT NULL "
    "AND t.task_type NOT IN ('embedding', 'model_change') "
    "AND NOT EXISTS (SELECT 1 FROM quality q WHERE q.task_id = t.task_id) "
    "ORDER BY t.ended_at, t.task_id LIMIT $1"
)


def unreachable(dsn: str, exc: BaseException) -> str:
    """Why PostgreSQL at ``dsn`` could not be used, as an operator can act on it."""
    why = f"cannot reach PostgreSQL at {redact_dsn(dsn)}: {exc or type(exc).__name__}"
    if isinstance(exc, asyncpg.InvalidPasswordError):
        # The official image sets the password once, when it makes its data directory.
        why += (
            " (PostgreSQL keeps the password its data was made with: a POSTGRES_PASSWORD "
            "changed later applies only to a new volume. Set the old one back, or change it "
            "in PostgreSQL: ALTER USER ... PASSWORD '...')"
        )
    return why


class Store:
    """The stats read model: a pool of connections and the projection's writes and reads."""

    def __init__(self, pool: asyncpg.Pool, dsn: str = "") -> None:
        self._pool = pool
        self.dsn = dsn

    @classmethod
    async def connect(cls, dsn: str, *, max_size: int = 4, command_timeout_s: float = 10.0) -> Self:
        """Open a connection pool; an unreachable server raises `Unavailable` (no password)."""
        try:
            pool = await asyncpg.create_pool(
                dsn, min_size=1, max_size=max_size, command_timeout=command_timeout_s
            )
        except (asyncpg.PostgresError, asyncpg.InterfaceError, OSError, TimeoutError) as exc:
            raise Unavailable(unreachable(dsn, exc)) from exc
        return cls(pool, dsn)

    async def close(self, timeout_s: float = 10.0) -> None:
        """Close the pool, waiting up to ``timeout_s`` for connections in use."""
        try:
            await asyncio.wait_for(self._pool.close(), timeout=timeout_s)
        except TimeoutError:
            self._pool.terminate()

    async def apply_schema(self, path: Path = SCHEMA_PATH) -> None:
        """Create the tables if they do not exist, and bring older ones up to date
        (``deploy/postgres/schema.sql``); nothing at all when this very file was applied last.

        Applying takes strong locks (an ``ALTER TABLE`` takes its table's strongest even when
        it changes nothing), which another instance that is projecting may hold the other way
        round: each try waits at most `SCHEMA_LOCK_TIMEOUT_S` for a lock, and a try that would
        wait longer, or that PostgreSQL ends as a deadlock, is made again (the other instance's
        transactions are short)."""
        sql = await asyncio.to_thread(path.read_text, encoding="utf-8")
        digest = hashlib.sha256(sql.encode()).hexdigest()
        for attempt in itertools.count(1):
            try:
                with database_errors():
                    async with self._pool.acquire() as conn:
                        await _apply_schema_once(conn, sql, digest)
                return
            except Unavailable as exc:
                if attempt >= SCHEMA_TRIES or not _lock_conflict(exc.__cause__):
                    raise
                log.info("the schema waits for another instance's writes", attempt=attempt)
                await asyncio.sleep(min(0.2 * attempt, 2.0))

    async def current_schema(self) -> str:
        """The schema the read model's tables live in (first on the search_path)."""
        with database_errors():
            async with self._pool.acquire() as conn:
                return str(await conn.fetchval("SELECT current_schema()"))

    # -- writes --------------------------------------------------------------------------------

    async def apply(self, stream_seq: int, event: AnyEvent, source: str | None = None) -> bool:
        """Apply one event from stream position ``stream_seq`` (a task event recorded by the
        worker ``source``, if any), exactly once.

        Returns False, changing nothing, when this position was applied before (a
        redelivery). Raises `Unavailable` (retry later) or `Unstorable` (never storable).
        """
        return (await self.apply_batch([item_for(stream_seq, event, source)])).applied == 1

    async def apply_batch(self, items: Sequence[Item]) -> Projected:
        """Apply events (stream position, event) in order in one transaction, each once.

        All or nothing: `Unavailable` or `Unstorable` leave the tables as they were, so the
        caller may retry, or apply the events one by one to find the one that cannot be stored.
        """
        with database_errors(writing=True):
            async with self._pool.acquire() as conn, conn.transaction():
                # Shared: live batches run side by side; a rebuild's swap waits for them and
                # holds them off (rebuild.py).
                await conn.execute("SELECT pg_advisory_xact_lock_shared($1)", PROJECTION_LOCK)
                # Figures are recomputed apart (`refresh_figures`): a percentile over a key's
                # whole history in every batch made a batch slower the longer the log grew.
                return await project(conn, items)

    async def park(self, item: Item, error: str, stream: str = EVENTS_STREAM) -> bool:
        """Record ``item`` as parked instead of applying it (`projector.park`), in its own
        transaction; False when its position was handled before. Raises `Unavailable`."""
        with database_errors(writing=True):
            async with self._pool.acquire() as conn, conn.transaction():
                await conn.execute("SELECT pg_advisory_xact_lock_shared($1)", PROJECTION_LOCK)
                return await park(conn, item, error, stream)

    async def undigested(self) -> tuple[int, int] | None:
        """The lowest and highest position of the tracking rows written before digests were
        kept that are not filled in yet (None: there are none)."""
        with database_errors():
            async with self._pool.acquire() as conn:
                row = await conn.fetchrow(
                    "SELECT min(stream_seq), max(stream_seq) FROM projection_tracking "
                    "WHERE projection = $1 AND digest IS NULL",
                    TASKS_PROJECTION,
                )
        return None if row is None or row[0] is None else (int(row[0]), int(row[1]))

    async def fill_digests(self, items: Sequence[Item]) -> int:
        """Give the tracking rows without a digest at the positions of ``items`` the digest of
        the event there; how many it filled in. Only right while the stream is the log those
        rows were written from: the stats service does it at start, before projecting."""
        if not items:
            return 0
        with database_errors(writing=True):
            async with self._pool.acquire() as conn, conn.transaction():
                await conn.execute("SELECT pg_advisory_xact_lock_shared($1)", PROJECTION_LOCK)
                status = await conn.execute(
                    "UPDATE projection_tracking t SET digest = i.digest "
                    "FROM unnest($2::bigint[], $3::bytea[]) AS i (seq, digest) "
                    "WHERE t.projection = $1 AND t.stream_seq = i.seq AND t.digest IS NULL",
                    TASKS_PROJECTION,
                    [item.seq for item in items],
                    [item.digest for item in items],
                )
        return int(status.split()[-1])

    async def refresh_figures(self, keys: set[FigureKey] | None = None) -> None:
        """Recompute the figure rows of ``keys`` (all of them when None) from the facts."""
        with database_errors(writing=True):
            async with self._pool.acquire() as conn, conn.transaction():
                await conn.execute("SELECT pg_advisory_xact_lock_shared($1)", PROJECTION_LOCK)
                await refresh_figures(conn, keys)

    # -- reads ---------------------------------------------------------------------------------

    async def task_state(self, task_id: str) -> TaskState | None:
        """The task's full row (prompt, host, attempt, start time included), or None."""
        with database_errors():
            async with self._pool.acquire() as conn:
                row = await conn.fetchrow(SELECT_TASK, task_id)
        return state_from_row(row) if row is not None else None

    async def figures(self, query: StatsQuery | None = None) -> list[FigureView]:
        """Figure rows, ordered by model, domain and worker; ``query`` narrows them."""
        conditions, args = [], []
        for name in ("model", "worker", "domain"):
            value = getattr(query, name, None) if query is not None else None
            if value is not None:
                args.append(value)
                conditions.append(f"{name} = ${len(args)}")
        where = f" WHERE {' AND '.join(conditions)}" if conditions else ""
        with database_errors():
            async with self._pool.acquire() as conn:
                rows = await conn.fetch(
                    f"{_SELECT_FIGURES}{where} ORDER BY model, domain, worker", *args
                )
        return [_figure(r) for r in rows]

    async def figures_for(self, keys: Iterable[FigureKey]) -> list[FigureView]:
        """The figure rows of ``keys`` that exist (a key whose outcomes are all excluded has
        none)."""
        wanted = sorted(set(keys))
        if not wanted:
            return []
        models, domains, workers = (list(c) for c in zip(*wanted, strict=True))
        with database_errors():
            async with self._pool.acquire() as conn:
                rows = await conn.fetch(
                    f"{_SELECT_FIGURES} WHERE (model, domain, worker) IN "
                    "(SELECT * FROM unnest($1::text[], $2::text[], $3::text[])) "
                    "ORDER BY model, domain, worker",
                    models,
                    domains,
                    workers,
                )
        return [_figure(r) for r in rows]

    async def exclusions(self, *, withdrawn: bool = False) -> list[ExclusionView]:
        """Exclusions in the order they were added; active ones only unless ``withdrawn``."""
        where = "" if withdrawn else " WHERE withdrawn_at IS NULL"
        with database_errors():
            async with self._pool.acquire() as conn:
                rows = await conn.fetch(f"{_SELECT_EXCLUSIONS}{where} ORDER BY added_at, 1")
        return [_exclusion(r) for r in rows]

    async def exclusion(self, exclusion_id: str) -> ExclusionView | None:
        with database_errors():
            async with self._pool.acquire() as conn:
                row = await conn.fetchrow(
                    f"{_SELECT_EXCLUSIONS} WHERE exclusion_id = $1", exclusion_id
                )
        return _exclusion(row) if row is not None else None

    async def alias_map(self) -> dict[str, str]:
        """Every alias and the name it was set to (chains not followed)."""
        with database_errors():
            async with self._pool.acquire() as conn:
                return await load_aliases(conn)

    async def aliases(self) -> list[AliasView]:
        """Every alias with the canonical name it leads to in the end."""
        with database_errors():
            async with self._pool.acquire() as conn:
                rows = await conn.fetch("SELECT alias, canonical, set_at FROM aliases")
        mapping = {r["alias"]: r["canonical"] for r in rows}
        return sorted(
            (
                AliasView(
                    alias=r["alias"],
                    canonical=resolve(mapping, r["alias"]),
                    set_at=r["set_at"].timestamp(),
                )
                for r in rows
            ),
            key=lambda view: view.alias,
        )

    async def baselines(
        self, model: str, *, exclude_run: str | None = None
    ) -> list[tuple[str, str, float, int]]:
        """``(worker, prompt_key, median_ms, runs)`` of a model's earlier clean bench results.

        ``model`` may be an alias; results are keyed by the canonical name. Results an active
        exclusion covers, failures and the run ``exclude_run`` are left out.
        """
        with database_errors():
            async with self._pool.acquire() as conn:
                canonical = resolve(await load_aliases(conn), model)
                rows = await conn.fetch(_BASELINES, canonical, exclude_run)
        return [(r["worker"], r["prompt_key"], r["median_ms"], r["runs"]) for r in rows]

    async def unscored_tasks(self, limit: int) -> list[TaskState]:
        """Done tasks the judge has not given a verdict on, oldest first."""
        with database_errors():
            async with self._pool.acquire() as conn:
                rows = await conn.fetch(_UNSCORED, limit)
        return [state_from_row(r) for r in rows]

    async def predates_outcomes(self) -> bool:
        """True when tasks have ended but no outcome is recorded: tables projected by a version
        before ``outcomes`` existed, whose history only a rebuild can count."""
        with database_errors():
            async with self._pool.acquire() as conn:
                return bool(
                    await conn.fetchval(
                        "SELECT EXISTS (SELECT 1 FROM tasks WHERE status IN ('done', 'failed')) "
                        "AND NOT EXISTS (SELECT 1 FROM outcomes)"
                    )
                )

    async def applied(self, stream_seq: int, digest: bytes | None = None) -> bool:
        """Has this projection applied the event at ``stream_seq`` (the one whose digest is
        ``digest``, when given: not another the log held there before)?"""
        with database_errors():
            async with self._pool.acquire() as conn:
                found = await conn.fetchval(
                    "SELECT true FROM projection_tracking WHERE projection = $1 "
                    "AND stream_seq = $2 AND ($3::bytea IS NULL OR digest = $3)",
                    TASKS_PROJECTION,
                    stream_seq,
                    digest,
                )
        return bool(found)

    async def parked(self) -> tuple[list[ParkedView], int]:
        """The newest parked events (at most `PARKED_LISTED`), and how many there are."""
        with database_errors():
            async with self._pool.acquire() as conn:
                rows = await conn.fetch(
                    "SELECT stream, stream_seq, subject, kind, error, parked_at, "
                    "count(*) OVER () AS total FROM parked_events "
                    "ORDER BY parked_at DESC, stream_seq DESC LIMIT $1",
                    PARKED_LISTED,
                )
        views = [
            ParkedView(
                stream=r["stream"],
                stream_seq=r["stream_seq"],
                subject=r["subject"],
                kind=r["kind"],
                error=r["error"],
                parked_at=r["parked_at"].timestamp(),
            )
            for r in rows
        ]
        return views, int(rows[0]["total"]) if rows else 0

    async def last_seq(self) -> int:
        """The highest stream sequence this projection has applied (0 if none)."""
        with database_errors():
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
def database_errors(*, writing: bool = False) -> Iterator[None]:
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


def _figure(row: Record) -> FigureView:
    values: dict[str, Any] = dict(row)
    values["last_at"] = row["last_at"].timestamp()
    return FigureView(**values)


def _exclusion(row: Record) -> ExclusionView:
    return ExclusionView(
        exclusion_id=row["exclusion_id"],
        worker=row["worker"],
        model=row["model"],
        since=row["since"].timestamp(),
        until=row["until"].timestamp() if row["until"] is not None else None,
        reason=row["reason"],
        added_at=row["added_at"].timestamp(),
        withdrawn_at=row["withdrawn_at"].timestamp() if row["withdrawn_at"] is not None else None,
        withdraw_reason=row["withdraw_reason"],
    )


async def _apply_schema_once(conn: Connection, sql: str, digest: str) -> None:
    """One try at `Store.apply_schema`: nothing when ``digest`` was applied last, else the file
    and its digest in one transaction, one instance at a time."""
    if await _applied_schema(conn) == digest:
        return
    async with conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock($1)", _SCHEMA_LOCK)
        if await _applied_schema(conn) == digest:
            return  # another instance applied it meanwhile
        await conn.execute(f"SET LOCAL lock_timeout = '{int(SCHEMA_LOCK_TIMEOUT_S * 1000)}ms'")
        await conn.execute(sql)
        await conn.execute("DELETE FROM schema_applied")
        await conn.execute(
            "INSERT INTO schema_applied (digest, applied_at) VALUES ($1, now())", digest
        )


async def _applied_schema(conn: Connection) -> str | None:
    """The digest of the schema file applied last here (its ``schema_applied`` row), if any."""
    if await conn.fetchval("SELECT to_regclass('schema_applied')") is None:
        return None
    digest = await conn.fetchval("SELECT digest FROM schema_applied LIMIT 1")
    return None if digest is None else str(digest)


def _lock_conflict(exc: BaseException | None) -> bool:
    """A deadlock PostgreSQL broke, or a lock not granted within ``lock_timeout``."""
    return isinstance(
        exc, asyncpg.exceptions.DeadlockDetectedError | asyncpg.exceptions.LockNotAvailableError
    )
