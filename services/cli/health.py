"""``coordinator setup`` and ``coordinator health``: the streams and buckets made, and one
role's health check (a container's or a unit's).

A role is healthy when its service answers a NATS micro ``PING``, its worker's registry entry is
fresh, its HTTP endpoint answers (the gateway) or, for a role that shows itself nowhere on the
bus, when NATS and the ``TASKS`` stream answer its user.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from schemas.subjects import TASKS_STREAM, WORKERS_BUCKET
from services.cli.replication import (
    FLEET_BUCKETS,
    LEASE_BUCKETS,
    Replication,
    check_replicas_possible,
    set_replicas,
)
from services.cli.roles import MICRO_SERVICES, PER_WORKER
from services.fleet.liveness import is_fresh
from services.gateway.settings import GatewaySettings
from services.runtime.settings import (
    DEFAULT_ACK_WAIT_S,
    NatsAuth,
    Settings,
    WebSearchSettings,
    WorkerSettings,
)


async def setup_streams(
    nats_url: str,
    *,
    worker_ttl_s: float,
    events_max_age_s: float,
    auth: NatsAuth | None = None,
    replicas: int | None = None,
) -> list[Replication]:
    """Create or update every stream, bucket and pool consumer (the ``operator`` user may).

    ``replicas``: how many servers of a JetStream cluster keep each stream and bucket (see
    `services.cli.replication`); None makes new ones with one and leaves existing ones as
    they are, so a setup run without it never undoes a cluster's replicas. Returns each
    stream's copies when ``replicas`` was given.
    """
    from services.runtime.bus import connect, ensure_bucket, ensure_streams
    from services.runtime.consumers import POOL_QUEUES, ensure_consumer

    nc = await connect(nats_url, "coordinator-setup", auth=auth)
    try:
        js = nc.jetstream()
        if replicas is not None:
            # Before anything is made: a refusal leaves the server as it was.
            check_replicas_possible(nc._server_info, nats_url, replicas)
        await ensure_streams(js, worker_ttl_s=worker_ttl_s, events_max_age_s=events_max_age_s)
        for bucket in FLEET_BUCKETS:
            if bucket != WORKERS_BUCKET:  # made with its TTL by ensure_streams
                ttl_s = worker_ttl_s if bucket in LEASE_BUCKETS else None
                await ensure_bucket(js, bucket, ttl_s=ttl_s)
        for pool in POOL_QUEUES:  # workers may pull from these, not make or change them
            await ensure_consumer(js, pool, ack_wait_s=DEFAULT_ACK_WAIT_S)
        if replicas is None:
            return []
        return await set_replicas(js, nc._server_info, nats_url, replicas)
    finally:
        await nc.close()


async def check_health(role: str, env: Mapping[str, str] | None = None) -> str:
    """Why ``role`` is unhealthy here, or ``""`` when it is healthy."""
    from services.runtime.bus import connect

    if role == "gateway":
        return await _gateway_health(GatewaySettings.from_env(env))
    settings: Settings
    if role in PER_WORKER:
        settings = (WorkerSettings if role == "worker" else WebSearchSettings).from_env(env)
    else:
        settings = Settings.from_env(env)
    try:
        # Outside a service, connect() gives up at the first failure (Unavailable, naming the URL).
        nc = await connect(
            settings.nats_url,
            f"coordinator-health-{role}",
            connect_timeout_s=2.0,
            auth=settings.nats_auth(),
        )
    except Exception as exc:
        return str(exc) or f"cannot reach NATS at {settings.nats_url}: {type(exc).__name__}"
    try:
        if role in MICRO_SERVICES:
            try:
                await nc.request(f"$SRV.PING.{MICRO_SERVICES[role]}", b"", timeout=3.0)
            except Exception as exc:
                return f"{MICRO_SERVICES[role]} does not answer PING ({type(exc).__name__})"
            return ""
        if isinstance(settings, WorkerSettings | WebSearchSettings):
            return await _registry_health(nc, settings)
        try:
            await nc.jetstream(timeout=3.0).stream_info(TASKS_STREAM)
        except Exception as exc:
            return f"stream {TASKS_STREAM} does not answer ({type(exc).__name__})"
        return ""
    finally:
        await nc.close()


async def _registry_health(nc: Any, settings: WorkerSettings | WebSearchSettings) -> str:
    """What is wrong with this host's worker's registry entry, or "" when it is fresh.

    Freshness only (`is_fresh`): a worker that is stopping is still this host's, healthy.
    """
    import msgspec
    from nats.js.errors import KeyNotFoundError, NotFoundError

    from schemas.workers import worker_record_decoder

    try:
        kv = await nc.jetstream(timeout=3.0).key_value(WORKERS_BUCKET)
        entry = await kv.get(settings.worker_id)
        record = worker_record_decoder.decode(entry.value or b"")
    except (KeyNotFoundError, NotFoundError, msgspec.DecodeError):
        return f"worker {settings.worker_id} is not registered"
    now = time.time()
    if not is_fresh(record.heartbeat_at, now, settings.worker_ttl_s):
        return f"worker {settings.worker_id}: last heartbeat {now - record.heartbeat_at:.0f} s ago"
    if record.host != settings.worker_host:
        return f"worker {settings.worker_id} runs on {record.host}, not here"
    return ""


async def _gateway_health(settings: GatewaySettings) -> str:
    import httpx

    host = "127.0.0.1" if settings.gateway_host in ("0.0.0.0", "::", "") else settings.gateway_host
    url = f"http://{host}:{settings.gateway_port}/api/version"
    try:
        async with httpx.AsyncClient(timeout=3.0) as client:
            reply = await client.get(url)
    except httpx.HTTPError as exc:
        return f"{url}: {type(exc).__name__}"
    return "" if reply.status_code == 200 else f"{url}: HTTP {reply.status_code}"
