"""The deployment files against the code: docker-compose.yml, the Dockerfile, the NATS server
configuration and the service units. No Docker engine runs here, so these hold the files to
what the code knows: commands that exist, variables the settings read, one install path."""

from __future__ import annotations

import argparse
import re
import shlex
import tomllib
from pathlib import Path
from typing import Any

import msgspec
import pytest
import yaml

from schemas.subjects import ALIAS_MAP, LAST_EVENT, OWN_CONSUMER
from services.cli.cluster import (
    EXAMPLE_CLUSTER,
    EXAMPLE_NODES,
    parse_routes,
    render_cluster_conf,
    routes_value,
)
from services.cli.main import build_parser
from services.cli.permissions import (
    EXAMPLE_WEB_WORKERS,
    EXAMPLE_WORKERS,
    render_nats_conf,
    role_permissions,
)
from services.cli.roles import DEPLOY_DIR, SERVICE_ROLES
from services.cli.units import launchd_agent, read_env_file, render_launchd, render_systemd
from services.errors import ConfigError
from services.runtime import settings as settings_module

ROOT = DEPLOY_DIR.parent
COMPOSE = ROOT / "docker-compose.yml"
OUR_IMAGE = "coordinator:latest"


def compose() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())
    return loaded


def ours(services: dict[str, Any]) -> dict[str, Any]:
    """The services that run the project's image (the others are nats, postgres…)."""
    return {name: s for name, s in services.items() if s.get("image") == OUR_IMAGE}


def known_variables() -> set[str]:
    """Every variable a settings Struct reads: its fields, upper-cased."""
    found: set[str] = set()
    pending: list[type[Any]] = [settings_module.Settings]
    while pending:
        cls = pending.pop()
        pending.extend(cls.__subclasses__())
        found |= {f.name.upper() for f in msgspec.structs.fields(cls)}
    return found


def parses(argv: list[str]) -> argparse.Namespace:
    try:
        return build_parser().parse_args(argv)
    except SystemExit as exc:
        if exc.code == 0:  # --help
            return argparse.Namespace()
        raise AssertionError(f"`coordinator {shlex.join(argv)}` is not a command") from None


def test_every_service_runs_a_command_that_exists_with_variables_the_settings_read() -> None:
    services = ours(compose()["services"])
    assert {"setup", "router", "stats", "reaper", "gateway", "web_search", "worker"} <= set(
        services
    )
    known = known_variables()
    for name, service in services.items():
        parses(service["command"])
        for variable in service["environment"]:
            standard = variable.startswith("OTEL_")
            assert variable in known or standard, f"{name}: {variable} is read by no settings"


def test_the_ports_published_on_the_host_can_be_moved_from_env() -> None:
    """A host that runs a NATS of its own (4222) can still run the stack: the host's ports are
    variables with the usual defaults, both named in the example environment."""
    services = compose()["services"]
    assert services["nats"]["ports"] == ["${NATS_HOST_PORT:-4222}:4222"]
    assert services["gateway"]["ports"] == ["127.0.0.1:${GATEWAY_HOST_PORT:-11400}:11400"]
    example = (DEPLOY_DIR / "example.env").read_text()
    assert "# NATS_HOST_PORT=4222" in example and "# GATEWAY_HOST_PORT=11400" in example


def test_every_service_has_a_restart_policy_and_long_running_ones_a_health_check() -> None:
    services = compose()["services"]
    needed_done = {
        dep
        for s in services.values()
        for dep, cond in (s.get("depends_on") or {}).items()
        if cond.get("condition") == "service_completed_successfully"
    }
    for name, service in services.items():
        restart = service.get("restart")
        assert restart in ("unless-stopped", "always", "on-failure", "no"), name
        for dep in service.get("depends_on") or {}:
            assert dep in services, f"{name} depends on unknown {dep}"
        if restart in ("on-failure", "no"):
            # A job: run once before others (setup) or by hand (a profile).
            assert name in needed_done or service.get("profiles"), name
            continue
        test = service["healthcheck"]["test"]
        assert test[0] == "CMD" and len(test) > 1, name
        if name in ours(services):
            assert test[1] == "coordinator", name
            parses(test[2:])
            assert test[2:4] == ["health", service["command"][0]], name


def test_compose_users_and_passwords_are_those_of_the_nats_configuration() -> None:
    services = compose()["services"]
    conf = (DEPLOY_DIR / "nats" / "nats-server.conf").read_text()
    users = dict(re.findall(r"\{ user: (\S+), password: \$(\w+)", conf))
    assert set(services["nats"]["environment"]) == set(users.values())
    example = read_env_file(DEPLOY_DIR / "example.env")
    assert set(users.values()) <= set(example)
    for name, service in ours(services).items():
        env = service["environment"]
        assert env["NATS_USER"] in users, name
        assert env["NATS_PASSWORD"] == f"${{{users[env['NATS_USER']]}}}", name
    # The conf's example workers are compose's.
    assert services["worker"]["environment"]["WORKER_ID"] in EXAMPLE_WORKERS
    assert services["web_search"]["environment"]["WORKER_ID"] in EXAMPLE_WEB_WORKERS


def test_the_cluster_profile_runs_three_nodes_with_the_rendered_configurations() -> None:
    services = compose()["services"]
    nodes = {name: s for name, s in services.items() if "cluster" in (s.get("profiles") or [])}
    assert set(nodes) == set(EXAMPLE_NODES)
    single = set(services["nats"]["environment"])
    example = read_env_file(DEPLOY_DIR / "example.env")
    for name, node in nodes.items():
        env = node["environment"]
        # The single server's users, the routes' password and URLs, the system user.
        assert set(env) == single | {"CLUSTER_PASSWORD", "SYSTEM_PASSWORD", "CLUSTER_ROUTES"}
        assert env["CLUSTER_ROUTES"] == routes_value(
            parse_routes(",".join(EXAMPLE_NODES)), "${CLUSTER_PASSWORD:-}"
        )
        mounts = {v.split(":")[1]: v.split(":")[0] for v in node["volumes"]}
        conf = mounts["/etc/nats/nats-server.conf"]
        assert conf == f"./deploy/nats/cluster/{name}.conf", name
        assert mounts["/var/lib/nats"] == f"{name}-data", name
        assert node["command"][-1].endswith("exec nats-server -c /etc/nats/nats-server.conf")
    assert {"CLUSTER_PASSWORD", "SYSTEM_PASSWORD"} <= set(example)
    # Every service can be pointed at the cluster, and setup given its replicas.
    assert compose()["x-common-env"]["NATS_URL"] == "${NATS_URL:-nats://nats:4222}"
    assert services["setup"]["environment"]["NATS_REPLICAS"] == "${NATS_REPLICAS:-}"


def test_the_committed_cluster_configurations_are_the_renderings_of_the_permissions() -> None:
    routes = ",".join(EXAMPLE_NODES)
    for node in EXAMPLE_NODES:
        committed = (DEPLOY_DIR / "nats" / "cluster" / f"{node}.conf").read_text()
        rendered = render_cluster_conf(
            EXAMPLE_CLUSTER, routes, node, EXAMPLE_WORKERS, EXAMPLE_WEB_WORKERS
        )
        assert committed == rendered, (
            f"re-render: coordinator deploy render nats --cluster {EXAMPLE_CLUSTER} --routes "
            f"{routes} --node {node} --worker cpu1 --web-worker search1 "
            f"> deploy/nats/cluster/{node}.conf"
        )
        # The same users as the single server's configuration.
        single = (DEPLOY_DIR / "nats" / "nats-server.conf").read_text()
        assert committed.endswith(single[single.index("authorization {") :])


def test_the_image_is_installed_by_the_same_script_as_ci() -> None:
    dockerfile = (DEPLOY_DIR / "Dockerfile").read_text()
    runs = [
        line.removeprefix("RUN ").strip()
        for line in dockerfile.splitlines()
        if line.startswith("RUN ")
    ]
    # What the services run, without the development tools.
    assert "./scripts/bootstrap --runtime" in runs
    assert not [r for r in runs if "pip" in r], "install steps belong in scripts/bootstrap"
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^\./scripts/bootstrap\b", ci, re.MULTILINE)
    copied = {line.split()[1] for line in dockerfile.splitlines() if line.startswith("COPY ")}
    # What `pip install -e .` builds from (every package it finds: the stand-ins too, for a
    # demo), and the script itself.
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = {name.rstrip("*") for name in packages["packages"]["find"]["include"]}
    assert found <= copied
    assert {"scripts", "pyproject.toml"} <= copied
    # The dependencies are a layer of their own, made before any code is copied: a change of
    # code alone does not install them again.
    lines = [line for line in dockerfile.splitlines() if line.startswith(("COPY ", "RUN "))]
    deps = lines.index("RUN ./scripts/bootstrap --runtime-deps")
    assert {line.split()[1] for line in lines[:deps] if line.startswith("COPY ")} == {
        "pyproject.toml",
        "scripts/bootstrap",
    }
    assert compose()["x-coordinator"]["build"]["dockerfile"] == "deploy/Dockerfile"
    # What the tests install inside the copied folders stays out of the image (the coding
    # agents alone are hundreds of MB).
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".venv", "devtools/agents/node_modules"} <= set(ignored)


def test_the_committed_nats_configuration_is_the_rendering_of_the_permissions() -> None:
    committed = (DEPLOY_DIR / "nats" / "nats-server.conf").read_text()
    assert committed == render_nats_conf(EXAMPLE_WORKERS, EXAMPLE_WEB_WORKERS), (
        "re-render: coordinator deploy render nats --worker cpu1 --web-worker search1 "
        "> deploy/nats/nats-server.conf"
    )


def test_a_worker_makes_no_consumer_reads_no_event_and_publishes_no_task() -> None:
    worker = role_permissions("worker", "cpu1")
    # Its own consumer's limits are the fleet's: the router makes it (OWN_CONSUMER).
    # Nor one on EVENTS: the alias map comes from the router too (ALIAS_MAP).
    assert not [s for s in worker.publish if ".CONSUMER.CREATE." in s]
    assert {OWN_CONSUMER, LAST_EVENT, ALIAS_MAP} <= set(worker.publish)
    # No direct get: a `*` in the task's place would read every task's last answer.
    assert not [s for s in worker.publish if s.startswith("$JS.API.DIRECT.GET.EVENTS")]
    assert not [s for s in worker.publish if s.startswith("tasks.")]
    assert not [s for s in worker.subscribe if s.startswith("events.")]
    with pytest.raises(ConfigError):
        role_permissions("worker")
    with pytest.raises(ConfigError):
        role_permissions("worker", "a.b")


def test_a_worker_unit_is_a_template_whose_instance_is_the_worker_id(tmp_path: Path) -> None:
    env = tmp_path / "worker.env"
    env.write_text("NATS_URL=nats://bus:4222\n")
    unit = render_systemd("worker", env, coordinator="/opt/c/.venv/bin/coordinator", user="coord")
    assert f"EnvironmentFile={env}" in unit
    assert "ExecStart=/usr/bin/env WORKER_ID=%i /opt/c/.venv/bin/coordinator worker" in unit
    assert "Restart=always" in unit
    router = render_systemd("router", env, coordinator="/c", user="coord")
    assert "ExecStart=/c router" in router
    assert "%i" not in router
    stats = render_systemd("stats", env, coordinator="/c", user="coord")
    assert "ExecStart=/c stats serve" in stats
    assert set(SERVICE_ROLES) == {"router", "stats", "reaper", "gateway", "web-search", "worker"}


def test_a_launchd_agent_reads_the_env_file_and_pins_the_worker_id(tmp_path: Path) -> None:
    env = tmp_path / "mac.env"
    env.write_text('WORKER_ID=mac1\nPG_DSN="host=db dbname=c"\n')
    plist = render_launchd(
        "worker",
        env,
        coordinator="/Users/me/c/.venv/bin/coordinator",
        worker_id="mac1",
        log_dir=Path("/Users/me/Library/Logs"),
    )
    assert "<string>org.coordinator.worker.mac1</string>" in plist
    assert f"<string>{env}</string>" in plist
    assert 'WORKER_ID="$2"; exec "$1" worker' in plist
    assert "<key>KeepAlive</key><true/>" in plist
    assert read_env_file(env) == {"WORKER_ID": "mac1", "PG_DSN": "host=db dbname=c"}


def test_a_launchd_agent_is_installed_in_its_persons_own_domain() -> None:
    agent = launchd_agent("worker", "mac1", uid=501, home=Path("/Users/me"))
    assert agent.label == "org.coordinator.worker.mac1"
    assert agent.path == Path("/Users/me/Library/LaunchAgents/org.coordinator.worker.mac1.plist")
    assert agent.log_dir == Path("/Users/me/Library/Logs")
    assert agent.bootstrap == ("bootstrap", "gui/501", str(agent.path))
    assert agent.bootout == ("bootout", "gui/501/org.coordinator.worker.mac1")
    router = launchd_agent("router", None, uid=501, home=Path("/Users/me"))
    assert router.bootout == ("bootout", "gui/501/org.coordinator.router")


def test_deploy_render_commands_parse() -> None:
    args = parses(["deploy", "render", "systemd", "--role", "worker", "--env-file", "/x.env"])
    assert args.role == "worker"
    args = parses(["deploy", "render", "nats", "--worker", "a", "--worker", "b"])
    assert args.worker == ["a", "b"]
    parses(["doctor", "--unit-dir", "/tmp"])
    parses(["health", "reaper"])
    parses(["setup"])
    assert parses(["setup", "--replicas", "3"]).replicas == 3
    args = parses(
        ["deploy", "render", "nats", "--cluster", "c", "--routes", "a,b,c", "--node", "b"]
    )
    assert (args.cluster, args.routes, args.node) == ("c", "a,b,c", "b")


def test_help_the_docs_and_compose_agree_that_the_operator_user_runs_setup() -> None:
    """The operator role may create streams and buckets (services/cli/permissions.py); the
    command's help, the commands' page (docs/interfaces.md) and the compose stack all say (and
    do) so."""
    help_text = " ".join(build_parser().format_help().split())
    assert "setup create or update the streams and buckets (with the operator NATS user)" in (
        help_text
    )
    commands = (ROOT / "docs" / "interfaces.md").read_text()
    assert "create or update the streams and buckets (with the operator NATS user)" in commands
    assert compose()["services"]["setup"]["environment"]["NATS_USER"] == "operator"


def test_compose_gives_every_service_its_whole_stop_budget() -> None:
    """Docker kills a container that has not stopped within ``stop_grace_period`` (10 s by
    default): each of ours is given at least its stop budget at the default settings."""
    from services.cli.stopping import budget_of
    from services.gateway.settings import GatewaySettings
    from services.reaper.settings import ReaperSettings
    from services.router.settings import RouterSettings
    from services.runtime.settings import Settings, WebSearchSettings, WorkerSettings
    from services.stats.settings import StatsSettings

    defaults: dict[str, Settings] = {
        "router": RouterSettings.from_env({}),
        "stats": StatsSettings.from_env({"PG_DSN": "postgresql://compose"}),
        "reaper": ReaperSettings.from_env({}),
        "gateway": GatewaySettings.from_env({}),
        "web_search": WebSearchSettings.from_env({}),
        "worker": WorkerSettings.from_env({}),
    }
    services = compose()["services"]
    for name, settings in defaults.items():
        granted = services[name].get("stop_grace_period", "10s")
        assert granted.endswith("s"), name
        assert float(granted[:-1]) >= budget_of(settings), name
