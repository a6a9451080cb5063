"""``coordinator setup | health | deploy render``: what running the fleet for real needs.

- ``setup`` (with the operator NATS user) creates the streams and buckets every service uses, so
  that services whose users may not create streams can start (deploy/nats/nats-server.conf).
- ``health ROLE`` answers a container's or a unit's health check: the role's service answers
  a NATS micro ``PING``, or the worker's registry entry is fresh.
- ``deploy render systemd|launchd|nats`` prints a unit, a launchd agent or the NATS server
  configuration (one user per role, with only the subjects that role needs), for a single
  server or for one node of a JetStream cluster (``--cluster``).

This module is the commands; what they print or check is in `roles`, `permissions` (the NATS
users), `cluster` (a cluster node's configuration), `units` (systemd and launchd), `health`
(setup and health checks) and `replication` (the streams' replicas on a cluster).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

from schemas.subjects import EVENTS_STREAM, TASKS_STREAM
from services.cli.cluster import render_cluster_conf
from services.cli.health import check_health, setup_streams
from services.cli.identities import Store, default_store
from services.cli.permissions import NATS_STORE_DIR, render_nats_conf, render_server_conf
from services.cli.roles import PER_WORKER, SERVICE_ROLES
from services.cli.settings import MAX_REPLICAS, SetupSettings, check_replicas
from services.cli.units import read_env_file, render_launchd, render_systemd
from services.errors import ConfigError

EXIT_FAILED = 1


def register(sub: Any) -> None:
    """Add ``setup``, ``health`` and ``deploy`` to the ``coordinator`` parser."""
    setup = sub.add_parser(
        "setup",
        help="create or update the streams and buckets (with the operator NATS user)",
        description="Reads NATS_URL and the NATS_* credentials, WORKER_TTL_S, "
        "EVENTS_MAX_AGE_S (0: keep every event) and NATS_REPLICAS.",
    )
    setup.add_argument(
        "--replicas",
        type=int,
        metavar="N",
        help=f"how many servers of a JetStream cluster keep each stream and bucket (1-"
        f"{MAX_REPLICAS}; existing ones are changed in place, nothing is lost); default "
        "NATS_REPLICAS, else new ones get 1 and existing ones keep theirs",
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

    nats = kinds.add_parser(
        "nats",
        help="nats-server.conf: JetStream and one user per role",
        description="The single server's configuration, or with --cluster, --routes and "
        "--node the configuration of one node of a JetStream cluster (run it once per node).",
    )
    nats.add_argument("--worker", action="append", default=[], help="a worker id (repeat)")
    nats.add_argument("--web-worker", action="append", default=[], help="a web-search worker id")
    nats.add_argument("--cluster", metavar="NAME", help="the JetStream cluster's name")
    nats.add_argument(
        "--routes",
        metavar="HOST[:PORT],…",
        help="every node of the cluster, this one included (cluster port 6222 by default)",
    )
    nats.add_argument("--node", metavar="HOST", help="the node whose configuration to print")
    nats.add_argument(
        "--store-dir",
        type=Path,
        default=None,
        help="where the server keeps its data (default /var/lib/nats, the container's)",
    )
    nats.add_argument(
        "--jwt",
        action="store_true",
        help="one identity per person and machine (decentralised JWTs; `coordinator invite`) "
        "instead of one password user per role, on a single server or each node of a "
        "cluster; makes the fleet's keys on first use",
    )
    nats.add_argument(
        "--identities",
        type=Path,
        default=None,
        help="with --jwt: where the fleet's keys are kept (default $COORDINATOR_IDENTITIES "
        "or ~/.config/coordinator/identities)",
    )
    nats.set_defaults(func=cmd_render_nats)


def cmd_setup(args: argparse.Namespace) -> int:
    settings = SetupSettings.from_env()
    replicas = settings.nats_replicas
    if args.replicas is not None:
        check_replicas(args.replicas, "--replicas")
        replicas = args.replicas
    copies = asyncio.run(
        setup_streams(
            settings.nats_url,
            worker_ttl_s=settings.worker_ttl_s,
            events_max_age_s=settings.events_max_age_s,
            auth=settings.nats_auth(),
            replicas=replicas,
        )
    )
    for stream in copies:
        print(stream.line())
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
    conf = _nats_conf(args)
    if args.store_dir is not None:
        conf = conf.replace(NATS_STORE_DIR, str(args.store_dir.expanduser().absolute()))
    print(conf, end="")
    return 0


def _nats_conf(args: argparse.Namespace) -> str:
    cluster_options = {"--cluster": args.cluster, "--routes": args.routes, "--node": args.node}
    given = [name for name, value in cluster_options.items() if value is not None]
    auth = None
    if args.jwt:
        if args.worker or args.web_worker:
            raise ConfigError(
                "--jwt names no worker: each gets an identity (`coordinator invite`), which "
                "changes nothing in the configuration"
            )
        store = Store(args.identities or default_store())
        if not store.exists():
            store.create()
            print(f"made the fleet's keys in {store.path} (keep it private)", file=sys.stderr)
        auth = store.auth()
        if not given:
            return render_server_conf(auth)
    if not given:
        return render_nats_conf(args.worker, args.web_worker)
    if len(given) < len(cluster_options):
        missing = [name for name in cluster_options if name not in given]
        raise ConfigError(
            f"a cluster node's configuration needs --cluster, --routes and --node; "
            f"{', '.join(missing)} missing"
        )
    return render_cluster_conf(
        args.cluster, args.routes, args.node, args.worker, args.web_worker, auth=auth
    )


def _check_env_file(path: Path) -> dict[str, str]:
    if not path.is_file():
        raise ConfigError(f"--env-file {path}: no such file")
    return read_env_file(path)
