"""Fixtures for integration tests: the Ollama stand-in, a client, the service runner."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Iterator

import nats
import pytest
from nats.aio.client import Client

from devtools.fakes.ollama import FakeOllama
from devtools.servers import NatsServer
from tests.harness import Processes, ServiceRunner


@pytest.fixture
def ollama() -> Iterator[FakeOllama]:
    with FakeOllama() as fake:
        yield fake


@pytest.fixture
async def nc(nats_server: NatsServer) -> AsyncIterator[Client]:
    client = await nats.connect(nats_server.url)
    yield client
    await client.close()


@pytest.fixture
async def runner() -> AsyncIterator[ServiceRunner]:
    services = ServiceRunner()
    yield services
    await services.stop_all()


@pytest.fixture
def processes() -> Iterator[Processes]:
    """Subprocesses started by a test, stopped (SIGTERM, then SIGKILL) at its end."""
    procs = Processes()
    yield procs
    procs.stop_all()


@pytest.fixture
def wol_listener() -> Iterator[socket.socket]:
    """A loopback UDP port standing in for a sleeping machine's network card."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.settimeout(10)
        yield sock
