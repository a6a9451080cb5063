"""The NATS server configuration: one user per role, with only the subjects that role needs.

The permissions are built here from the same names the services use (subjects, consumer
names), so the configuration cannot drift from the code: the committed
``deploy/nats/nats-server.conf`` is this module's rendering, and a test holds them equal.
Pure, but for reading the configuration's template.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Final

from schemas.subjects import (
    ALIAS_MAP,
    ALIASES,
    ASLEEP_BUCKET,
    CANCEL,
    CANCELS_FROM,
    CHUNKS,
    EVENTS_STREAM,
    GATEWAY_KEYS_BUCKET,
    LAST_EVENT,
    LEADERS_BUCKET,
    OWN_CONSUMER,
    REAPER_ROLE,
    REAPER_SERVICE,
    REAPER_STATUS,
    ROUTE,
    ROUTER_HOLDS,
    SHARED_CPU,
    STATS,
    STATS_BASELINES,
    STATS_BUCKET,
    STATS_CONSUMER,
    STATS_EXCLUSIONS,
    STATS_PROJECTING,
    STATS_ROLE,
    TASK,
    TASKS_STREAM,
    WEB,
    WORKERS,
    WORKERS_BUCKET,
    InvalidId,
    cancel_from,
    check_worker_id,
    inbox_prefix,
    worker_consumer,
)
from services.cli.roles import DEPLOY_DIR, PER_WORKER
from services.errors import ConfigError


@dataclass
class Permissions:
    """One NATS user's permissions: subjects it may publish to and subscribe to."""

    publish: list[str] = field(default_factory=list)
    subscribe: list[str] = field(default_factory=list)
    publish_deny: list[str] = field(default_factory=list)
    # May answer the requests it receives (their reply subjects, and nothing else of anyone's
    # inbox): the number of replies to one request, 0 for none.
    responses: int = 0


def _api(*suffixes: str) -> list[str]:
    return [f"$JS.API.{suffix}" for suffix in suffixes]


def _stream_info(*streams: str) -> list[str]:
    return _api(*(f"STREAM.INFO.{stream}" for stream in streams))


def _kv(bucket: str) -> str:
    return f"KV_{bucket}"


# Replies to a service's requests (JetStream's API included) arrive on its own inboxes
# (``_INBOX_<user>.…``, `inbox_prefix`), which no other user may read.
def _own_inbox(user: str) -> str:
    return f"{inbox_prefix(user)}.>"


# A service answers each request once (micro services, the stats endpoints); the router also
# passes on a streamed answer's chunks to the request's reply subject.
ONE_REPLY: Final = 1
STREAM_REPLIES: Final = 100_000
# How long a service may answer a request it received: the longest a route request waits
# (a task's timeout, a sleeping worker's wake, the margin) is well inside it.
RESPONSES_EXPIRE_S: Final = 2 * 3600
RESPONSES_EXPIRE: Final = f"{RESPONSES_EXPIRE_S // 3600}h"
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
# A worker reads nothing of the event log itself: a direct get cannot be kept to one task
# (a ``*`` in the task's place of its subject reads every task's last event, answers
# included). It asks the router about the tasks it holds (services/router/eventreads.py).
_TASK_EVENT_READS = [LAST_EVENT]


def _own_task_events(worker_id: str) -> list[str]:
    """A worker's task events, on subjects that name it (`services.fleet.binding`): it cannot
    record another worker's start or outcome, nor one as the router or the reaper."""
    return [f"events.task.*.{worker_id}.{kind}" for kind in ("started", "completed", "failed")]


# The registry: read any entry (a web worker checks whether another is alive), write one's own.
_REGISTRY_READS = [
    f"$JS.API.STREAM.MSG.GET.{_kv(WORKERS_BUCKET)}",
    f"$JS.API.DIRECT.GET.{_kv(WORKERS_BUCKET)}.>",
]
# Service roles answer requests and PINGs as NATS micro services.
_MICRO = ["$SRV.>"]


def _leader_lease(role: str) -> list[str]:
    """An active/standby role's lease (`services.runtime.leadership`): its own key of the
    ``leaders`` bucket only, to take, renew, read and delete; never another role's."""
    bucket = _kv(LEADERS_BUCKET)
    return [
        f"$KV.{LEADERS_BUCKET}.{role}",
        f"$JS.API.STREAM.MSG.GET.{bucket}",
        f"$JS.API.DIRECT.GET.{bucket}.$KV.{LEADERS_BUCKET}.{role}",
    ]


# What a client may ask the stats service: figures, and the lists behind them.
_STATS_READS = [STATS, STATS_EXCLUSIONS, STATS_BASELINES, ALIASES]


def role_permissions(
    role: str, worker_id: str | None = None, *, user: str | None = None
) -> Permissions:
    """What one role's NATS user may do. ``worker_id`` for ``worker`` and ``web-search``;
    ``user`` the identity whose inbox it reads (default: the role's password user)."""
    user = user or nats_user(role, worker_id)
    if role in PER_WORKER:
        if worker_id is None:
            raise ConfigError(f"role {role} needs a worker id")
        try:
            check_worker_id(worker_id)
        except InvalidId as exc:
            raise ConfigError(str(exc)) from None
    if role == "worker":
        assert worker_id is not None
        own = worker_consumer(worker_id)
        return Permissions(
            publish=[
                *_stream_info(TASKS_STREAM, EVENTS_STREAM, _kv(WORKERS_BUCKET), _kv(ASLEEP_BUCKET)),
                # It makes no consumer, its own included (whose limits are the fleet's: the
                # router makes it, `OWN_CONSUMER`); the shared CPU pool's is made by
                # `coordinator setup`. It only pulls them, and reads their info.
                OWN_CONSUMER,
                *(
                    f"$JS.API.CONSUMER.{verb}.{TASKS_STREAM}.{name}"
                    for verb in ("INFO", "MSG.NEXT")
                    for name in (own, SHARED_CPU.consumer)
                ),
                f"$JS.ACK.{TASKS_STREAM}.{own}.>",
                f"$JS.ACK.{TASKS_STREAM}.{SHARED_CPU.consumer}.>",
                *_own_task_events(worker_id),
                f"events.worker.{worker_id}.>",
                f"$KV.{WORKERS_BUCKET}.{worker_id}",
                f"$KV.{ASLEEP_BUCKET}.{worker_id}",
                *_REGISTRY_READS,
                *_TASK_EVENT_READS,
                # The alias map, from the router: no consumer on EVENTS of its own.
                ALIAS_MAP,
                # Streamed answers, for the router to pass on (never a client's inbox).
                f"coordinator.chunk.{worker_id}.*",
            ],
            subscribe=[_own_inbox(user), "coordinator.cancel.*"],
        )
    if role == "web-search":
        assert worker_id is not None
        return Permissions(
            publish=[
                *_stream_info(TASKS_STREAM, EVENTS_STREAM, _kv(WORKERS_BUCKET)),
                # The pool's consumer is made by `coordinator setup`: only pulled from here.
                f"$JS.API.CONSUMER.INFO.{TASKS_STREAM}.{WEB.consumer}",
                f"$JS.API.CONSUMER.MSG.NEXT.{TASKS_STREAM}.{WEB.consumer}",
                f"$JS.ACK.{TASKS_STREAM}.{WEB.consumer}.>",
                *_own_task_events(worker_id),
                f"events.worker.{worker_id}.>",
                f"$KV.{WORKERS_BUCKET}.{worker_id}",
                *_REGISTRY_READS,
                *_TASK_EVENT_READS,
            ],
            subscribe=[_own_inbox(user), "coordinator.cancel.*"],
        )
    if role == "router":
        return Permissions(
            publish=[
                *_api("STREAM.INFO.*", f"STREAM.MSG.GET.{EVENTS_STREAM}"),
                f"$JS.API.DIRECT.GET.{EVENTS_STREAM}.>",
                # Removing a task a woken worker never started.
                f"$JS.API.STREAM.MSG.DELETE.{TASKS_STREAM}",
                # A worker's own consumer, made as the fleet fixes it (`OWN_CONSUMER`).
                f"$JS.API.CONSUMER.CREATE.{TASKS_STREAM}.*.tasks.*.*",
                "tasks.>",
                *(f"events.task.*.{kind}" for kind in ("submitted", "routed", "failed")),
                "events.worker.*.wake_requested",
                "coordinator.cancel.*",
                *_KV_WATCH,
                *_ALIASES,
                "$SRV.PING.coordinator-router",
                # Whether a reaper runs decides who moves a retryable failure on.
                f"$SRV.PING.{REAPER_SERVICE}",
                # Which router holds a waiting request or a task being submitted.
                ROUTER_HOLDS,
                # The tasks under way at its start, read back (router/backlog.py).
                f"$JS.API.CONSUMER.CREATE.{EVENTS_STREAM}.*.events.task.>",
            ],
            subscribe=[
                _own_inbox(user),
                *_MICRO,
                ROUTE,
                WORKERS,
                CANCEL,
                CANCELS_FROM,
                LAST_EVENT,
                OWN_CONSUMER,
                ALIAS_MAP,
                ROUTER_HOLDS,
                "events.task.>",
                "events.worker.*.duplicate",
                # Streamed answers, passed on to the client that asked (router/relay.py).
                CHUNKS,
            ],
            responses=STREAM_REPLIES,
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
                *_leader_lease(STATS_ROLE),
                # What a standby passes on to the instance that projects.
                f"{STATS_PROJECTING}.*",
                "$SRV.PING.coordinator-stats",
            ],
            subscribe=[_own_inbox(user), *_MICRO, TASK, STATS, "coordinator.stats.>"],
            responses=ONE_REPLY,
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
                # Its own kinds only: a worker's subjects are the workers' own.
                "events.task.*.routed",
                "events.task.*.failed",
                "events.worker.>",
                # A moved task's older attempts are told to stop.
                "coordinator.cancel.*",
                *_KV_WATCH,
                *_ALIASES,
                *_leader_lease(REAPER_ROLE),
                f"$SRV.PING.{REAPER_SERVICE}",  # its health check
            ],
            subscribe=[
                _own_inbox(user),
                *_MICRO,
                REAPER_STATUS,
                "events.task.>",
                "events.worker.>",
            ],
            responses=ONE_REPLY,
        )
    if role == "gateway":
        keys, registry = _kv(GATEWAY_KEYS_BUCKET), _kv(WORKERS_BUCKET)
        return Permissions(
            publish=[
                ROUTE,
                TASK,
                WORKERS,
                STATS,
                # Its cancels name it: it speaks for its keys (`schemas.subjects.cancel_from`).
                cancel_from(user),
                # The dashboard's reads: exclusions, bench baselines, what the reaper does.
                STATS_EXCLUSIONS,
                STATS_BASELINES,
                REAPER_STATUS,
                # It watches the API keys (their hashes); only the operator writes them.
                f"$JS.API.STREAM.INFO.{keys}",
                f"$JS.API.CONSUMER.CREATE.{keys}",
                f"$JS.API.CONSUMER.CREATE.{keys}.>",
                f"$JS.API.CONSUMER.INFO.{keys}.*",
                # The dashboard and the metrics: the registry (watched), the event log (read
                # through named ordered consumers, whose create request names the filter; it
                # publishes no event), its size, and the stats projection's lag.
                f"$JS.API.STREAM.INFO.{registry}",
                f"$JS.API.CONSUMER.CREATE.{registry}",
                f"$JS.API.CONSUMER.CREATE.{registry}.>",
                f"$JS.API.CONSUMER.INFO.{registry}.*",
                f"$JS.API.STREAM.INFO.{EVENTS_STREAM}",
                f"$JS.API.CONSUMER.CREATE.{EVENTS_STREAM}.*.events.>",
                f"$JS.API.CONSUMER.INFO.{EVENTS_STREAM}.{STATS_CONSUMER}",
                "$JS.FC.>",
            ],
            # The stats service's durable consumer on the event log must not be re-filtered.
            publish_deny=[f"$JS.API.CONSUMER.CREATE.{EVENTS_STREAM}.{STATS_CONSUMER}.>"],
            subscribe=[_own_inbox(user), *_MICRO],
            responses=ONE_REPLY,  # its health PING
        )
    if role == "client":
        # People's commands: ask, look a task up, cancel, read the fleet and the figures.
        # Changing fleet-wide state (aliases, exclusions, rebuilds) is the operator's.
        return Permissions(
            # A cancel on the subject naming this identity only: a reply subject can name
            # anyone's inbox, a subject the server checks cannot.
            publish=[ROUTE, TASK, WORKERS, cancel_from(user), *_STATS_READS],
            subscribe=[_own_inbox(user)],
        )
    if role == "operator":
        # Setup (streams, buckets, the pools' consumers), the doctor, health checks, aliases,
        # exclusions and rebuilds: everything a person running the fleet does, on the API.
        # Its inbox is its own like everyone's; it cannot publish events or tasks.
        return Permissions(
            publish=[
                "$JS.API.>",
                "$SRV.>",
                "$JS.FC.>",
                "coordinator.>",
                f"$KV.{GATEWAY_KEYS_BUCKET}.>",  # `coordinator keys add` / `revoke`
            ],
            subscribe=[_own_inbox(user)],
        )
    if role == "jobs":
        # judge and bench: requests, their own events, and reading events by subject.
        return Permissions(
            publish=[
                ROUTE,
                WORKERS,
                STATS,
                STATS_BASELINES,
                *_stream_info(EVENTS_STREAM),
                # By subject, and never a prompt: a bench run's answers, the judge's scores.
                f"$JS.API.DIRECT.GET.{EVENTS_STREAM}.events.task.*.*.completed",
                f"$JS.API.DIRECT.GET.{EVENTS_STREAM}.events.quality.>",
                "events.quality.>",
                "events.bench.>",
            ],
            subscribe=[_own_inbox(user)],
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
    responses = (
        f'        allow_responses: {{ max: {perms.responses}, expires: "{RESPONSES_EXPIRE}" }}\n'
        if perms.responses
        else ""
    )
    return (
        f"    {{ user: {user}, password: ${password_variable(user)}, permissions: {{\n"
        f"        publish: {{\n{publish}        }}\n"
        f"        subscribe: {{\n          allow: {_conf_list(perms.subscribe)}\n        }}\n"
        f"{responses}"
        f"    }} }}\n"
    )


NATS_ROLES: Final = ("router", "stats", "reaper", "gateway", "client", "jobs", "operator")


def render_nats_users(workers: Iterable[str], web_workers: Iterable[str]) -> str:
    """The configuration's ``users`` list: admin, one user per role and one per worker (the
    same for a single server and for every node of a cluster)."""
    users = [f"    {{ user: admin, password: ${password_variable('admin')} }}\n"]
    users += [render_nats_user(role) for role in NATS_ROLES]
    users += [render_nats_user("worker", w) for w in workers]
    users += [render_nats_user("web-search", w) for w in web_workers]
    return "".join(users)


def render_nats_conf(workers: Iterable[str], web_workers: Iterable[str]) -> str:
    """The whole server configuration: JetStream, and one user per role and worker."""
    return render_server_conf(users_block(render_nats_users(workers, web_workers)))


def users_block(users: str) -> str:
    """The ``authorization`` block of the users `render_nats_users` rendered."""
    return f"authorization {{\n  users = [\n{users}  ]\n}}\n"


# Where the rendered configurations keep the server's data (the container's volume;
# ``deploy render nats --store-dir`` puts it elsewhere).
NATS_STORE_DIR: Final = "/var/lib/nats"


def render_server_conf(auth: str) -> str:
    """The single server's configuration, with ``auth`` saying who is who."""
    return (DEPLOY_DIR / "nats" / "nats-server.conf.in").read_text().replace("@AUTH@\n", auth)


# Who the committed deploy/nats/nats-server.conf is rendered for (docker-compose.yml's fleet).
EXAMPLE_WORKERS: Final = ("cpu1",)
EXAMPLE_WEB_WORKERS: Final = ("search1",)
