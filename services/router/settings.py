"""The router's settings (``coordinator router``), read from the environment.

Every service's settings share `services.runtime.settings.Settings` (NATS, logging, reading
the environment); each one's own fields live beside it.
"""

from __future__ import annotations

import msgspec

from services.fleet.policy import DEFAULT_GPU_PREFERENCE
from services.runtime.settings import DEFAULT_WORKER_TTL_S, Settings, check_gpu_preference


class RouterSettings(Settings, frozen=True, kw_only=True):
    max_prompt_chars: int = 200_000
    default_timeout_s: float = 300.0
    worker_ttl_s: float = DEFAULT_WORKER_TTL_S
    gpu_models: list[str] = msgspec.field(default_factory=list)
    gpu_preference: float = DEFAULT_GPU_PREFERENCE
    """A GPU-preferred model goes to a CPU worker when the best GPU worker would finish it
    more than this many times later (`services.fleet.policy.choose`)."""
    wol_broadcast: str = "255.255.255.255"
    """Where Wake-on-LAN magic packets go (the sleeping machines' broadcast address)."""
    wol_port: int = 9
    wake_wait_s: float = 180.0
    """How long a task waits for a woken worker to start it before it fails."""

    def check(self) -> None:
        check_gpu_preference(self.gpu_preference)
