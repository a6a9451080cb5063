"""The stats service's settings (``coordinator stats``), read from the environment.

Every service's settings share `services.runtime.settings.Settings` (NATS, logging, reading
the environment); each one's own fields live beside it.
"""

from __future__ import annotations

from services.runtime.settings import (
    DEFAULT_HEARTBEAT_INTERVAL_S,
    DEFAULT_WORKER_TTL_S,
    Settings,
    check_lease_timing,
)


class StatsSettings(Settings, frozen=True, kw_only=True):
    pg_dsn: str
    batch_size: int = 256
    heartbeat_interval_s: float = DEFAULT_HEARTBEAT_INTERVAL_S
    worker_ttl_s: float = DEFAULT_WORKER_TTL_S
    """The projection's lease in the ``leaders`` bucket: renewed every heartbeat interval,
    taken over by a standby once older than the TTL (`services.runtime.leadership`)."""

    def check(self) -> None:
        check_lease_timing(self.heartbeat_interval_s, self.worker_ttl_s)
