"""``coordinator doctor``: is the fleet as it should be? One line per check.

It looks at NATS and JetStream (server version; streams, buckets and consumers as the services
make them), PostgreSQL, each registered worker's model server, and for the fleet's known
failure modes: duplicate consumers (two processes pulling one worker's queue), ghost queues
(tasks waiting where nobody pulls), stale registrations (a heartbeat older than the TTL) and
version skew between services. On Linux it also reads the systemd unit files and names units
that start the same worker (the two-units incident behind lesson 2).

The checks are pure functions of what was gathered (`Gathered`), so they are tested without
servers; `gather` does the I/O. Run it with the admin NATS user: it reads every consumer.
Exit status 0 when nothing is wrong, 1 when a check found a problem.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import os
import re
import socket
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal
from urllib.parse import urlsplit

from nats.js.api import ConsumerInfo, RetentionPolicy, StreamConfig, StreamInfo

from schemas.subjects import (
    ASLEEP_BUCKET,
    EVENTS_STREAM,
    EVENTS_SUBJECTS,
    STATS_BUCKET,
    STATS_CONSUMER,
    TASKS_STREAM,
    TASKS_SUBJECTS,
    WORKERS_BUCKET,
    worker_consumer,
    worker_of_consumer,
)
from schemas.workers import INFERENCE_CAPABILITIES, WorkerRecord
from services.fleet.liveness import is_fresh, is_live
from services.runtime.settings import default_worker_id

EXIT_PROBLEM: Final = 1
DEFAULT_TTL_S: Final = 15.0
DEFAULT_UNIT_DIRS: Final = ("/etc/systemd/system", "~/.config/systemd/user")

Status = Literal["ok", "problem", "skipped"]


@dataclass(frozen=True)
class Check:
    name: str
    status: Status
    detail: str

    def line(self) -> str:
        return f"{self.status:<8} {self.name:<22} {self.detail}"


def _ok(name: str, detail: str) -> Check:
    return Check(name, "ok", detail)


def _problem(name: str, problems: Sequence[str]) -> Check:
    return Check(name, "problem", "; ".join(problems))


def _verdict(name: str, problems: Sequence[str], fine: str) -> Check:
    return _problem(name, problems) if problems else _ok(name, fine)


@dataclass
class Gathered:
    """What `gather` found; None where it could not look."""

    now: float
    nats_error: str = ""
    server_version: str | None = None
    jetstream: str | None = None  # None: enabled; otherwise why not
    streams: dict[str, StreamInfo | None] = field(default_factory=dict)
    task_subjects: dict[str, int] = field(default_factory=dict)
    consumers: dict[str, list[ConsumerInfo]] = field(default_factory=dict)
    records: list[WorkerRecord] = field(default_factory=list)
    ttl_s: float = DEFAULT_TTL_S
    services: list[tuple[str, str, str]] = field(default_factory=list)  # name, id, version
    postgres: str | None = None  # "" fine, None not configured, text: what is wrong
    postgres_detail: str = ""
    backends: dict[str, str | None] = field(default_factory=dict)  # worker -> problem or None
    units: dict[str, list[str]] | None = None  # worker id -> unit names; None: not Linux


# -- pure checks -------------------------------------------------------------------------------


def subject_matches(pattern: str, subject: str) -> bool:
    """NATS subject matching: ``*`` one token, ``>`` one or more at the end."""
    parts, tokens = pattern.split("."), subject.split(".")
    for i, part in enumerate(parts):
        if part == ">":
            return len(tokens) > i
        if i >= len(tokens) or (part != "*" and part != tokens[i]):
            return False
    return len(parts) == len(tokens)


def check_streams(found: Mapping[str, StreamInfo | None]) -> Check:
    expected: dict[str, tuple[str, RetentionPolicy | None]] = {
        TASKS_STREAM: (TASKS_SUBJECTS, RetentionPolicy.WORK_QUEUE),
        EVENTS_STREAM: (EVENTS_SUBJECTS, RetentionPolicy.LIMITS),
    }
    problems: list[str] = []
    summary: list[str] = []
    for name, (subject, retention) in expected.items():
        info = found.get(name)
        if info is None:
            problems.append(f"stream {name} is missing (run `coordinator setup`)")
            continue
        config: StreamConfig = info.config
        if subject not in (config.subjects or []):
            problems.append(f"stream {name} does not take {subject} (subjects {config.subjects})")
        if retention is not None and config.retention != retention:
            problems.append(f"stream {name} has retention {config.retention}, not {retention}")
        summary.append(f"{name} {info.state.messages} msgs")
    for bucket in (WORKERS_BUCKET, STATS_BUCKET, ASLEEP_BUCKET):
        if found.get(f"KV_{bucket}") is None:
            problems.append(f"bucket {bucket} is missing (run `coordinator setup`)")
    return _verdict("streams", problems, ", ".join(summary) + ", buckets present")


def check_consumers(
    consumers: Mapping[str, Sequence[ConsumerInfo]],
    records: Sequence[WorkerRecord],
    now: float,
    ttl_s: float,
) -> Check:
    """Every live inference worker has its consumer, one task in flight at most, and the
    stats projection has its durable consumer."""
    live = {r.worker_id for r in records if is_live(r, now, ttl_s)}
    tasks = {c.name: c for c in consumers.get(TASKS_STREAM, [])}
    problems: list[str] = []
    for record in records:
        inference = INFERENCE_CAPABILITIES.intersection(record.supports)
        if (
            record.worker_id in live
            and inference
            and worker_consumer(record.worker_id) not in tasks
        ):
            problems.append(f"live worker {record.worker_id} has no consumer (not pulling)")
    for name, info in tasks.items():
        if worker_of_consumer(name) and (info.config.max_ack_pending or 0) > 1:
            problems.append(f"{name} allows {info.config.max_ack_pending} tasks in flight, not 1")
    if not any(c.name == STATS_CONSUMER for c in consumers.get(EVENTS_STREAM, [])):
        problems.append("no 'stats' consumer on EVENTS: the stats service has not run")
    return _verdict("consumers", problems, f"{len(tasks)} on {TASKS_STREAM}, stats on EVENTS")


def check_duplicates(consumers: Mapping[str, Sequence[ConsumerInfo]]) -> Check:
    """More than one pull waiting on a worker's own consumer: two processes pull its queue."""
    problems = [
        f"{c.name} has {c.num_waiting} pulls waiting: more than one process pulls it "
        f"(look for a second unit or a leftover process of worker {worker_of_consumer(c.name)})"
        for c in consumers.get(TASKS_STREAM, [])
        if worker_of_consumer(c.name) and (c.num_waiting or 0) > 1
    ]
    return _verdict("duplicate consumers", problems, "one puller per worker consumer")


def check_ghost_queues(
    consumers: Mapping[str, Sequence[ConsumerInfo]],
    task_subjects: Mapping[str, int],
    records: Sequence[WorkerRecord],
    now: float,
    ttl_s: float,
) -> Check:
    """Tasks waiting where nobody pulls: a worker's consumer with pending tasks and no live
    worker, or queued tasks on a subject no consumer takes."""
    live = {r.worker_id for r in records if is_live(r, now, ttl_s)}
    tasks = consumers.get(TASKS_STREAM, [])
    problems: list[str] = []
    for info in tasks:
        worker = worker_of_consumer(info.name)
        pending = (info.num_pending or 0) + (info.num_ack_pending or 0)
        if worker is not None and pending and worker not in live:
            problems.append(f"{info.name}: {pending} task(s) waiting, worker {worker} is not live")
    filters = [c.config.filter_subject or ">" for c in tasks]
    for subject, count in sorted(task_subjects.items()):
        if count and not any(subject_matches(f, subject) for f in filters):
            problems.append(f"{subject}: {count} task(s) waiting, no consumer takes them")
    return _verdict("ghost queues", problems, "every waiting task has a live puller")


def check_registrations(records: Sequence[WorkerRecord], now: float, ttl_s: float) -> Check:
    """Registry entries whose heartbeat is no longer fresh (`is_fresh`): the process is gone,
    or stuck. A stopping worker's fresh entry is not stale, only not live."""
    problems = [
        f"{r.worker_id} on {r.host} (pid {r.pid}): last heartbeat {now - r.heartbeat_at:.0f} s "
        f"ago, TTL {ttl_s:g} s"
        for r in records
        if not is_fresh(r.heartbeat_at, now, ttl_s)
    ]
    live = sum(1 for r in records if is_live(r, now, ttl_s))
    return _verdict("stale registrations", problems, f"{live} worker(s) registered and fresh")


def check_versions(
    records: Sequence[WorkerRecord], services: Sequence[tuple[str, str, str]]
) -> Check:
    """Every registered worker and every micro service runs the same version."""
    seen: dict[str, list[str]] = {}
    for r in records:
        seen.setdefault(r.version, []).append(f"worker {r.worker_id}")
    for name, _, version in services:
        seen.setdefault(version, []).append(name)
    if len(seen) <= 1:
        return _ok("version skew", f"all on {next(iter(seen), 'unknown')}")
    return _problem(
        "version skew",
        [f"{v}: {', '.join(sorted(who))}" for v, who in sorted(seen.items())],
    )


def check_units(units: Mapping[str, Sequence[str]] | None) -> Check:
    if units is None:
        return Check("service units", "skipped", "not Linux")
    problems = [
        f"worker {worker} is started by {len(names)} units: {', '.join(sorted(names))} "
        "(disable all but one)"
        for worker, names in sorted(units.items())
        if len(names) > 1
    ]
    return _verdict("service units", problems, f"{len(units)} worker unit(s), one per worker")


def evaluate(g: Gathered) -> list[Check]:
    """Every check, in order, from what was gathered."""
    checks: list[Check] = []
    if g.server_version is None:
        return [Check("nats", "problem", g.nats_error or "cannot connect")]
    if g.jetstream is not None:
        return [
            _ok("nats", f"nats-server {g.server_version}"),
            Check("jetstream", "problem", g.jetstream),
        ]
    checks.append(_ok("nats", f"nats-server {g.server_version}, JetStream on"))
    checks.append(check_streams(g.streams))
    checks.append(check_consumers(g.consumers, g.records, g.now, g.ttl_s))
    if g.postgres is None:
        checks.append(Check("postgresql", "skipped", "PG_DSN not set"))
    elif g.postgres:
        checks.append(Check("postgresql", "problem", g.postgres))
    else:
        checks.append(_ok("postgresql", g.postgres_detail))
    backend_problems = [f"{w}: {p}" for w, p in sorted(g.backends.items()) if p]
    checks.append(
        _verdict("worker backends", backend_problems, f"{len(g.backends)} answered or skipped")
    )
    checks.append(check_duplicates(g.consumers))
    checks.append(check_ghost_queues(g.consumers, g.task_subjects, g.records, g.now, g.ttl_s))
    checks.append(check_registrations(g.records, g.now, g.ttl_s))
    checks.append(check_versions(g.records, g.services))
    checks.append(check_units(g.units))
    return checks


# -- systemd units (file parsing only: no systemctl) -------------------------------------------

_WORKER_COMMAND = re.compile(r"\bcoordinator\b.*\s(worker|web-search)\b|\bworker\.py\b")


def unit_worker_ids(
    units: Iterable[tuple[str, Path]], default_id: str | None = None
) -> dict[str, list[str]]:
    """Which worker each unit starts, for ``(unit name, file to read)`` pairs: its
    ``WORKER_ID`` from ``Environment=``, an ``EnvironmentFile=`` or the command line, with a
    template's ``%i`` read as the instance name; a unit that runs a worker with no id starts the
    host's default one. Returns worker id -> unit names."""
    default = default_id or default_worker_id()
    found: dict[str, set[str]] = {}
    for name, path in units:
        unit = _read_unit(path)
        if unit is None:
            continue
        exec_start = " ".join(unit.get("ExecStart", []))
        if not _WORKER_COMMAND.search(exec_start):
            continue
        instance = name.split("@", 1)[1].rsplit(".", 1)[0] if "@" in name else ""
        if "@" in name and not instance:
            continue  # a template: its instances are what run
        worker_id: str | None = None
        for line in unit.get("Environment", []):
            for item in _split_words(line):
                key, _, value = item.partition("=")
                if key == "WORKER_ID":
                    worker_id = value
        for env_file in unit.get("EnvironmentFile", []):
            worker_id = (
                _worker_id_in(Path(env_file.lstrip("-").replace("%i", instance))) or worker_id
            )
        match = re.search(r"WORKER_ID=(\S+)", exec_start)
        if match:
            worker_id = match.group(1)
        worker_id = (worker_id or default).replace("%i", instance).replace("%I", instance)
        found.setdefault(worker_id, set()).add(name)
    return {worker: sorted(names) for worker, names in found.items()}


def scan_unit_dirs(
    dirs: Iterable[str | Path], default_id: str | None = None
) -> dict[str, list[str]]:
    """`unit_worker_ids` over the unit files in ``dirs`` and their ``*.wants`` folders, where
    an enabled template instance (``coordinator-worker@cpu1.service``) is a link whose file is
    the template."""
    units: dict[str, Path] = {}
    for folder in dirs:
        base = Path(folder).expanduser()
        if not base.is_dir():
            continue
        for path in sorted([*base.glob("*.service"), *base.glob("*.wants/*.service")]):
            if path.name not in units and path.exists():
                units[path.name] = path
    return unit_worker_ids(units.items(), default_id)


def _read_unit(path: Path) -> dict[str, list[str]] | None:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return None
    values: dict[str, list[str]] = {}
    for raw in text.replace("\\\n", " ").splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";", "[")) or "=" not in line:
            continue
        key, _, value = line.partition("=")
        values.setdefault(key.strip(), []).append(value.strip())
    return values


def _split_words(line: str) -> list[str]:
    return [w.strip('"') for w in re.findall(r'"[^"]*"|\S+', line)]


def _worker_id_in(path: Path) -> str | None:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return None
    for raw in text.splitlines():
        key, _, value = raw.strip().removeprefix("export ").partition("=")
        if key.strip() == "WORKER_ID":
            return value.strip().strip("\"'") or None
    return None


# -- gathering (I/O) ---------------------------------------------------------------------------


def _loopback(url: str) -> bool:
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    with contextlib.suppress(ValueError):
        return ipaddress.ip_address(host).is_loopback
    return False


async def _probe_backend(record: WorkerRecord, here: str) -> str | None:
    """None when the worker's model server answers its model list; else what is wrong."""
    import httpx

    url = record.backend_url
    if not url:
        return None  # an older worker that does not say
    if _loopback(url) and record.host.split(".")[0] != here:
        return None  # its own loopback: only reachable from its host
    path = "/models" if record.backend == "openai" else "/api/tags"
    try:
        async with httpx.AsyncClient(timeout=3.0) as client:
            reply = await client.get(url.rstrip("/") + path)
    except httpx.HTTPError as exc:
        return f"{record.backend} at {url} cannot be reached ({type(exc).__name__})"
    if reply.status_code != 200:
        return f"{record.backend} at {url} answered {path} with HTTP {reply.status_code}"
    return None


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


async def gather(
    nats_url: str,
    *,
    pg_dsn: str | None,
    unit_dirs: Sequence[str | Path] | None,
    info_wait_s: float = 0.5,
) -> Gathered:
    import msgspec
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
        js = nc.jetstream(timeout=3.0)
        try:
            await js.account_info()
        except Exception as exc:
            g.jetstream = f"not available: {exc!r}"
            return g
        for name in (
            TASKS_STREAM,
            EVENTS_STREAM,
            *(f"KV_{b}" for b in (WORKERS_BUCKET, STATS_BUCKET, ASLEEP_BUCKET)),
        ):
            try:
                g.streams[name] = await js.stream_info(name)
            except nats.js.errors.NotFoundError:
                g.streams[name] = None
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
            try:
                keys = await kv.keys()
            except nats.js.errors.NoKeysError:
                keys = []
            for key in keys:
                with contextlib.suppress(nats.js.errors.KeyNotFoundError, msgspec.DecodeError):
                    entry = await kv.get(key)
                    g.records.append(worker_record_decoder.decode(entry.value or b""))
        g.services = await _service_infos(nc, info_wait_s)
    finally:
        await nc.close()
    here = socket.gethostname().split(".")[0]
    problems = await asyncio.gather(*(_probe_backend(r, here) for r in g.records))
    g.backends = {r.worker_id: p for r, p in zip(g.records, problems, strict=True)}
    if pg_dsn:
        g.postgres, g.postgres_detail = await _probe_postgres(pg_dsn)
    return g


async def _probe_postgres(dsn: str) -> tuple[str, str]:
    import asyncpg

    try:
        conn = await asyncpg.connect(dsn, timeout=3.0)
    except Exception as exc:
        return f"cannot connect: {type(exc).__name__}: {exc}", ""
    try:
        version = await conn.fetchval("show server_version")
        projected = await conn.fetchval("select to_regclass('tasks') is not null")
    finally:
        await conn.close()
    return "", f"PostgreSQL {version}" + ("" if projected else ", no stats tables yet")


async def run_doctor(
    nats_url: str,
    *,
    pg_dsn: str | None = None,
    unit_dirs: Sequence[str | Path] | None = None,
) -> list[Check]:
    return evaluate(await gather(nats_url, pg_dsn=pg_dsn, unit_dirs=unit_dirs))


def register(sub: Any) -> None:
    doctor = sub.add_parser(
        "doctor",
        help="check NATS, streams, consumers, PostgreSQL, workers and service units",
        description="One line per check; exit 1 when one found a problem. Reads NATS_URL (or "
        "the stack `coordinator up` recorded), the NATS_* credentials (use the admin user) and "
        "PG_DSN.",
    )
    doctor.add_argument(
        "--unit-dir",
        action="append",
        dest="unit_dirs",
        help=f"where systemd units are (repeat; default on Linux: {', '.join(DEFAULT_UNIT_DIRS)})",
    )
    doctor.set_defaults(func=cmd_doctor)


def cmd_doctor(args: argparse.Namespace) -> int:
    from services.cli.client import find_nats_url
    from services.runtime.logging import setup_logging

    setup_logging("error", "console", stream=sys.stderr)
    unit_dirs = args.unit_dirs or (list(DEFAULT_UNIT_DIRS) if sys.platform == "linux" else None)
    checks = asyncio.run(
        run_doctor(find_nats_url(), pg_dsn=os.environ.get("PG_DSN") or None, unit_dirs=unit_dirs)
    )
    for check in checks:
        print(check.line())
    return EXIT_PROBLEM if any(c.status == "problem" for c in checks) else 0
