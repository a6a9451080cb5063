"""The reaper's settings (``coordinator reaper``), read from the environment.

Every service's settings share `services.runtime.settings.Settings` (NATS, logging, reading
the environment); each one's own fields live beside it.
"""

from __future__ import annotations

import msgspec

from services.errors import ConfigError
from services.fleet.policy import DEFAULT_GPU_PREFERENCE
from services.runtime.settings import (
    DEFAULT_HEARTBEAT_INTERVAL_S,
    DEFAULT_WORKER_TTL_S,
    Settings,
    check_gpu_preference,
    check_lease_timing,
)


class ReaperSettings(Settings, frozen=True, kw_only=True):
    """``coordinator reaper``: how often it looks, and how long each problem may last."""

    worker_ttl_s: float = DEFAULT_WORKER_TTL_S
    """A worker whose last heartbeat is older than this is dead (the workers' own setting);
    also the TTL of the reaper's own lease in the ``leaders`` bucket."""
    heartbeat_interval_s: float = DEFAULT_HEARTBEAT_INTERVAL_S
    """How often the active reaper renews its lease (`services.runtime.leadership`)."""
    reaper_interval_s: float = 1.0
    stuck_grace_s: float = 30.0
    """A task running this long past its own timeout is stuck."""
    ghost_after_s: float = 10.0
    """A task queued this long on a queue that nobody has worked on for as long is a ghost."""
    duplicate_samples: int = 2
    """Looks in a row that must see more than one pull waiting on a worker's consumer."""
    max_attempts: int = 5
    """A task is not moved again after this many attempts; it fails instead."""
    reaper_lookback_s: float = 86_400.0
    """How far back the event log is read at start to learn the tasks still under way."""
    gpu_models: list[str] = msgspec.field(default_factory=list)
    """As the router's ``GPU_MODELS``: a moved task goes where the router would send it."""
    gpu_preference: float = DEFAULT_GPU_PREFERENCE
    """As the router's ``GPU_PREFERENCE``."""

    def check(self) -> None:
        check_gpu_preference(self.gpu_preference)
        for name in ("worker_ttl_s", "reaper_interval_s", "ghost_after_s", "reaper_lookback_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name.upper()} must be a positive number of seconds")
        if self.stuck_grace_s < 0:
            raise ConfigError("STUCK_GRACE_S must not be negative")
        if self.duplicate_samples < 1:
            raise ConfigError("DUPLICATE_SAMPLES must be at least 1")
        if self.max_attempts < 1:
            raise ConfigError("MAX_ATTEMPTS must be at least 1")
        check_lease_timing(self.heartbeat_interval_s, self.worker_ttl_s)
