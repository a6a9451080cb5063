"""Settings from the environment: one frozen Struct per service, checked at start.

A field ``nats_url`` is read from ``NATS_URL``; list fields are comma-separated. A missing
required variable or a malformed value stops the start with an error naming the variable.
"""

from __future__ import annotations

import math
import os
import re
import socket
from collections.abc import Mapping
from typing import Any, Literal, TypeVar

import msgspec

from schemas.subjects import InvalidId, check_worker_id
from schemas.workers import Capability
from services.errors import ConfigError
from services.fleet.policy import DEFAULT_GPU_PREFERENCE

S = TypeVar("S", bound="Settings")

_MAC = re.compile(r"^[0-9A-Fa-f]{2}([:-][0-9A-Fa-f]{2}){5}$")
# One server of NATS_URL: [scheme://][credentials@]host[:port], the host a name, an IPv4 or
# a bracketed IPv6 address.
_NATS_SERVER = re.compile(
    r"^(?:(?:nats|tls|ws|wss)://)?(?:[^\s/@]+@)?(?:\[[0-9A-Fa-f:.]+\]|[^\s/:@\[\],]+)(?::\d{1,5})?/?$"
)
# JetStream keeps at most this many copies of a stream.
MAX_REPLICAS = 5

LogFormat = Literal["auto", "json", "console"]

# Liveness, shared by every service that writes or judges a registry entry (they must agree:
# each one sets the bucket's TTL at start). A worker heartbeats every second and is dead after
# three missed beats, so the reaper moves a dead worker's task in under 5 s
# (benchmarks/failover.py); a slower fleet raises both together.
DEFAULT_HEARTBEAT_INTERVAL_S = 1.0
DEFAULT_WORKER_TTL_S = 3.0
# How long a pulled task's message waits for its ack (or an in_progress) before redelivery.
DEFAULT_ACK_WAIT_S = 30.0


def default_worker_id() -> str:
    """The host's short name, made safe for a subject token."""
    name = socket.gethostname().split(".")[0]
    cleaned = re.sub(r"[^A-Za-z0-9_-]", "-", name).strip("-") or "worker"
    return cleaned[:128] if cleaned not in {"shared", "web"} else f"{cleaned}-worker"


def nats_servers(nats_url: str) -> list[str]:
    """The servers ``NATS_URL`` names, in order: one URL, or the nodes of a cluster
    comma-separated (a client fails over between them)."""
    return [server.strip() for server in nats_url.split(",") if server.strip()]


class NatsAuth(msgspec.Struct, frozen=True, kw_only=True):
    """How a process proves who it is to NATS, and which CA it trusts (all optional).

    The URL may carry ``user:password@`` or ``token@`` as well; these variables keep secrets
    out of it. One of: user and password, a token, or a creds file (a JWT and its NKey seed).
    """

    user: str | None = None
    password: str | None = None
    token: str | None = None
    creds: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    inbox_prefix: str | None = None


class Settings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Settings every service has."""

    nats_url: str = "nats://127.0.0.1:4222"
    # Credentials for a server with authorization (deploy/nats/nats-server.conf: one user
    # per role). Unset: connect without.
    nats_user: str | None = None
    nats_password: str | None = None
    nats_token: str | None = None
    nats_creds: str | None = None
    """Path of a ``.creds`` file (decentralised auth: a user JWT and its seed)."""
    nats_tls_ca: str | None = None
    """Path of the CA certificate (PEM) that signed the server's; makes the connection TLS."""
    nats_tls_cert: str | None = None
    nats_tls_key: str | None = None
    """A client certificate and its key (PEM), for a server that verifies clients."""
    nats_inbox_prefix: str | None = None
    """Where this process's replies arrive; by default ``_INBOX_<NATS_USER>`` (``_INBOX``
    without a user), which the shipped server configuration lets only that user read."""
    log_level: str = "info"
    log_format: LogFormat = "auto"

    @classmethod
    def from_env(cls: type[S], environ: Mapping[str, str] | None = None) -> S:
        """Read this Struct's fields from the environment (``os.environ`` by default)."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for field in msgspec.structs.fields(cls):
            value = env.get(field.name.upper())
            if value is None or value.strip() == "":
                if field.required:
                    raise ConfigError(f"{field.name.upper()} is required but not set")
                continue
            given = _split(value) if _is_list(field.type) else value.strip()
            try:  # each variable on its own, so that a failure names it
                values[field.name] = msgspec.convert(given, field.type, strict=False)
            except msgspec.ValidationError as exc:
                raise ConfigError(f"{field.name.upper()}={given!r} is malformed: {exc}") from None
        settings = msgspec.convert(values, cls, strict=False)
        settings.check_nats()
        settings.check()
        return settings

    def check(self) -> None:
        """Cross-field checks; raise `ConfigError` naming the variable."""

    def check_nats(self) -> None:
        """NATS_URL names one server or several, and the credentials make sense together
        and their files exist."""
        servers = nats_servers(self.nats_url)
        if not servers:
            raise ConfigError("NATS_URL names no server")
        for server in servers:
            if not _NATS_SERVER.match(server):
                raise ConfigError(
                    f"NATS_URL: {server!r} is malformed: expected nats://host:port (the nodes "
                    "of a cluster comma-separated)"
                )
        if (self.nats_user is None) != (self.nats_password is None):
            raise ConfigError("NATS_USER and NATS_PASSWORD go together: set both or neither")
        ways = (self.nats_user, self.nats_token, self.nats_creds)
        if sum(way is not None for way in ways) > 1:
            raise ConfigError("set one of NATS_USER/NATS_PASSWORD, NATS_TOKEN or NATS_CREDS")
        if (self.nats_tls_cert is None) != (self.nats_tls_key is None):
            raise ConfigError("NATS_TLS_CERT and NATS_TLS_KEY go together: set both or neither")
        for name in ("nats_creds", "nats_tls_ca", "nats_tls_cert", "nats_tls_key"):
            path = getattr(self, name)
            if path is not None and not os.path.isfile(path):
                raise ConfigError(f"{name.upper()}={path!r}: no such file")

    def nats_auth(self) -> NatsAuth:
        return NatsAuth(
            user=self.nats_user,
            password=self.nats_password,
            token=self.nats_token,
            creds=self.nats_creds,
            tls_ca=self.nats_tls_ca,
            tls_cert=self.nats_tls_cert,
            tls_key=self.nats_tls_key,
            inbox_prefix=self.nats_inbox_prefix,
        )


def check_gpu_preference(value: float) -> None:
    """``GPU_PREFERENCE`` is a factor of at least 1 (``inf``: a live GPU worker always)."""
    if not value >= 1.0:  # NaN too
        raise ConfigError(
            f"GPU_PREFERENCE must be a number of at least 1 (or inf), not {value!r}: how many "
            "times later than the best CPU worker the best GPU worker may finish a task"
        )


def check_lease_timing(heartbeat_interval_s: float, worker_ttl_s: float) -> None:
    """A lease renewed every ``HEARTBEAT_INTERVAL_S`` stays fresh between two renewals only
    when ``WORKER_TTL_S`` is longer than two intervals (its holder stops one interval before
    the TTL: `services.fleet.liveness.in_touch`)."""
    if heartbeat_interval_s <= 0 or worker_ttl_s <= 2 * heartbeat_interval_s:
        raise ConfigError(
            "WORKER_TTL_S must be longer than twice HEARTBEAT_INTERVAL_S (> 0): a lease "
            "renewed every interval must stay fresh for one more"
        )


class RouterSettings(Settings, frozen=True, kw_only=True):
    max_prompt_chars: int = 200_000
    default_timeout_s: float = 300.0
    worker_ttl_s: float = DEFAULT_WORKER_TTL_S
    gpu_models: list[str] = []
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


class WorkerSettings(Settings, frozen=True, kw_only=True):
    worker_id: str = msgspec.field(default_factory=default_worker_id)
    worker_host: str = msgspec.field(default_factory=socket.gethostname)
    worker_supports: list[Capability] = msgspec.field(default_factory=lambda: ["cpu_inference"])
    worker_models: list[str] = []
    worker_backend: Literal["ollama", "openai"] = "ollama"
    ollama_host: str = "http://localhost:11434"
    openai_base_url: str = "http://localhost:8080/v1"
    openai_api_key: str | None = None
    wol_mac: str | None = None
    worker_memory_gb: float | None = None
    """How much of models the backend holds in memory (GB, as ``ollama ps`` counts them:
    10^9 bytes), for routing to tell what a load would push out; unset: the most the worker
    has seen held at once."""
    shared_queue: bool = True
    """CPU workers also pull ``tasks.cpu.shared``."""
    sanity_check: bool = True
    sanity_timeout_s: float = 120.0
    # Backend health (services/fleet/health.py): the worker's own probes, between tasks.
    health_interval_s: float = 30.0
    """Between two probes while idle: the model list, or while degraded a generation."""
    health_idle_probe_s: float = 600.0
    """Idle this long since the last generation that worked: a one-token generation per
    model (which loads it, if it was not). 0: never."""
    first_token_timeout_s: float = 120.0
    """A generation's first streamed line must come within this (a cold load of a big model
    included); else it fails ``backend_timeout`` and the worker is degraded."""
    progress_timeout_s: float = 60.0
    """The longest silence between two streamed lines of a generation."""
    heartbeat_interval_s: float = DEFAULT_HEARTBEAT_INTERVAL_S
    worker_ttl_s: float = DEFAULT_WORKER_TTL_S
    ack_wait_s: float = DEFAULT_ACK_WAIT_S
    backend_connect_timeout_s: float = 5.0
    stop_grace_s: float = 30.0
    worker_watchdog_s: float | None = None
    """A worker run as its own process (``coordinator worker``) is killed by its watchdog
    process when it has not run for this long while a task runs (stopped, stalled), so that
    its backend stops generating before the reaper may move the task, after ``WORKER_TTL_S``
    (`services.runtime.watchdog`). Unset: ``WORKER_TTL_S`` less ``HEARTBEAT_INTERVAL_S``;
    0: no watchdog."""
    # Idle shutdown, for machines woken by Wake-on-LAN: off unless IDLE_SHUTDOWN_SEC is set.
    idle_shutdown_sec: float | None = None
    min_uptime_sec: float = 0.0
    idle_check_interval_sec: float = 30.0
    shutdown_command: str = "systemctl poweroff"

    def check(self) -> None:
        try:
            check_worker_id(self.worker_id)
        except InvalidId as exc:
            raise ConfigError(f"WORKER_ID: {exc}") from None
        if self.idle_shutdown_sec is not None and self.idle_shutdown_sec <= 0:
            raise ConfigError("IDLE_SHUTDOWN_SEC must be a positive number of seconds")
        if self.idle_check_interval_sec <= 0:
            raise ConfigError("IDLE_CHECK_INTERVAL_SEC must be a positive number of seconds")
        if self.wol_mac is not None and not _MAC.match(self.wol_mac):
            raise ConfigError(f"WOL_MAC={self.wol_mac!r} is malformed: expected aa:bb:cc:dd:ee:ff")
        if not {"cpu_inference", "gpu_inference"}.intersection(self.worker_supports):
            raise ConfigError("WORKER_SUPPORTS: name at least one of cpu_inference, gpu_inference")
        if self.heartbeat_interval_s <= 0 or self.worker_ttl_s <= self.heartbeat_interval_s:
            raise ConfigError("WORKER_TTL_S must be longer than HEARTBEAT_INTERVAL_S (> 0)")
        for name in ("health_interval_s", "first_token_timeout_s", "progress_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name.upper()} must be a positive number of seconds")
        if self.health_idle_probe_s < 0:
            raise ConfigError("HEALTH_IDLE_PROBE_S must not be negative (0: never)")
        if self.worker_memory_gb is not None and not 0 < self.worker_memory_gb < math.inf:
            raise ConfigError("WORKER_MEMORY_GB must be a positive number of GB")
        watchdog_s = self.worker_watchdog_s
        if watchdog_s is not None and not (watchdog_s == 0 or 0 < watchdog_s < self.worker_ttl_s):
            raise ConfigError(
                f"WORKER_WATCHDOG_S must be 0 (no watchdog) or shorter than WORKER_TTL_S "
                f"({self.worker_ttl_s:g} s): a stalled worker must be stopped before the "
                "reaper may move its task"
            )

    @property
    def watchdog_s(self) -> float:
        """The watchdog's limit (`worker_watchdog_s`); 0: none."""
        if self.worker_watchdog_s is not None:
            return self.worker_watchdog_s
        return self.worker_ttl_s - self.heartbeat_interval_s

    @property
    def memory_bytes(self) -> int | None:
        """``WORKER_MEMORY_GB`` in bytes (None: unset)."""
        gb = self.worker_memory_gb
        return None if gb is None else round(gb * 1e9)


def default_web_worker_id() -> str:
    """``<host>-web``: a web-search worker and an inference worker on one host must not share
    a registry entry (the second would be refused as a duplicate)."""
    return f"{default_worker_id()[:124]}-web"


class WebSearchSettings(Settings, frozen=True, kw_only=True):
    """``coordinator web-search``: SearXNG for the results, a local model for the summary."""

    searxng_url: str = "http://localhost:8080"
    searxng_categories: list[str] = []
    """Empty: SearXNG's default (``general``)."""
    searxng_language: str | None = None
    """Unset: SearXNG's default for the instance."""
    searxng_results: int = 5
    """How many of the top results the summary rests on (SearXNG's API has no count)."""
    search_timeout_s: float = 15.0
    summary_backend: Literal["ollama", "openai"] = "ollama"
    ollama_host: str = "http://localhost:11434"
    ollama_model: str = "qwen2.5:0.5b"
    """The summary model, whichever backend serves it (``SUMMARY_BACKEND``)."""
    openai_base_url: str = "http://localhost:8080/v1"
    openai_api_key: str | None = None
    summary_timeout_s: float = 60.0
    worker_id: str = msgspec.field(default_factory=default_web_worker_id)
    worker_host: str = msgspec.field(default_factory=socket.gethostname)
    heartbeat_interval_s: float = DEFAULT_HEARTBEAT_INTERVAL_S
    worker_ttl_s: float = DEFAULT_WORKER_TTL_S
    ack_wait_s: float = DEFAULT_ACK_WAIT_S
    backend_connect_timeout_s: float = 5.0
    stop_grace_s: float = 30.0

    def check(self) -> None:
        try:
            check_worker_id(self.worker_id)
        except InvalidId as exc:
            raise ConfigError(f"WORKER_ID: {exc}") from None
        if not re.match(r"^https?://[^/\s]+", self.searxng_url):
            raise ConfigError(
                f"SEARXNG_URL={self.searxng_url!r} is malformed: expected http(s)://host[:port]"
            )
        if self.searxng_results < 1:
            raise ConfigError(f"SEARXNG_RESULTS must be at least 1, got {self.searxng_results}")
        for name in ("search_timeout_s", "summary_timeout_s", "ack_wait_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name.upper()} must be a positive number of seconds")
        if not self.ollama_model.strip():
            raise ConfigError("OLLAMA_MODEL must name the summary model")
        if self.ack_wait_s <= self.heartbeat_interval_s:
            # A redelivered task's starter is judged alive by its heartbeat (takeover.py).
            raise ConfigError("ACK_WAIT_S must be longer than HEARTBEAT_INTERVAL_S")
        if self.heartbeat_interval_s <= 0 or self.worker_ttl_s <= self.heartbeat_interval_s:
            raise ConfigError("WORKER_TTL_S must be longer than HEARTBEAT_INTERVAL_S (> 0)")


class StatsSettings(Settings, frozen=True, kw_only=True):
    pg_dsn: str
    batch_size: int = 256
    heartbeat_interval_s: float = DEFAULT_HEARTBEAT_INTERVAL_S
    worker_ttl_s: float = DEFAULT_WORKER_TTL_S
    """The projection's lease in the ``leaders`` bucket: renewed every heartbeat interval,
    taken over by a standby once older than the TTL (`services.runtime.leadership`)."""

    def check(self) -> None:
        check_lease_timing(self.heartbeat_interval_s, self.worker_ttl_s)


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
    gpu_models: list[str] = []
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


def check_replicas(replicas: int, name: str) -> None:
    """A stream's replica count is 1 to `MAX_REPLICAS` (JetStream's limit)."""
    if not 1 <= replicas <= MAX_REPLICAS:
        raise ConfigError(f"{name} must be 1 to {MAX_REPLICAS} (JetStream's limit), not {replicas}")


class DoctorSettings(Settings, frozen=True, kw_only=True):
    """``coordinator doctor``: on a JetStream cluster, the system account's user, which alone
    may read the cluster's meta group (its peers and leader)."""

    nats_system_user: str | None = None
    nats_system_password: str | None = None

    def check(self) -> None:
        if (self.nats_system_user is None) != (self.nats_system_password is None):
            raise ConfigError(
                "NATS_SYSTEM_USER and NATS_SYSTEM_PASSWORD go together: set both or neither"
            )

    def system_auth(self) -> NatsAuth | None:
        """The system user's credentials (with this process's TLS settings), or None."""
        if self.nats_system_user is None:
            return None
        return msgspec.structs.replace(
            self.nats_auth(),
            user=self.nats_system_user,
            password=self.nats_system_password,
            token=None,
            creds=None,
            inbox_prefix=None,
        )


class UpSettings(Settings, frozen=True, kw_only=True):
    """``coordinator up``: NATS_URL and PG_DSN unset mean 'start them embedded'."""

    pg_dsn: str | None = None
    ollama_host: str = "http://localhost:11434"
    coordinator_home: str = msgspec.field(
        default_factory=lambda: os.path.join(os.path.expanduser("~"), ".coordinator")
    )


def _is_list(tp: Any) -> bool:
    return getattr(tp, "__origin__", None) is list or (
        hasattr(tp, "__args__") and any(getattr(a, "__origin__", None) is list for a in tp.__args__)
    )


def _split(value: str) -> list[str]:
    return [part.strip() for part in value.split(",") if part.strip()]
