"""``coordinator doctor``'s checks: pure functions of what was gathered (`Gathered`).

Each check gives one line: NATS and JetStream, the streams, buckets and consumers as the
services make them, PostgreSQL and the stats read model (does it hold the events ``EVENTS``
holds, are events parked), each live worker's model server (from its own probe, in its
registration), and the fleet's known
failure modes: duplicate consumers (two processes pulling one worker's queue), ghost queues
(tasks waiting where nobody pulls), stale registrations (a heartbeat older than the TTL),
version skew between services and systemd units that start the same worker; on a JetStream
cluster also its peers, meta leader and each stream's replicas (`doctor_cluster`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final

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
from services.cli.doctor_cluster import MetaGroup, cluster_checks
from services.cli.doctor_line import Check, ok, problem, verdict
from services.fleet.liveness import is_fresh, is_live

DEFAULT_TTL_S: Final = 15.0


@dataclass(frozen=True)
class ReadModel:
    """The stats read model's record of what it handled, as `gather` read it from PostgreSQL
    (and ``EVENTS``, for ``last_matches``)."""

    handled: int
    """Positions it has applied or parked (tracking rows)."""
    last_seq: int
    """The highest of them; 0 when none."""
    last_matches: bool | None
    """Whether ``EVENTS`` holds at ``last_seq`` the event applied there (digests compared);
    None when it cannot tell (no such message any more, a row from before digests)."""
    replaced: int = 0
    """Tracking rows set aside: events of a log ``EVENTS`` no longer holds."""
    replaced_from: int | None = None
    replaced_at: float | None = None
    """Where and when the latest setting aside began."""
    parked: int = 0
    newest_parked: str = ""
    """``#<seq> <kind>: <error>`` of the newest parked event."""


REBUILD_ADVICE: Final = (
    "run `coordinator stats rebuild` to count only what EVENTS holds (what only the older "
    "events counted leaves the figures)"
)


def check_read_model(model: ReadModel, events: StreamInfo | None) -> list[Check]:
    """Whether the read model holds the events ``EVENTS`` holds, and whether events are
    parked. A read model that holds events ``EVENTS`` does not (it was recreated: a new
    cluster, a lost volume; or restored from an older copy) is a problem until a rebuild;
    parked events are a warning (a rebuild tries them again, but an event whose data no table
    can hold stays parked for good)."""
    checks: list[Check] = []
    if events is not None:
        last = int(events.state.last_seq or 0)
        problems: list[str] = []
        if model.last_seq > last:
            problems.append(
                f"it has applied EVENTS up to #{model.last_seq}, but EVENTS ends at #{last}: "
                "EVENTS was recreated or restored from an older copy, and the events it "
                f"applied at #{last + 1}–#{model.last_seq} are no longer in it"
            )
        elif model.last_matches is False:
            problems.append(
                f"the event it applied at #{model.last_seq} is not the one EVENTS holds there: "
                "EVENTS was recreated (a new cluster, a lost volume) and holds another log, "
                "whose events it projects as they come"
            )
        if model.replaced:
            problems.append(
                f"it still counts {model.replaced} event(s) of an event log EVENTS no longer "
                f"holds (EVENTS held others from #{model.replaced_from} on, seen "
                f"{_local_time(model.replaced_at)})"
            )
        if problems:
            checks.append(problem("read model", [*problems, REBUILD_ADVICE]))
        else:
            checks.append(
                ok(
                    "read model",
                    f"{model.handled} events of EVENTS handled, up to #{model.last_seq} of #{last}",
                )
            )
    if model.parked:
        checks.append(
            Check(
                "parked events",
                "warning",
                f"{model.parked} event(s) cannot be projected and count in no figure; the "
                f"newest: {model.newest_parked} (`coordinator stats parked` lists them; once "
                "the cause is fixed, `coordinator stats rebuild` tries them again)",
            )
        )
    return checks


def _local_time(at: float | None) -> str:
    return "-" if at is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(at))


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
    read_model: ReadModel | None = None  # None: no stats tables (or PostgreSQL not read)
    units: dict[str, list[str]] | None = None  # worker id -> unit names; None: not Linux
    cluster: str | None = None  # the JetStream cluster's name; None: a single server
    meta: MetaGroup | None = None  # the cluster's meta group, as its leader sees it
    meta_error: str = ""  # why the meta group was not read
    unanswered: list[str] = field(default_factory=list)  # streams whose info timed out


def subject_matches(pattern: str, subject: str) -> bool:
    """NATS subject matching: ``*`` one token, ``>`` one or more at the end."""
    parts, tokens = pattern.split("."), subject.split(".")
    for i, part in enumerate(parts):
        if part == ">":
            return len(tokens) > i
        if i >= len(tokens) or (part != "*" and part != tokens[i]):
            return False
    return len(parts) == len(tokens)


def check_streams(found: Mapping[str, StreamInfo | None], unanswered: Sequence[str] = ()) -> Check:
    expected: dict[str, tuple[str, RetentionPolicy | None]] = {
        TASKS_STREAM: (TASKS_SUBJECTS, RetentionPolicy.WORK_QUEUE),
        EVENTS_STREAM: (EVENTS_SUBJECTS, RetentionPolicy.LIMITS),
    }
    problems: list[str] = []
    summary: list[str] = []
    for name, (subject, retention) in expected.items():
        info = found.get(name)
        if name in unanswered:
            problems.append(f"stream {name} does not answer")
            continue
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
        if found.get(f"KV_{bucket}") is None and f"KV_{bucket}" not in unanswered:
            problems.append(f"bucket {bucket} is missing (run `coordinator setup`)")
    return verdict("streams", problems, ", ".join(summary) + ", buckets present")


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
    return verdict("consumers", problems, f"{len(tasks)} on {TASKS_STREAM}, stats on EVENTS")


def check_duplicates(consumers: Mapping[str, Sequence[ConsumerInfo]]) -> Check:
    """More than one pull waiting on a worker's own consumer: two processes pull its queue."""
    problems = [
        f"{c.name} has {c.num_waiting} pulls waiting: more than one process pulls it "
        f"(look for a second unit or a leftover process of worker {worker_of_consumer(c.name)})"
        for c in consumers.get(TASKS_STREAM, [])
        if worker_of_consumer(c.name) and (c.num_waiting or 0) > 1
    ]
    return verdict("duplicate consumers", problems, "one puller per worker consumer")


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
    return verdict("ghost queues", problems, "every waiting task has a live puller")


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
    return verdict("stale registrations", problems, f"{live} worker(s) registered and fresh")


def check_backends(records: Sequence[WorkerRecord], now: float, ttl_s: float) -> Check:
    """Each live inference worker's backend, as the worker's own probe says in its
    registration (`services.fleet.health`), wherever the doctor runs: a degraded one is a
    problem with its reason. A worker that does not probe (an older version) is named."""
    problems: list[str] = []
    unprobed: list[str] = []
    inference = [
        r
        for r in sorted(records, key=lambda r: r.worker_id)
        if is_live(r, now, ttl_s) and INFERENCE_CAPABILITIES.intersection(r.supports)
    ]
    for r in inference:
        if r.health == "degraded":
            since = f" for {now - r.health_since:.0f} s" if r.health_since is not None else ""
            problems.append(
                f"{r.worker_id} ({r.backend} at {r.backend_url or '?'}): degraded{since}: "
                f"{r.health_reason or 'no reason given'}"
            )
        elif r.health_since is None:
            unprobed.append(r.worker_id)
    fine = f"{len(inference) - len(unprobed)} healthy by their own probes"
    if unprobed:
        fine += f"; {', '.join(unprobed)} do not probe their backend (older version)"
    return verdict("worker backends", problems, fine)


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
        return ok("version skew", f"all on {next(iter(seen), 'unknown')}")
    return problem(
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
    return verdict("service units", problems, f"{len(units)} worker unit(s), one per worker")


def evaluate(g: Gathered) -> list[Check]:
    """Every check, in order, from what was gathered."""
    checks: list[Check] = []
    if g.server_version is None:
        return [Check("nats", "problem", g.nats_error or "cannot connect")]
    if g.jetstream is not None:
        return [
            ok("nats", f"nats-server {g.server_version}"),
            Check("jetstream", "problem", g.jetstream),
        ]
    cluster = f", cluster {g.cluster}" if g.cluster else ""
    checks.append(ok("nats", f"nats-server {g.server_version}, JetStream on{cluster}"))
    if g.cluster:
        checks.extend(cluster_checks(g.meta, g.meta_error, g.streams, g.unanswered))
    checks.append(check_streams(g.streams, g.unanswered))
    checks.append(check_consumers(g.consumers, g.records, g.now, g.ttl_s))
    if g.postgres is None:
        checks.append(Check("postgresql", "skipped", "PG_DSN not set"))
    elif g.postgres:
        checks.append(Check("postgresql", "problem", g.postgres))
    else:
        checks.append(ok("postgresql", g.postgres_detail))
        if g.read_model is not None:
            checks.extend(check_read_model(g.read_model, g.streams.get(EVENTS_STREAM)))
    checks.append(check_backends(g.records, g.now, g.ttl_s))
    checks.append(check_duplicates(g.consumers))
    checks.append(check_ghost_queues(g.consumers, g.task_subjects, g.records, g.now, g.ttl_s))
    checks.append(check_registrations(g.records, g.now, g.ttl_s))
    checks.append(check_versions(g.records, g.services))
    checks.append(check_units(g.units))
    return checks
