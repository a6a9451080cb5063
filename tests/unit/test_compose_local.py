"""The compose files beside docker-compose.yml against it: deploy/compose-local.yml (the stack
with no image registry, scripts/compose-check) and deploy/compose-cluster.yml (the cluster
profile's stop order). scripts/compose-check runs them under a real engine; these hold them to
docker-compose.yml when a service is added or moved."""

from __future__ import annotations

import re
from importlib.util import find_spec
from typing import Any
from urllib.parse import urlsplit

import yaml

from services.cli.cluster import EXAMPLE_NODES
from services.cli.roles import DEPLOY_DIR

ROOT = DEPLOY_DIR.parent
OUR_IMAGE = "coordinator:latest"
NATS_CONF = "/etc/nats/nats-server.conf"


def load(path: str) -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((ROOT / path).read_text())
    return loaded


def test_every_image_compose_would_pull_is_replaced_by_one_made_here() -> None:
    services = load("docker-compose.yml")["services"]
    local = load("deploy/compose-local.yml")["services"]
    pulled = {name for name, s in services.items() if s.get("image") != OUR_IMAGE}
    assert pulled == set(local)
    for name, service in local.items():
        image = service["image"]
        assert image == OUR_IMAGE or image.startswith("coordinator-local/"), name
        if image != OUR_IMAGE:
            context = ROOT / service["build"]["context"]
            assert (context / "Dockerfile").is_file(), name


def test_the_stand_ins_listen_where_the_services_look() -> None:
    services = load("docker-compose.yml")["services"]
    local = load("deploy/compose-local.yml")["services"]
    for name, url in (
        ("ollama", services["worker"]["environment"]["OLLAMA_HOST"]),
        ("ollama", services["web_search"]["environment"]["OLLAMA_HOST"]),
        ("searxng", services["web_search"]["environment"]["SEARXNG_URL"]),
    ):
        stand_in = local[name]
        assert stand_in["entrypoint"] == ["python"]
        command = stand_in["command"]
        assert command[:2] == ["-m", f"devtools.fakes.{name}"]
        assert find_spec(command[1]) is not None
        port = command[command.index("--port") + 1]
        assert command[command.index("--host") + 1] == "0.0.0.0"
        parts = urlsplit(url)
        assert (parts.hostname, str(parts.port)) == (name, port), name
        if "test" in stand_in["healthcheck"]:
            assert f"127.0.0.1:{port}/" in stand_in["healthcheck"]["test"][-1]
    # The NATS servers keep compose's command (the configuration) on the image's nats-server.
    assert local["nats"]["entrypoint"] == ["nats-server"]
    assert services["nats"]["command"] == ["-c", NATS_CONF]
    for node in EXAMPLE_NODES:
        assert local[node]["entrypoint"] == ["env"]
        assert services[node]["command"][-1].endswith("exec nats-server -c " + NATS_CONF)


def test_with_the_cluster_file_every_nats_client_waits_for_and_outlives_no_node() -> None:
    """What uses NATS depends on the three nodes: compose starts it after them and stops it
    before them."""
    services = load("docker-compose.yml")["services"]
    cluster = load("deploy/compose-cluster.yml")["services"]
    clients = {name for name, s in services.items() if "nats" in (s.get("depends_on") or {})}
    assert set(cluster) == clients
    for name, service in cluster.items():
        assert service["depends_on"] == {
            node: {"condition": "service_healthy"} for node in EXAMPLE_NODES
        }, name
    for node in EXAMPLE_NODES:
        assert "cluster" in services[node]["profiles"]


def test_the_check_waits_for_and_stops_every_long_running_service() -> None:
    script = (ROOT / "scripts" / "compose-check").read_text()

    def listed(name: str) -> set[str]:
        found = re.search(rf"^{name}=\(([^)]*)\)$", script, re.MULTILINE)
        assert found, name
        return set(found.group(1).split())

    services = load("docker-compose.yml")["services"]
    long_running = {
        name
        for name, s in services.items()
        if s.get("restart") == "unless-stopped" and not s.get("profiles")
    }
    ours = {name for name in long_running if services[name].get("image") == OUR_IMAGE}
    assert listed("OURS") == ours
    assert listed("THIRD_PARTY") == long_running - ours
    assert listed("NODES") == set(EXAMPLE_NODES)
    for path in ("deploy/compose-local.yml", "deploy/compose-cluster.yml"):
        assert f"-f {path}" in script, path
