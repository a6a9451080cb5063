"""What the stats service says when it cannot use PostgreSQL: enough to act on, no password."""

from __future__ import annotations

import asyncpg

from services.stats.store import unreachable

DSN = "postgresql://coordinator:s3cret@postgres:5432/coordinator"


def test_a_refused_password_names_the_volume_that_keeps_the_old_one() -> None:
    refused = asyncpg.InvalidPasswordError('password authentication failed for user "coordinator"')
    why = unreachable(DSN, refused)
    assert "password authentication failed" in why
    assert "POSTGRES_PASSWORD" in why and "new volume" in why and "ALTER USER" in why
    assert "s3cret" not in why


def test_a_server_that_is_not_there_gets_no_password_hint() -> None:
    why = unreachable(DSN, ConnectionRefusedError(111, "Connection refused"))
    assert why.startswith("cannot reach PostgreSQL at postgresql://coordinator:")
    assert "Connection refused" in why
    assert "POSTGRES_PASSWORD" not in why and "s3cret" not in why
