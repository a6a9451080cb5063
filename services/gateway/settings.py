"""The gateway's settings (``coordinator gateway``), read from the environment.

Every service's settings share `services.runtime.settings.Settings` (NATS, logging, reading
the environment); each one's own fields live beside it.
"""

from __future__ import annotations

from services.errors import ConfigError
from services.runtime.settings import DEFAULT_WORKER_TTL_S, Settings


class GatewaySettings(Settings, frozen=True, kw_only=True):
    """``coordinator gateway``: the fleet as one Ollama- and OpenAI-compatible HTTP endpoint."""

    gateway_host: str = "127.0.0.1"
    """Loopback by default. On any other address the gateway wants API keys (``coordinator
    keys add``) and refuses to start without one unless ``GATEWAY_ALLOW_OPEN`` says so."""
    gateway_port: int = 11400
    gateway_task_timeout_s: float | None = None
    """The timeout the gateway's tasks ask for; unset: the router's ``DEFAULT_TIMEOUT_S``."""
    gateway_reply_timeout_s: float = 400.0
    """The longest the gateway waits for the router's next message before answering 504."""
    gateway_retry_after_s: int = 5
    """``Retry-After`` on 503 answers (no live worker, no router): about one heartbeat."""
    gateway_reask_s: float = 10.0
    """A waiting request whose router says nothing this long is sent again, naming its task:
    a router that died took the answer with it, and another answers the task it names."""
    gateway_max_body_bytes: int = 4 * 1024 * 1024
    """The largest request body the gateway reads (images are megabytes); a larger one is a
    413 in the API's own shape. Keep it under the NATS server's ``max_payload``: a task must
    fit in one message."""
    gateway_allow_open: bool = False
    """Serve a non-loopback ``GATEWAY_HOST`` without API keys: anyone who reaches the port
    can use the fleet. Off: such a gateway refuses to start until a key exists."""
    gateway_header_timeout_s: float = 10.0
    """From a request's first byte to the end of its headers; a slower client (slowloris) is
    disconnected."""
    gateway_body_timeout_s: float = 60.0
    """The longest a request body may take to arrive whole; then 408 and the connection is
    closed (a ``Content-Length`` larger than what is sent ends here, not in a hang)."""
    gateway_keepalive_timeout_s: float = 75.0
    """How long an idle keep-alive connection (or one that never sends a request) stays open."""
    gateway_events_lookback_s: float = 3600.0
    """How far back the dashboard reads the event log at start (recent tasks, failures, the
    reaper's moves, the charts); the metrics count only what happens after the start."""
    worker_ttl_s: float = DEFAULT_WORKER_TTL_S
    """Liveness, as the router and the reaper judge it: the dashboard shows a worker whose
    heartbeat is older than this as lost."""

    def check(self) -> None:
        if not 0 < self.gateway_port < 65536:
            raise ConfigError(f"GATEWAY_PORT must be a TCP port (1-65535), got {self.gateway_port}")
        if self.gateway_task_timeout_s is not None and self.gateway_task_timeout_s <= 0:
            raise ConfigError("GATEWAY_TASK_TIMEOUT_S must be a positive number of seconds")
        if self.gateway_reply_timeout_s <= 0:
            raise ConfigError("GATEWAY_REPLY_TIMEOUT_S must be a positive number of seconds")
        if self.gateway_retry_after_s < 0:
            raise ConfigError("GATEWAY_RETRY_AFTER_S must not be negative")
        if self.gateway_reask_s <= 0:
            raise ConfigError("GATEWAY_REASK_S must be a positive number of seconds")
        if self.gateway_max_body_bytes <= 0:
            raise ConfigError("GATEWAY_MAX_BODY_BYTES must be a positive number of bytes")
        if self.gateway_events_lookback_s < 0:
            raise ConfigError("GATEWAY_EVENTS_LOOKBACK_S must not be negative")
        if self.worker_ttl_s <= 0:
            raise ConfigError("WORKER_TTL_S must be a positive number of seconds")
        for name in ("header", "body", "keepalive"):
            if getattr(self, f"gateway_{name}_timeout_s") <= 0:
                raise ConfigError(
                    f"GATEWAY_{name.upper()}_TIMEOUT_S must be a positive number of seconds"
                )
