"""Settings from the environment: one frozen Struct per service, checked at start.

A field ``nats_url`` is read from ``NATS_URL``; list fields are comma-separated. A missing
required variable or a malformed value stops the start with an error naming the variable.
Here: `Settings`, what every service has (NATS, logging) and how it is read, and the worker
kinds' settings, which the task loop reads. Each other service's own live beside it
(``services/<service>/settings.py``; the commands that run no service: `services.cli.settings`).
"""

from __future__ import annotations

import math
import os
import re
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar

import msgspec

from schemas.subjects import POOL_NAMES, InvalidId, check_worker_id
from schemas.workers import Capability
from services.errors import ConfigError

S = TypeVar("S", bound="Settings")

_MAC = re.compile(r"^[0-9A-Fa-f]{2}([:-][0-9A-Fa-f]{2}){5}$")
# One server of NATS_URL: [scheme://][credentials@]host[:port], the host a name, an IPv4 or
# a bracketed IPv6 address.
_NATS_SERVER = re.compile(
    r"^(?:(?:nats|tls|ws|wss)://)?(?:[^\s/@]+@)?(?:\[[0-9A-Fa-f:.]+\]|[^\s/:@\[\],]+)(?::\d{1,5})?/?$"
)

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
    return cleaned[:128] if cleaned not in POOL_NAMES else f"{cleaned}-worker"


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

    def proves_who(self) -> bool:
        """Does the connection say who it is (a user, a token, a creds file)? Then the
        server's permissions apply to it: a bus with users, not an open one."""
        return any(way is not None for way in (self.user, self.token, self.creds))


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
    ollama_models: str | None = None
    """Where the backend keeps its models (Ollama's own variable): a pull asked of a machine
    with less free space there than the model takes is refused before it starts. Unset: the
    first of Ollama's defaults that exists (``~/.ollama/models``, the Linux service's
    ``/usr/share/ollama/.ollama/models``); none: not checked."""
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
    def models_dir(self) -> Path | None:
        """Where the backend keeps its models (`ollama_models`), if known."""
        if self.ollama_models:
            return Path(self.ollama_models).expanduser()
        defaults = (Path.home() / ".ollama" / "models", Path("/usr/share/ollama/.ollama/models"))
        return next((path for path in defaults if path.is_dir()), None)

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


def _is_list(tp: Any) -> bool:
    return getattr(tp, "__origin__", None) is list or (
        hasattr(tp, "__args__") and any(getattr(a, "__origin__", None) is list for a in tp.__args__)
    )


def _split(value: str) -> list[str]:
    return [part.strip() for part in value.split(",") if part.strip()]
