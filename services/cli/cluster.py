"""The configuration of one node of a JetStream cluster: ``coordinator deploy render nats
--cluster NAME --routes HOST,HOST,HOST --node HOST``.

Every node gets the users and permissions of the single server's configuration
(`permissions.render_nats_users`), a ``server_name`` of its own (JetStream's clustering needs
one), the cluster block with the routes to every node, and ``sync_interval: always``. The
routes' URLs carry the cluster's password, which nats-server reads from no string, so they
come whole from ``CLUSTER_ROUTES`` in its environment (`routes_value` spells them). Pure,
but for reading the template.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Final

from services.cli.permissions import render_nats_users, users_block
from services.cli.roles import DEPLOY_DIR
from services.errors import ConfigError

CLUSTER_PORT: Final = 6222
CLIENT_PORT: Final = 4222
# Three servers keep a stream through the loss of one (a majority of three is two).
MIN_NODES: Final = 3
# The user a node proves itself with to the others (the routes' user).
ROUTE_USER: Final = "cluster"
PASSWORD_PLACEHOLDER: Final = "<CLUSTER_PASSWORD>"

_HOST = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?$")
_CLUSTER_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")

# Who the committed deploy/nats/cluster/ files are rendered for: docker-compose.yml's
# `cluster` profile, whose services are these hosts.
EXAMPLE_CLUSTER: Final = "coordinator"
EXAMPLE_NODES: Final = ("nats1", "nats2", "nats3")


@dataclass(frozen=True)
class Node:
    """One node of the cluster: where the others reach its routes."""

    host: str
    port: int = CLUSTER_PORT

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def server_name(self) -> str:
        """The host, and the port when it is not the usual one (two nodes on one host)."""
        return self.host if self.port == CLUSTER_PORT else f"{self.host}-{self.port}"


def parse_routes(text: str) -> list[Node]:
    """``host[:port],…`` (the cluster port, 6222 by default): every node, this one included."""
    nodes: list[Node] = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        host, _, port_text = item.partition(":")
        if not _HOST.match(host):
            raise ConfigError(
                f"--routes: {item!r} is not host[:port] (a host name or an IPv4 address)"
            )
        port = CLUSTER_PORT
        if port_text:
            if not port_text.isdigit() or not 0 < int(port_text) < 65536:
                raise ConfigError(f"--routes: {item!r} has no valid port (1-65535)")
            port = int(port_text)
        nodes.append(Node(host, port))
    if len(nodes) < MIN_NODES:
        raise ConfigError(
            f"--routes names {len(nodes)} node(s): a JetStream cluster needs at least "
            f"{MIN_NODES} (a majority of them must be up to write), e.g. --routes nas,nuc,pi"
        )
    seen: dict[str, Node] = {}
    for node in nodes:
        if node.server_name in seen:
            raise ConfigError(f"--routes names {node.address} twice")
        seen[node.server_name] = node
    return nodes


def pick_node(nodes: Sequence[Node], which: str) -> Node:
    """The node ``--node`` names: an entry of ``--routes`` as written, or its host alone."""
    wanted = which.strip()
    exact = [n for n in nodes if wanted in (n.address, n.server_name)]
    by_host = [n for n in nodes if n.host == wanted]
    found = exact or by_host
    if len(found) == 1:
        return found[0]
    known = ", ".join(n.address for n in nodes)
    if not found:
        raise ConfigError(f"--node {which!r} is not one of --routes ({known})")
    raise ConfigError(f"--node {which!r} is more than one node ({known}): give host:port")


def check_cluster_name(name: str) -> None:
    if not _CLUSTER_NAME.match(name):
        raise ConfigError(
            f"--cluster {name!r}: a cluster name is 1 to 64 letters, digits, '-' or '_'"
        )


def route_url(node: Node, password: str = PASSWORD_PLACEHOLDER) -> str:
    return f"nats-route://{ROUTE_USER}:{password}@{node.address}"


def routes_value(nodes: Iterable[Node], password: str = PASSWORD_PLACEHOLDER) -> str:
    """``CLUSTER_ROUTES``: every node's route URL, as a configuration list (nats-server
    parses a variable's value as it would the file's)."""
    return "[" + ", ".join(route_url(n, password) for n in nodes) + "]"


# Who is who on a cluster of password users: the system account's user (the doctor's view of
# the cluster), then the users of the single server's configuration.
_SYSTEM_USER: Final = """\
# The system account: `coordinator doctor` reads the cluster's peers and meta leader with its
# user (NATS_SYSTEM_USER=system, NATS_SYSTEM_PASSWORD). That user may also reload, and
# disconnect clients from, any server: keep its password with the operator.
accounts {
  SYS { users = [ { user: system, password: $SYSTEM_PASSWORD } ] }
}
system_account: SYS

"""


def render_cluster_conf(
    cluster: str,
    routes: str,
    node: str,
    workers: Iterable[str],
    web_workers: Iterable[str],
    *,
    auth: str | None = None,
) -> str:
    """One node's whole configuration; `ConfigError` names what is wrong with the input.
    ``auth``: who is who, when not the password users (`services.cli.nats_jwt.jwt_auth`:
    identities, on every node alike)."""
    check_cluster_name(cluster)
    nodes = parse_routes(routes)
    this = pick_node(nodes, node)
    template = (DEPLOY_DIR / "nats" / "nats-cluster.conf.in").read_text()
    comments = "".join(f"  #   {n.address} ({n.server_name})\n" for n in nodes)
    replacements = {
        "@SERVER_NAME@": this.server_name,
        "@CLUSTER@": cluster,
        "@CLUSTER_PORT@": str(this.port),
        "@ROUTE_COMMENTS@\n": comments,
        "@ROUTES_VALUE@": routes_value(nodes),
        "@AUTH@\n": auth or _SYSTEM_USER + users_block(render_nats_users(workers, web_workers)),
    }
    for marker, value in replacements.items():
        template = template.replace(marker, value)
    return template
