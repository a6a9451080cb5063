"""The bus: connecting to NATS, and creating or updating the streams and buckets.

Stream setup is idempotent: every service calls `ensure_streams` at start, so whichever starts
first creates them and a changed setting (say, the events' max age) is applied on the next
start. Only features of nats-server 2.9 are used.
"""

from __future__ import annotations

from typing import Any

import nats
import structlog
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import (
    DiscardPolicy,
    KeyValueConfig,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.errors import BadRequestError
from nats.js.kv import KeyValue

from schemas.events import AnyEvent, encoder, subject_for
from schemas.subjects import (
    EVENTS_STREAM,
    EVENTS_SUBJECTS,
    TASKS_STREAM,
    TASKS_SUBJECTS,
    WORKERS_BUCKET,
)
from services.runtime.errors import Unavailable

log = structlog.get_logger("bus")

# A retried publish of the same task attempt within this window is stored once.
DUPLICATE_WINDOW_S = 120.0


async def connect(url: str, name: str, *, connect_timeout_s: float = 5.0) -> Client:
    """Connect with endless reconnects; connection changes are logged, not printed as tracebacks."""

    async def on_error(exc: Exception) -> None:
        log.warning("nats error", error=repr(exc), client=name)

    async def on_disconnected() -> None:
        log.warning("nats disconnected", client=name)

    async def on_reconnected() -> None:
        log.info(
            "nats reconnected",
            client=name,
            url=str(nc.connected_url.netloc if nc.connected_url else ""),
        )

    async def on_closed() -> None:
        log.info("nats connection closed", client=name)

    try:
        nc = await nats.connect(
            servers=[url],
            name=name,
            connect_timeout=connect_timeout_s,
            allow_reconnect=True,
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.5,
            error_cb=on_error,
            disconnected_cb=on_disconnected,
            reconnected_cb=on_reconnected,
            closed_cb=on_closed,
        )
    except Exception as exc:
        raise Unavailable(f"cannot reach NATS at {url}: {exc or type(exc).__name__}") from exc
    return nc


async def _add_or_update(js: JetStreamContext, config: StreamConfig) -> None:
    try:
        await js.add_stream(config)
    except BadRequestError:
        # Exists with another configuration: bring it to this one.
        await js.update_stream(config)


async def ensure_streams(
    js: JetStreamContext, *, worker_ttl_s: float = 15.0, events_max_age_s: float = 0.0
) -> KeyValue:
    """Create or update ``TASKS``, ``EVENTS`` and the ``workers`` bucket; return the bucket."""
    await _add_or_update(
        js,
        StreamConfig(
            name=TASKS_STREAM,
            subjects=[TASKS_SUBJECTS],
            retention=RetentionPolicy.WORK_QUEUE,
            storage=StorageType.FILE,
            duplicate_window=DUPLICATE_WINDOW_S,
        ),
    )
    await _add_or_update(
        js,
        StreamConfig(
            name=EVENTS_STREAM,
            subjects=[EVENTS_SUBJECTS],
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            discard=DiscardPolicy.OLD,
            max_age=events_max_age_s or None,
            duplicate_window=DUPLICATE_WINDOW_S,
        ),
    )
    return await ensure_bucket(js, WORKERS_BUCKET, ttl_s=worker_ttl_s)


async def ensure_bucket(js: JetStreamContext, bucket: str, *, ttl_s: float | None) -> KeyValue:
    """Create the KV bucket, or update its TTL when it exists with another one."""
    config = KeyValueConfig(bucket=bucket, history=1, ttl=ttl_s, storage=StorageType.FILE)
    try:
        return await js.create_key_value(config)
    except BadRequestError:
        info = await js.stream_info(f"KV_{bucket}")
        stream_config = info.config
        stream_config.max_age = ttl_s
        if ttl_s and stream_config.duplicate_window and stream_config.duplicate_window > ttl_s:
            # The server refuses a duplicate window longer than the max age (a shorter TTL).
            stream_config.duplicate_window = ttl_s
        await js.update_stream(stream_config)
        return await js.key_value(bucket)


async def publish_event(
    js: JetStreamContext,
    event: AnyEvent,
    *,
    msg_id: str | None = None,
    headers: dict[str, str] | None = None,
) -> Any:
    """Store one event; returns the stream's acknowledgement (raises if it was not stored)."""
    all_headers = dict(headers or {})
    if msg_id is not None:
        all_headers["Nats-Msg-Id"] = msg_id
    return await js.publish(subject_for(event), encoder.encode(event), headers=all_headers or None)
