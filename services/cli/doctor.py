"""``coordinator doctor``: is the fleet as it should be? One line per check.

It looks at NATS and JetStream (server version; streams, buckets and consumers as the services
make them), PostgreSQL, each registered worker's model server (as the worker's own probe says
in its registration: the doctor's host may not reach it, and a model list that answers says
little of generations, lesson 13), and for the fleet's known
failure modes: duplicate consumers (two processes pulling one worker's queue), ghost queues
(tasks waiting where nobody pulls), stale registrations (a heartbeat older than the TTL) and
version skew between services. On Linux it also reads the systemd unit files and names units
that start the same worker (the two-units incident behind lesson 2). When the server is one
node of a JetStream cluster it checks the cluster too: its peers and meta leader (with the
system account's user, ``NATS_SYSTEM_USER``/``NATS_SYSTEM_PASSWORD``) and each stream's
replicas (`doctor_cluster`).

With ``PG_DSN`` (unset: the PostgreSQL of the stack ``coordinator up`` recorded, when the
doctor reads that stack's NATS) it also reads the stats read model: whether it holds the
events ``EVENTS`` holds (the event it applied last is the one ``EVENTS`` holds there, no event
of an older log counts) and whether events are parked.

The checks are pure functions of what was gathered (`doctor_checks`), so they are tested
without servers; the unit files are read by `unit_scan`; `gather` here does the I/O. Run it
with the operator NATS user: it reads every consumer. Exit status 0 when nothing is wrong, 1 when
a check found a problem.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

from schemas.subjects import (
    EVENTS_STREAM,
    TASKS_STREAM,
    TASKS_SUBJECTS,
    WORKERS_BUCKET,
)
from services.cli.doctor_checks import DEFAULT_TTL_S, Gathered, ReadModel, evaluate
from services.cli.doctor_cluster import MetaGroup, meta_from_jsz
from services.cli.doctor_line import Check
from services.cli.replication import FLEET_STREAMS
from services.cli.unit_scan import scan_unit_dirs
from services.runtime.bus import bucket_keys
from services.runtime.settings import NatsAuth

NO_SYSTEM_USER: Final = (
    "set NATS_SYSTEM_USER and NATS_SYSTEM_PASSWORD (the cluster's system user) to read it"
)

EXIT_PROBLEM: Final = 1
DEFAULT_UNIT_DIRS: Final = ("/etc/systemd/system", "~/.config/systemd/user")


async def _service_infos(nc: Any, wait_s: float) -> list[tuple[str, str, str]]:
    """Every NATS micro service's name, id and version (replies to ``$SRV.INFO``)."""
    import json

    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    found: list[tuple[str, str, str]] = []
    try:
        await nc.publish("$SRV.INFO", b"", reply=inbox)
        deadline = time.monotonic() + wait_s
        while (left := deadline - time.monotonic()) > 0:
            try:
                msg = await sub.next_msg(timeout=left)
            except Exception:
                break
            with contextlib.suppress(ValueError, KeyError):
                info = json.loads(msg.data)
                found.append((str(info["name"]), str(info["id"]), str(info["version"])))
    finally:
        await sub.unsubscribe()
    return found


async def _meta_group(nats_url: str, system: NatsAuth, wait_s: float) -> MetaGroup | None:
    """The cluster's meta group: every server's answer to ``$SYS.REQ.SERVER.PING.JSZ``, which
    only the system account may ask."""
    import json

    from services.runtime.bus import connect

    nc = await connect(nats_url, "coordinator-doctor-system", connect_timeout_s=2.0, auth=system)
    try:
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        await nc.publish("$SYS.REQ.SERVER.PING.JSZ", b"{}", reply=inbox)
        replies: list[dict[str, Any]] = []
        deadline = time.monotonic() + wait_s
        while (left := deadline - time.monotonic()) > 0:
            try:
                msg = await sub.next_msg(timeout=left)
            except Exception:
                break
            with contextlib.suppress(ValueError):
                replies.append(json.loads(msg.data))
        return meta_from_jsz(replies)
    finally:
        await nc.close()


async def gather(
    nats_url: str,
    *,
    pg_dsn: str | None,
    unit_dirs: Sequence[str | Path] | None,
    info_wait_s: float = 0.5,
    system: NatsAuth | None = None,
) -> Gathered:
    import msgspec
    import nats.errors
    import nats.js.errors

    from schemas.workers import worker_record_decoder
    from services.runtime.bus import connect

    g = Gathered(now=time.time())
    if unit_dirs is not None:
        g.units = scan_unit_dirs(unit_dirs)
    try:
        # Outside a service, connect() gives up at the first failure (Unavailable, naming the URL).
        nc = await connect(nats_url, "coordinator-doctor", connect_timeout_s=2.0)
    except Exception as exc:
        g.nats_error = str(exc) or f"cannot reach NATS at {nats_url}: {type(exc).__name__}"
        return g
    try:
        g.server_version = str(nc._server_info.get("version", "?"))
        g.cluster = nc._server_info.get("cluster") or None
        js = nc.jetstream(timeout=3.0)
        try:
            await js.account_info()
        except Exception as exc:
            g.jetstream = f"not available: {exc!r}"
            return g
        if g.cluster:
            g.meta_error = NO_SYSTEM_USER
            if system is not None:
                try:
                    g.meta = await _meta_group(nats_url, system, max(info_wait_s, 1.0))
                except Exception as exc:
                    g.meta_error = f"cannot read the meta group: {exc}"
        for name in FLEET_STREAMS:
            try:
                g.streams[name] = await js.stream_info(name)
            except nats.js.errors.NotFoundError:
                g.streams[name] = None
            except nats.errors.TimeoutError:
                # On a cluster: the stream's servers have no leader (too few of them are up).
                g.unanswered.append(name)
        if g.streams.get(TASKS_STREAM) is not None:
            info = await js.stream_info(TASKS_STREAM, subjects_filter=TASKS_SUBJECTS)
            g.task_subjects = dict(info.state.subjects or {})
            g.consumers[TASKS_STREAM] = await js.consumers_info(TASKS_STREAM)
        if g.streams.get(EVENTS_STREAM) is not None:
            g.consumers[EVENTS_STREAM] = await js.consumers_info(EVENTS_STREAM)
        registry = g.streams.get(f"KV_{WORKERS_BUCKET}")
        if registry is not None:
            g.ttl_s = registry.config.max_age or DEFAULT_TTL_S
            kv = await js.key_value(WORKERS_BUCKET)
            for key in await bucket_keys(js, WORKERS_BUCKET):
                with contextlib.suppress(nats.js.errors.NotFoundError, msgspec.DecodeError):
                    entry = await kv.get(key)
                    g.records.append(worker_record_decoder.decode(entry.value or b""))
        g.services = await _service_infos(nc, info_wait_s)
        if pg_dsn:
            g.postgres, g.postgres_detail, g.read_model = await _probe_postgres(pg_dsn, js)
    finally:
        await nc.close()
    return g


async def _probe_postgres(dsn: str, js: Any) -> tuple[str, str, ReadModel | None]:
    """PostgreSQL's version, and the stats read model (None: no stats tables yet)."""
    import asyncpg

    try:
        conn = await asyncpg.connect(dsn, timeout=3.0)
    except Exception as exc:
        return f"cannot connect: {type(exc).__name__}: {exc}", "", None
    try:
        version = await conn.fetchval("show server_version")
        projected = await conn.fetchval("select to_regclass('tasks') is not null")
        current = await conn.fetchval("select to_regclass('parked_events') is not null")
        model = await _read_model(conn, js) if current else None
    except Exception as exc:
        return f"cannot read the stats tables: {type(exc).__name__}: {exc}", "", None
    finally:
        await conn.close()
    detail = f"PostgreSQL {version}"
    if not projected:
        detail += ", no stats tables yet"
    elif not current:
        detail += ", stats tables of an older version (the stats service migrates them at start)"
    return "", detail, model


async def _read_model(conn: Any, js: Any) -> ReadModel:
    """What the read model has handled, and whether ``EVENTS`` holds at its last position the
    event it applied there (`services.stats.tracking.event_digest` of the message there)."""
    from services.stats.rows import TASKS_PROJECTION
    from services.stats.tracking import event_digest

    tracked = await conn.fetchrow(
        "SELECT count(*), coalesce(max(stream_seq), 0) FROM projection_tracking "
        "WHERE projection = $1",
        TASKS_PROJECTION,
    )
    handled, last_seq = int(tracked[0]), int(tracked[1])
    matches: bool | None = None
    digest = await conn.fetchval(
        "SELECT digest FROM projection_tracking WHERE projection = $1 AND stream_seq = $2",
        TASKS_PROJECTION,
        last_seq,
    )
    if digest is not None:
        # No message there any more (aged out, or deleted), or no answer: it cannot tell.
        with contextlib.suppress(Exception):
            stored = await js.get_msg(EVENTS_STREAM, last_seq)
            matches = event_digest(stored.subject or "", stored.data or b"") == bytes(digest)
    replaced = await conn.fetchrow(
        "SELECT count(*), max(replaced_at) FROM replaced_tracking WHERE projection = $1",
        TASKS_PROJECTION,
    )
    replaced_from = await conn.fetchval(
        "SELECT replaced_from FROM replaced_tracking WHERE projection = $1 "
        "ORDER BY replaced_at DESC LIMIT 1",
        TASKS_PROJECTION,
    )
    parked = int(await conn.fetchval("SELECT count(*) FROM parked_events"))
    newest = await conn.fetchrow(
        "SELECT stream_seq, kind, error FROM parked_events "
        "ORDER BY parked_at DESC, stream_seq DESC LIMIT 1"
    )
    return ReadModel(
        handled=handled,
        last_seq=last_seq,
        last_matches=matches,
        replaced=int(replaced[0]),
        replaced_from=replaced_from,
        replaced_at=replaced[1].timestamp() if replaced[1] is not None else None,
        parked=parked,
        newest_parked=f"#{newest[0]} {newest[1]}: {newest[2]}" if newest is not None else "",
    )


async def run_doctor(
    nats_url: str,
    *,
    pg_dsn: str | None = None,
    unit_dirs: Sequence[str | Path] | None = None,
    system: NatsAuth | None = None,
) -> list[Check]:
    """Every check's line. ``system``: the cluster's system user, to read its meta group."""
    return evaluate(await gather(nats_url, pg_dsn=pg_dsn, unit_dirs=unit_dirs, system=system))


def register(sub: Any) -> None:
    doctor = sub.add_parser(
        "doctor",
        help="check NATS, streams, consumers, PostgreSQL, workers and service units",
        description="One line per check; exit 1 when one found a problem. Reads NATS_URL (or "
        "the stack `coordinator up` recorded), the NATS_* credentials (use the operator user), "
        "PG_DSN (or the stack's), and on a cluster NATS_SYSTEM_USER and NATS_SYSTEM_PASSWORD.",
    )
    doctor.add_argument(
        "--unit-dir",
        action="append",
        dest="unit_dirs",
        help=f"where systemd units are (repeat; default on Linux: {', '.join(DEFAULT_UNIT_DIRS)})",
    )
    doctor.set_defaults(func=cmd_doctor)


def cmd_doctor(args: argparse.Namespace) -> int:
    from services.cli.client import find_nats_url, find_pg_dsn
    from services.cli.settings import DoctorSettings
    from services.runtime.logging import setup_logging

    setup_logging("error", "console", stream=sys.stderr)
    unit_dirs = args.unit_dirs or (list(DEFAULT_UNIT_DIRS) if sys.platform == "linux" else None)
    nats_url = find_nats_url()
    checks = asyncio.run(
        run_doctor(
            nats_url,
            pg_dsn=find_pg_dsn(nats_url),
            unit_dirs=unit_dirs,
            system=DoctorSettings.from_env().system_auth(),
        )
    )
    for check in checks:
        print(check.line())
    return EXIT_PROBLEM if any(c.status == "problem" for c in checks) else 0
