"""Fixtures: real nats-server and PostgreSQL for integration tests."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest

from devtools.servers import NatsServer, Postgres, running_nats


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
