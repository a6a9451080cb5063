"""Fixtures: real nats-server and PostgreSQL for integration tests."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest

from devtools.servers import NatsServer, Postgres, running_nats
from services.runtime import waitfor


def pytest_configure(config: pytest.Config) -> None:
    """The services run here in-process as the ``coordinator`` command runs them: with an
    ``asyncio.wait_for`` that never loses a cancellation (`services.runtime.waitfor`)."""
    waitfor.install()


@pytest.fixture
def nats_server() -> Iterator[NatsServer]:
    """A fresh nats-server with JetStream for one test."""
    with running_nats() as server:
        yield server


@pytest.fixture(scope="session")
async def postgres() -> AsyncIterator[Postgres]:
    pg = await Postgres().start()
    yield pg
    pg.stop()


@pytest.fixture
async def pg_dsn(postgres: Postgres) -> AsyncIterator[str]:
    """A fresh, empty database for one test."""
    dsn = await postgres.create_database()
    yield dsn
    await postgres.drop_database(dsn)
