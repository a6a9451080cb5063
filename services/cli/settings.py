"""The settings of the commands that run no service: ``setup``, ``doctor`` and ``up``.

Every service's settings share `services.runtime.settings.Settings` (NATS, logging, reading
the environment); each one's own fields live beside it.
"""

from __future__ import annotations

import os

import msgspec

from services.errors import ConfigError
from services.runtime.settings import DEFAULT_WORKER_TTL_S, NatsAuth, Settings


class SetupSettings(Settings, frozen=True, kw_only=True):
    """``coordinator setup``: the streams' and buckets' settings (with the admin NATS user)."""

    worker_ttl_s: float = DEFAULT_WORKER_TTL_S
    """The registry bucket's TTL: keep it equal to the workers' and the router's."""
    events_max_age_s: float = 0.0
    """How long events are kept; 0 keeps every event (the statistics can be rebuilt from all)."""
    nats_replicas: int | None = None
    """How many servers of a JetStream cluster keep each stream and bucket (``--replicas``
    says the same). Unset: new ones get 1, existing ones keep theirs."""

    def check(self) -> None:
        if self.worker_ttl_s <= 0 or self.events_max_age_s < 0:
            raise ConfigError("WORKER_TTL_S must be positive and EVENTS_MAX_AGE_S not negative")
        if self.nats_replicas is not None:
            check_replicas(self.nats_replicas, "NATS_REPLICAS")


class DoctorSettings(Settings, frozen=True, kw_only=True):
    """``coordinator doctor``: on a JetStream cluster, the system account's user, which alone
    may read the cluster's meta group (its peers and leader)."""

    nats_system_user: str | None = None
    nats_system_password: str | None = None
    nats_system_creds: str | None = None
    """With identities: a system account user's ``.creds`` (the fleet's keys hold one,
    ``admin.creds``)."""

    def check(self) -> None:
        if (self.nats_system_user is None) != (self.nats_system_password is None):
            raise ConfigError(
                "NATS_SYSTEM_USER and NATS_SYSTEM_PASSWORD go together: set both or neither"
            )
        if self.nats_system_user is not None and self.nats_system_creds is not None:
            raise ConfigError("set NATS_SYSTEM_USER/NATS_SYSTEM_PASSWORD or NATS_SYSTEM_CREDS")
        if self.nats_system_creds is not None and not os.path.isfile(self.nats_system_creds):
            raise ConfigError(f"NATS_SYSTEM_CREDS={self.nats_system_creds!r}: no such file")

    def system_auth(self) -> NatsAuth | None:
        """The system user's credentials (with this process's TLS settings), or None."""
        if self.nats_system_user is None and self.nats_system_creds is None:
            return None
        return msgspec.structs.replace(
            self.nats_auth(),
            user=self.nats_system_user,
            password=self.nats_system_password,
            token=None,
            creds=self.nats_system_creds,
            inbox_prefix=None,
        )


class UpSettings(Settings, frozen=True, kw_only=True):
    """``coordinator up``: NATS_URL and PG_DSN unset mean 'start them embedded'."""

    pg_dsn: str | None = None
    ollama_host: str = "http://localhost:11434"
    coordinator_home: str = msgspec.field(
        default_factory=lambda: os.path.join(os.path.expanduser("~"), ".coordinator")
    )


def check_replicas(replicas: int, name: str) -> None:
    """A stream's replica count is 1 to `MAX_REPLICAS` (JetStream's limit)."""
    if not 1 <= replicas <= MAX_REPLICAS:
        raise ConfigError(f"{name} must be 1 to {MAX_REPLICAS} (JetStream's limit), not {replicas}")


# JetStream keeps at most this many copies of a stream.
MAX_REPLICAS = 5
