"""``coordinator setup | health | deploy render``: what running the fleet for real needs.

- ``setup`` (with the admin NATS user) creates the streams and buckets every service uses, so
  that services whose users may not create streams can start (deploy/nats/nats-server.conf).
- ``health ROLE`` answers a container's or a unit's health check: the role's service answers
  a NATS micro ``PING``, or the worker's registry entry is fresh.
- ``deploy render systemd|launchd|nats`` prints a unit, a launchd agent or the NATS server
  configuration (one user per role, with only the subjects that role needs).

The NATS permissions are built here from the same names the services use (subjects, consumer
names), so the configuration cannot drift from the code: the committed
``deploy/nats/nats-server.conf`` is this module's rendering, and a test holds them equal.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from schemas.subjects import (
    ASLEEP_BUCKET,
    EVENTS_STREAM,
    REAPER_SERVICE,
    REAPER_STATUS,
    ROUTE,
    SHARED_CONSUMER,
    SHARED_CPU_QUEUE,
    STATS,
    STATS_BUCKET,
    STATS_CONSUMER,
    TASK,
    TASKS_STREAM,
    WEB_CONSUMER,
    WEB_QUEUE,
    WORKERS,
    WORKERS_BUCKET,
    InvalidId,
    check_worker_id,
    worker_consumer,
    worker_queue_filter,
)
from services.fleet.liveness import is_fresh
from services.runtime.errors import ConfigError
from services.runtime.settings import (
    GatewaySettings,
    NatsAuth,
    Settings,
    SetupSettings,
    WebSearchSettings,
    WorkerSettings,
)

EXIT_FAILED = 1

DEPLOY_DIR: Final = Path(__file__).resolve().parents[2] / "deploy"

# Each service role: the `coordinator` command that runs it, and how `coordinator health`
# tells it is up: its NATS micro service answers PING (``$SRV.PING.<name>``); its registry
# entry is fresh (workers); its HTTP endpoint answers (the gateway); or, for the reaper, which
# shows itself nowhere on the bus, that NATS and the TASKS stream answer its user.
SERVICE_ROLES: Final[dict[str, tuple[str, ...]]] = {
    "router": ("router",),
    "stats": ("stats", "serve"),
    "reaper": ("reaper",),
    "gateway": ("gateway",),
    "web-search": ("web-search",),
    "worker": ("worker",),
}
MICRO_SERVICES: Final = {
    "router": "coordinator-router",
    "stats": "coordinator-stats",
    "reaper": REAPER_SERVICE,
}
# Roles with one process per WORKER_ID: a systemd template unit whose instance is the id.
PER_WORKER: Final = frozenset({"worker", "web-search"})

# -- NATS users and permissions ---------------------------------------------------------------


@dataclass
class Permissions:
    """One NATS user's permissions: subjects it may publish to and subscribe to."""

    publish: list[str] = field(default_factory=list)
    subscribe: list[str] = field(default_factory=list)
    publish_deny: list[str] = field(default_factory=list)


def _api(*suffixes: str) -> list[str]:
    return [f"$JS.API.{suffix}" for suffix in suffixes]


def _stream_info(*streams: str) -> list[str]:
    return _api(*(f"STREAM.INFO.{stream}" for stream in streams))


def _kv(bucket: str) -> str:
    return f"KV_{bucket}"


# What every service does: JetStream API replies and request replies arrive on inboxes.
_INBOX: Final = "_INBOX.>"
# Reading a KV bucket whole (watch, keys) is an ordered consumer on its stream.
_KV_WATCH = [
    *(f"$JS.API.CONSUMER.CREATE.{_kv(b)}" for b in (WORKERS_BUCKET, STATS_BUCKET, ASLEEP_BUCKET)),
    *(f"$JS.API.CONSUMER.CREATE.{_kv(b)}.>" for b in (WORKERS_BUCKET, STATS_BUCKET, ASLEEP_BUCKET)),
    *(f"$JS.API.CONSUMER.INFO.{_kv(b)}.*" for b in (WORKERS_BUCKET, STATS_BUCKET, ASLEEP_BUCKET)),
]
# The alias map (services/runtime/aliases.py): a named ordered consumer whose create request
# names its filter; only the alias events can be read this way.
_ALIASES = [
    f"$JS.API.CONSUMER.CREATE.{EVENTS_STREAM}.*.events.stats.alias.>",
    f"$JS.API.CONSUMER.INFO.{EVENTS_STREAM}.*",
    # Ordered consumers answer the server's flow control.
    "$JS.FC.>",
]
# A worker's reads of its tasks' events (services/runtime/outcomes.py: the current attempt,
# an outcome already stored, who started it), by subject: never a prompt (``submitted``).
_OUTCOME_READS = [
    f"$JS.API.DIRECT.GET.{EVENTS_STREAM}.events.task.*.{kind}"
    for kind in ("routed", "started", "completed", "failed")
]
_TASK_OUTCOMES = [f"events.task.*.{kind}" for kind in ("started", "completed", "failed")]
# The registry: read any entry (a web worker checks whether another is alive), write one's own.
_REGISTRY_READS = [
    f"$JS.API.STREAM.MSG.GET.{_kv(WORKERS_BUCKET)}",
    f"$JS.API.DIRECT.GET.{_kv(WORKERS_BUCKET)}.>",
]
# Service roles answer requests and PINGs as NATS micro services.
_MICRO = ["$SRV.>"]


def role_permissions(role: str, worker_id: str | None = None) -> Permissions:
    """What one role's NATS user may do. ``worker_id`` for ``worker`` and ``web-search``."""
    if role in PER_WORKER:
        if worker_id is None:
            raise ConfigError(f"role {role} needs a worker id")
        try:
            check_worker_id(worker_id)
        except InvalidId as exc:
            raise ConfigError(str(exc)) from None
    if role == "worker":
        assert worker_id is not None
        own, queues = worker_consumer(worker_id), worker_queue_filter(worker_id)
        return Permissions(
            publish=[
                *_stream_info(TASKS_STREAM, EVENTS_STREAM, _kv(WORKERS_BUCKET), _kv(ASLEEP_BUCKET)),
                # Its own consumer, only with its own queues as the filter; the shared CPU pool.
                f"$JS.API.CONSUMER.CREATE.{TASKS_STREAM}.{own}.{queues}",
                f"$JS.API.CONSUMER.CREATE.{TASKS_STREAM}.{SHARED_CONSUMER}.{SHARED_CPU_QUEUE}",
                *(
                    f"$JS.API.CONSUMER.{verb}.{TASKS_STREAM}.{name}"
                    for verb in ("INFO", "MSG.NEXT")
                    for name in (own, SHARED_CONSUMER)
                ),
                f"$JS.ACK.{TASKS_STREAM}.{own}.>",
                f"$JS.ACK.{TASKS_STREAM}.{SHARED_CONSUMER}.>",
                *_TASK_OUTCOMES,
                f"events.worker.{worker_id}.>",
                f"$KV.{WORKERS_BUCKET}.{worker_id}",
                f"$KV.{ASLEEP_BUCKET}.{worker_id}",
                *_REGISTRY_READS,
                *_OUTCOME_READS,
                *_ALIASES,
                # Streamed answers go to the client's reply inbox.
                _INBOX,
            ],
            # The stats service's durable consumer on EVENTS must not be re-filtered.
            publish_deny=[f"$JS.API.CONSUMER.CREATE.{EVENTS_STREAM}.{STATS_CONSUMER}.>"],
            subscribe=[_INBOX, "coordinator.cancel.*"],
        )
    if role == "web-search":
        assert worker_id is not None
        return Permissions(
            publish=[
                *_stream_info(TASKS_STREAM, EVENTS_STREAM, _kv(WORKERS_BUCKET)),
                f"$JS.API.CONSUMER.CREATE.{TASKS_STREAM}.{WEB_CONSUMER}.{WEB_QUEUE}",
                f"$JS.API.CONSUMER.INFO.{TASKS_STREAM}.{WEB_CONSUMER}",
                f"$JS.API.CONSUMER.MSG.NEXT.{TASKS_STREAM}.{WEB_CONSUMER}",
                f"$JS.ACK.{TASKS_STREAM}.{WEB_CONSUMER}.>",
                *_TASK_OUTCOMES,
                f"events.worker.{worker_id}.>",
                f"$KV.{WORKERS_BUCKET}.{worker_id}",
                *_REGISTRY_READS,
                *_OUTCOME_READS,
                _INBOX,
            ],
            subscribe=[_INBOX, "coordinator.cancel.*"],
        )
    if role == "router":
        return Permissions(
            publish=[
                *_api("STREAM.INFO.*", f"STREAM.MSG.GET.{EVENTS_STREAM}"),
                f"$JS.API.DIRECT.GET.{EVENTS_STREAM}.>",
                # Removing a task a woken worker never started.
                f"$JS.API.STREAM.MSG.DELETE.{TASKS_STREAM}",
                "tasks.>",
                *(f"events.task.*.{kind}" for kind in ("submitted", "routed", "failed")),
                "events.worker.*.wake_requested",
                "coordinator.cancel.*",
                *_KV_WATCH,
                *_ALIASES,
                "$SRV.PING.coordinator-router",
                # Whether a reaper runs decides who moves a retryable failure on.
                f"$SRV.PING.{REAPER_SERVICE}",
                _INBOX,
            ],
            subscribe=[
                _INBOX,
                *_MICRO,
                ROUTE,
                WORKERS,
                "coordinator.cancel",
                "events.task.>",
                "events.worker.*.duplicate",
            ],
        )
    if role == "stats":
        return Permissions(
            publish=[
                *_api("STREAM.INFO.*", f"STREAM.MSG.GET.{EVENTS_STREAM}"),
                f"$JS.API.DIRECT.GET.{EVENTS_STREAM}.>",
                f"$JS.API.CONSUMER.DURABLE.CREATE.{EVENTS_STREAM}.{STATS_CONSUMER}",
                f"$JS.API.CONSUMER.INFO.{EVENTS_STREAM}.*",
                f"$JS.API.CONSUMER.MSG.NEXT.{EVENTS_STREAM}.{STATS_CONSUMER}",
                f"$JS.ACK.{EVENTS_STREAM}.{STATS_CONSUMER}.>",
                # A rebuild replays the whole log through an ordered consumer.
                f"$JS.API.CONSUMER.CREATE.{EVENTS_STREAM}",
                f"$JS.API.CONSUMER.CREATE.{EVENTS_STREAM}.>",
                "$JS.FC.>",
                "events.stats.>",
                f"$KV.{STATS_BUCKET}.>",
                *_KV_WATCH,
                "$SRV.PING.coordinator-stats",
                _INBOX,
            ],
            subscribe=[_INBOX, *_MICRO, TASK, STATS, "coordinator.stats.>"],
        )
    if role == "reaper":
        # Watches the registry, the consumers and the task events; re-routes or fails tasks.
        return Permissions(
            publish=[
                *_api(
                    "STREAM.INFO.*",
                    f"STREAM.MSG.GET.{EVENTS_STREAM}",
                    f"STREAM.MSG.GET.{TASKS_STREAM}",
                    f"STREAM.MSG.DELETE.{TASKS_STREAM}",
                    f"CONSUMER.LIST.{TASKS_STREAM}",
                    f"CONSUMER.NAMES.{TASKS_STREAM}",
                    f"CONSUMER.INFO.{TASKS_STREAM}.*",
                    f"CONSUMER.CREATE.{EVENTS_STREAM}",
                    f"CONSUMER.CREATE.{EVENTS_STREAM}.>",
                    f"CONSUMER.DURABLE.CREATE.{EVENTS_STREAM}.reaper",
                    f"CONSUMER.INFO.{EVENTS_STREAM}.*",
                    f"CONSUMER.MSG.NEXT.{EVENTS_STREAM}.reaper",
                ),
                f"$JS.API.DIRECT.GET.{EVENTS_STREAM}.>",
                f"$JS.ACK.{EVENTS_STREAM}.reaper.>",
                "$JS.FC.>",
                "tasks.>",
                "events.task.>",
                "events.worker.>",
                *_KV_WATCH,
                *_ALIASES,
                f"$SRV.PING.{REAPER_SERVICE}",  # its health check
                _INBOX,
            ],
            subscribe=[_INBOX, *_MICRO, REAPER_STATUS, "events.task.>", "events.worker.>"],
        )
    if role == "gateway":
        return Permissions(
            publish=[ROUTE, TASK, WORKERS, STATS, "coordinator.cancel"],
            subscribe=[_INBOX, *_MICRO],
        )
    if role == "client":
        # People's commands (ask, task, workers, stats, alias): requests only.
        return Permissions(
            publish=[ROUTE, TASK, WORKERS, STATS, "coordinator.stats.>", "coordinator.cancel"],
            subscribe=[_INBOX],
        )
    if role == "jobs":
        # judge and bench: requests, their own events, and reading events by subject.
        return Permissions(
            publish=[
                ROUTE,
                WORKERS,
                STATS,
                "coordinator.stats.>",
                *_stream_info(EVENTS_STREAM),
                f"$JS.API.STREAM.MSG.GET.{EVENTS_STREAM}",
                f"$JS.API.DIRECT.GET.{EVENTS_STREAM}.>",
                "events.quality.>",
                "events.bench.>",
            ],
            subscribe=[_INBOX],
        )
    raise ConfigError(f"unknown role {role!r}")


def nats_user(role: str, worker_id: str | None = None) -> str:
    """The NATS user name of a role: the role, or ``worker-<id>`` / ``web-<id>``."""
    if role == "worker":
        return f"worker-{worker_id}"
    if role == "web-search":
        return f"web-{worker_id}"
    return role


def password_variable(user: str) -> str:
    """The environment variable nats-server reads a user's password from: ``<USER>_PASSWORD``."""
    return re.sub(r"[^A-Za-z0-9]", "_", user).upper() + "_PASSWORD"


def _conf_list(subjects: Iterable[str]) -> str:
    items = "".join(f'            "{s}",\n' for s in dict.fromkeys(subjects))
    return f"[\n{items}          ]"


def render_nats_user(role: str, worker_id: str | None = None) -> str:
    """One entry of the configuration's ``users`` list."""
    user = nats_user(role, worker_id)
    perms = role_permissions(role, worker_id)
    publish = f"          allow: {_conf_list(perms.publish)}\n"
    if perms.publish_deny:
        publish += f"          deny: {_conf_list(perms.publish_deny)}\n"
    return (
        f"    {{ user: {user}, password: ${password_variable(user)}, permissions: {{\n"
        f"        publish: {{\n{publish}        }}\n"
        f"        subscribe: {{\n          allow: {_conf_list(perms.subscribe)}\n        }}\n"
        f"    }} }}\n"
    )


NATS_ROLES: Final = ("router", "stats", "reaper", "gateway", "client", "jobs")


def render_nats_conf(workers: Iterable[str], web_workers: Iterable[str]) -> str:
    """The whole server configuration: JetStream, and one user per role and worker."""
    template = (DEPLOY_DIR / "nats" / "nats-server.conf.in").read_text()
    users = [f"    {{ user: admin, password: ${password_variable('admin')} }}\n"]
    users += [render_nats_user(role) for role in NATS_ROLES]
    users += [render_nats_user("worker", w) for w in workers]
    users += [render_nats_user("web-search", w) for w in web_workers]
    return template.replace("@USERS@\n", "".join(users))


# Who the committed deploy/nats/nats-server.conf is rendered for (docker-compose.yml's fleet).
EXAMPLE_WORKERS: Final = ("cpu1",)
EXAMPLE_WEB_WORKERS: Final = ("search1",)


# -- service units -----------------------------------------------------------------------------


def read_env_file(path: Path) -> dict[str, str]:
    """``KEY=value`` lines (systemd's EnvironmentFile and a shell's ``set -a; .`` both read
    them); ``#`` comments and blank lines are skipped, one level of quotes removed."""
    values: dict[str, str] = {}
    for line in path.read_text().splitlines():
        text = line.strip()
        if not text or text.startswith("#") or "=" not in text:
            continue
        key, _, value = text.removeprefix("export ").partition("=")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
            value = value[1:-1]
        values[key.strip()] = value
    return values


def _fill(template: str, values: Mapping[str, str]) -> str:
    for key, value in values.items():
        template = template.replace(f"@{key}@", value)
    left = re.findall(r"@[A-Z_]+@", template)
    if left:
        raise ConfigError(f"template placeholders left unfilled: {', '.join(sorted(set(left)))}")
    return template


def render_systemd(role: str, env_file: Path, *, coordinator: str, user: str) -> str:
    """The unit for ``role``: ``coordinator-<role>.service``, or for a worker role the template
    ``coordinator-<role>@.service`` whose instance name is the WORKER_ID."""
    command = SERVICE_ROLES[role]
    name = "coordinator-role@.service.in" if role in PER_WORKER else "coordinator-role.service.in"
    return _fill(
        (DEPLOY_DIR / "systemd" / name).read_text(),
        {
            "ROLE": role,
            "ENV_FILE": str(env_file),
            "COORDINATOR": coordinator,
            "COMMAND": " ".join(command),
            "USER": user,
        },
    )


def systemd_unit_name(role: str, worker_id: str | None = None) -> str:
    if role in PER_WORKER:
        return f"coordinator-{role}@{worker_id or ''}.service"
    return f"coordinator-{role}.service"


def render_launchd(
    role: str, env_file: Path, *, coordinator: str, worker_id: str | None, log_dir: Path
) -> str:
    """A LaunchAgent for macOS: the env file is read at each start (``launchctl kickstart -k``
    after editing it), so it stays the one place the settings live."""
    command = SERVICE_ROLES[role]
    label = launchd_label(role, worker_id)
    # The label's worker id wins over one in the env file, as a systemd instance name does.
    script = 'set -a; . "$0"; ' + ('WORKER_ID="$2"; ' if role in PER_WORKER else "")
    parts = ["/bin/sh", "-c", f'{script}exec "$1" {" ".join(command)}', str(env_file), coordinator]
    if role in PER_WORKER:
        parts.append(worker_id or "")
    arguments = "\n".join(f"    <string>{_xml(part)}</string>" for part in parts)
    return _fill(
        (DEPLOY_DIR / "launchd" / "coordinator.plist.in").read_text(),
        {"LABEL": label, "ARGUMENTS": arguments, "LOG": _xml(str(log_dir / f"{label}.log"))},
    )


def launchd_label(role: str, worker_id: str | None) -> str:
    return f"org.coordinator.{role}" + (f".{worker_id}" if role in PER_WORKER else "")


def _xml(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


# -- setup and health --------------------------------------------------------------------------


async def setup_streams(
    nats_url: str,
    *,
    worker_ttl_s: float,
    events_max_age_s: float,
    auth: NatsAuth | None = None,
) -> None:
    """Create or update every stream and bucket (needs a user that may: ``admin``)."""
    from services.runtime.bus import connect, ensure_bucket, ensure_streams

    nc = await connect(nats_url, "coordinator-setup", auth=auth)
    try:
        js = nc.jetstream()
        await ensure_streams(js, worker_ttl_s=worker_ttl_s, events_max_age_s=events_max_age_s)
        await ensure_bucket(js, STATS_BUCKET, ttl_s=None)
        await ensure_bucket(js, ASLEEP_BUCKET, ttl_s=None)
    finally:
        await nc.close()


async def check_health(role: str, env: Mapping[str, str] | None = None) -> str:
    """Why ``role`` is unhealthy here, or ``""`` when it is healthy."""
    from services.runtime.bus import connect

    if role == "gateway":
        return await _gateway_health(GatewaySettings.from_env(env))
    settings: Settings
    if role in PER_WORKER:
        settings = (WorkerSettings if role == "worker" else WebSearchSettings).from_env(env)
    else:
        settings = Settings.from_env(env)
    try:
        # Outside a service, connect() gives up at the first failure (Unavailable, naming the URL).
        nc = await connect(
            settings.nats_url,
            f"coordinator-health-{role}",
            connect_timeout_s=2.0,
            auth=settings.nats_auth(),
        )
    except Exception as exc:
        return str(exc) or f"cannot reach NATS at {settings.nats_url}: {type(exc).__name__}"
    try:
        if role in MICRO_SERVICES:
            try:
                await nc.request(f"$SRV.PING.{MICRO_SERVICES[role]}", b"", timeout=3.0)
            except Exception as exc:
                return f"{MICRO_SERVICES[role]} does not answer PING ({type(exc).__name__})"
            return ""
        if isinstance(settings, WorkerSettings | WebSearchSettings):
            return await _registry_health(nc, settings)
        try:
            await nc.jetstream(timeout=3.0).stream_info(TASKS_STREAM)
        except Exception as exc:
            return f"stream {TASKS_STREAM} does not answer ({type(exc).__name__})"
        return ""
    finally:
        await nc.close()


async def _registry_health(nc: Any, settings: WorkerSettings | WebSearchSettings) -> str:
    """What is wrong with this host's worker's registry entry, or "" when it is fresh.

    Freshness only (`is_fresh`): a worker that is stopping is still this host's, healthy.
    """
    import msgspec
    from nats.js.errors import KeyNotFoundError, NotFoundError

    from schemas.workers import worker_record_decoder

    try:
        kv = await nc.jetstream(timeout=3.0).key_value(WORKERS_BUCKET)
        entry = await kv.get(settings.worker_id)
        record = worker_record_decoder.decode(entry.value or b"")
    except (KeyNotFoundError, NotFoundError, msgspec.DecodeError):
        return f"worker {settings.worker_id} is not registered"
    now = time.time()
    if not is_fresh(record.heartbeat_at, now, settings.worker_ttl_s):
        return f"worker {settings.worker_id}: last heartbeat {now - record.heartbeat_at:.0f} s ago"
    if record.host != settings.worker_host:
        return f"worker {settings.worker_id} runs on {record.host}, not here"
    return ""


async def _gateway_health(settings: GatewaySettings) -> str:
    import httpx

    host = "127.0.0.1" if settings.gateway_host in ("0.0.0.0", "::", "") else settings.gateway_host
    url = f"http://{host}:{settings.gateway_port}/api/version"
    try:
        async with httpx.AsyncClient(timeout=3.0) as client:
            reply = await client.get(url)
    except httpx.HTTPError as exc:
        return f"{url}: {type(exc).__name__}"
    return "" if reply.status_code == 200 else f"{url}: HTTP {reply.status_code}"


# -- the commands ------------------------------------------------------------------------------


def register(sub: Any) -> None:
    """Add ``setup``, ``health`` and ``deploy`` to the ``coordinator`` parser."""
    setup = sub.add_parser(
        "setup",
        help="create or update the streams and buckets (with the admin NATS user)",
        description="Reads NATS_URL and the NATS_* credentials, WORKER_TTL_S and "
        "EVENTS_MAX_AGE_S (0: keep every event).",
    )
    setup.set_defaults(func=cmd_setup)

    health = sub.add_parser(
        "health", help="exit 0 when this role's service is healthy (container health checks)"
    )
    health.add_argument("role", choices=sorted(SERVICE_ROLES))
    health.set_defaults(func=cmd_health)

    deploy = sub.add_parser("deploy", help="service units and the NATS server configuration")
    deploy_sub = deploy.add_subparsers(dest="deploy_command", required=True, metavar="ACTION")
    render = deploy_sub.add_parser("render", help="print a unit, a launchd agent or nats.conf")
    kinds = render.add_subparsers(dest="kind", required=True, metavar="KIND")

    systemd = kinds.add_parser("systemd", help="a systemd unit for one role")
    launchd = kinds.add_parser("launchd", help="a launchd agent (macOS) for one role")
    for p in (systemd, launchd):
        p.add_argument("--role", required=True, choices=sorted(SERVICE_ROLES))
        p.add_argument("--env-file", required=True, type=Path, help="KEY=value settings file")
        p.add_argument(
            "--coordinator",
            default=str(Path(sys.executable).parent / "coordinator"),
            help="the coordinator command (default: this venv's)",
        )
    systemd.add_argument("--user", default="coordinator", help="the account the unit runs as")
    launchd.add_argument("--worker-id", help="default: WORKER_ID from the env file")
    launchd.add_argument(
        "--log-dir", type=Path, default=Path("~/Library/Logs").expanduser(), help="where logs go"
    )
    systemd.set_defaults(func=cmd_render_systemd)
    launchd.set_defaults(func=cmd_render_launchd)

    nats = kinds.add_parser("nats", help="nats-server.conf: JetStream and one user per role")
    nats.add_argument("--worker", action="append", default=[], help="a worker id (repeat)")
    nats.add_argument("--web-worker", action="append", default=[], help="a web-search worker id")
    nats.set_defaults(func=cmd_render_nats)


def cmd_setup(args: argparse.Namespace) -> int:
    settings = SetupSettings.from_env()
    asyncio.run(
        setup_streams(
            settings.nats_url,
            worker_ttl_s=settings.worker_ttl_s,
            events_max_age_s=settings.events_max_age_s,
            auth=settings.nats_auth(),
        )
    )
    print(
        f"streams {TASKS_STREAM}, {EVENTS_STREAM} and the buckets are ready on {settings.nats_url}"
    )
    return 0


def cmd_health(args: argparse.Namespace) -> int:
    from services.runtime.logging import setup_logging

    setup_logging("error", "console", stream=sys.stderr)
    problem = asyncio.run(check_health(args.role))
    if problem:
        print(f"unhealthy: {problem}", file=sys.stderr)
        return EXIT_FAILED
    print("healthy")
    return 0


def cmd_render_systemd(args: argparse.Namespace) -> int:
    _check_env_file(args.env_file)
    unit = render_systemd(
        args.role, args.env_file.absolute(), coordinator=args.coordinator, user=args.user
    )
    print(unit, end="")
    return 0


def cmd_render_launchd(args: argparse.Namespace) -> int:
    values = _check_env_file(args.env_file)
    worker_id = args.worker_id or values.get("WORKER_ID")
    if args.role in PER_WORKER and not worker_id:
        raise ConfigError(f"--role {args.role}: give --worker-id or set WORKER_ID in the env file")
    print(
        render_launchd(
            args.role,
            args.env_file.absolute(),
            coordinator=args.coordinator,
            worker_id=worker_id,
            log_dir=args.log_dir,
        ),
        end="",
    )
    return 0


def cmd_render_nats(args: argparse.Namespace) -> int:
    print(render_nats_conf(args.worker, args.web_worker), end="")
    return 0


def _check_env_file(path: Path) -> dict[str, str]:
    if not path.is_file():
        raise ConfigError(f"--env-file {path}: no such file")
    return read_env_file(path)
