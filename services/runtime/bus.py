"""The bus: connecting to NATS, and creating or updating the streams and buckets.

Stream setup is idempotent: every service calls `ensure_streams` at start, so whichever starts
first creates them and a changed setting (say, the events' max age) is applied on the next
start. It looks before it writes (``STREAM.INFO`` first), so a service whose NATS user may not
create or change streams (deploy/nats/nats-server.conf: they are made by ``coordinator setup``
with the admin user) starts as long as they exist. Only features of nats-server 2.9 are needed;
`fences_by_subject` tells when a 2.11 feature saves a round trip.
"""

from __future__ import annotations

import dataclasses
import ssl
from typing import Any

import nats
import nats.errors
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
from nats.js.errors import APIError, BadRequestError, NotFoundError
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
from services.runtime.settings import DEFAULT_WORKER_TTL_S, NatsAuth, Settings
from services.runtime.tracing import inject_context

log = structlog.get_logger("bus")

# A retried publish of the same task attempt within this window is stored once.
DUPLICATE_WINDOW_S = 120.0
# JetStream's error code for a publish whose expected last sequence is not the stream's.
WRONG_LAST_SEQUENCE = 10071


async def connect(
    url: str, name: str, *, connect_timeout_s: float = 5.0, auth: NatsAuth | None = None
) -> Client:
    """Connect with endless reconnects; connection changes are logged, not printed as tracebacks.

    ``auth`` is the service's `Settings.nats_auth`; without it the ``NATS_*`` credential
    variables of this process's environment apply (the CLI and the jobs).
    """
    if auth is None:
        auth = Settings.from_env().nats_auth()

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
            **_auth_options(auth),
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


def _auth_options(auth: NatsAuth) -> dict[str, Any]:
    options: dict[str, Any] = {}
    if auth.user is not None:
        options.update(user=auth.user, password=auth.password)
    if auth.token is not None:
        options["token"] = auth.token
    if auth.creds is not None:
        options["user_credentials"] = auth.creds
    if auth.tls_ca is not None or auth.tls_cert is not None:
        context = ssl.create_default_context(cafile=auth.tls_ca)
        if auth.tls_cert is not None:
            context.load_cert_chain(auth.tls_cert, auth.tls_key)
        options["tls"] = context
    return options


# The stream settings `ensure_streams` owns; anything else on an existing stream is left alone.
_OWNED = ("subjects", "max_age", "duplicate_window", "allow_direct", "discard")


def _norm(value: Any) -> Any:
    """Unset and zero mean the same to the server (no limit, off)."""
    return value or None


async def _add_or_update(
    js: JetStreamContext, config: StreamConfig, owned: tuple[str, ...] = _OWNED
) -> None:
    """Create the stream if it is missing, bring the ``owned`` settings in line if they differ."""
    assert config.name is not None
    try:
        info = await js.stream_info(config.name)
    except NotFoundError:
        try:
            await js.add_stream(config)
        except BadRequestError:
            await js.update_stream(config)  # made meanwhile by another service
        except nats.errors.TimeoutError as exc:
            raise Unavailable(
                f"stream {config.name} does not exist and could not be created (this NATS "
                "user may not create streams?): run `coordinator setup` with the admin user"
            ) from exc
        return
    current = info.config
    differs = [k for k in owned if _norm(getattr(config, k)) != _norm(getattr(current, k))]
    if not differs:
        return
    try:
        await js.update_stream(
            dataclasses.replace(current, **{k: getattr(config, k) for k in differs})
        )
    except nats.errors.TimeoutError:
        # No answer: this user may not change streams. Run with what is there.
        log.warning(
            "stream differs from this service's settings and could not be updated; "
            "run `coordinator setup` with the admin user",
            stream=config.name,
            fields=differs,
        )


async def ensure_streams(
    js: JetStreamContext,
    *,
    worker_ttl_s: float = DEFAULT_WORKER_TTL_S,
    events_max_age_s: float | None = None,
) -> KeyValue:
    """Create or update ``TASKS``, ``EVENTS`` and the ``workers`` bucket; return the bucket.

    ``events_max_age_s`` None leaves an existing ``EVENTS`` stream's max age as it is (only
    ``coordinator setup`` sets it; 0 means keep every event).
    """
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
            # Last-by-subject reads name the subject in the API subject
            # ($JS.API.DIRECT.GET.EVENTS.<subject>), so a user's permissions can limit them.
            allow_direct=True,
        ),
        owned=_OWNED
        if events_max_age_s is not None
        else tuple(k for k in _OWNED if k != "max_age"),
    )
    return await ensure_bucket(js, WORKERS_BUCKET, ttl_s=worker_ttl_s)


async def ensure_bucket(js: JetStreamContext, bucket: str, *, ttl_s: float | None) -> KeyValue:
    """Create the KV bucket, or update its TTL when it exists with another one."""
    config = KeyValueConfig(bucket=bucket, history=1, ttl=ttl_s, storage=StorageType.FILE)
    try:
        info = await js.stream_info(f"KV_{bucket}")
    except NotFoundError:
        try:
            return await js.create_key_value(config)
        except BadRequestError:
            info = await js.stream_info(f"KV_{bucket}")  # made meanwhile by another service
        except nats.errors.TimeoutError as exc:
            raise Unavailable(
                f"bucket {bucket} does not exist and could not be created (this NATS user may "
                "not create streams?): run `coordinator setup` with the admin user"
            ) from exc
    stream_config = dataclasses.replace(info.config)
    if _norm(stream_config.max_age) != _norm(ttl_s):
        stream_config.max_age = ttl_s
        if ttl_s and stream_config.duplicate_window and stream_config.duplicate_window > ttl_s:
            # The server refuses a duplicate window longer than the max age (a shorter TTL).
            stream_config.duplicate_window = ttl_s
        try:
            await js.update_stream(stream_config)
        except nats.errors.TimeoutError:
            log.warning(
                "bucket TTL differs from this service's settings and could not be changed; "
                "run `coordinator setup` with the admin user",
                bucket=bucket,
                ttl_s=ttl_s,
                bucket_ttl_s=info.config.max_age,
            )
    return await js.key_value(bucket)


def fences_by_subject(nc: Client) -> bool:
    """Does the server take ``Nats-Expected-Last-Subject-Sequence-Subject`` (nats-server 2.11
    and newer)? An older one ignores that header and would compare the wrong subject."""
    version = nc.connected_server_version
    return (version.major, version.minor) >= (2, 11)


def is_wrong_last_sequence(exc: BaseException) -> bool:
    """Was a publish refused because its expected last sequence was not the stream's?"""
    return isinstance(exc, APIError) and exc.err_code == WRONG_LAST_SEQUENCE


async def publish_event(
    js: JetStreamContext,
    event: AnyEvent,
    *,
    msg_id: str | None = None,
    headers: dict[str, str] | None = None,
    expect_last: tuple[str, int] | None = None,
) -> Any:
    """Store one event; returns the stream's acknowledgement (raises if it was not stored).

    ``expect_last`` = (subject, sequence) stores it only while ``sequence`` is the last message
    on ``subject`` (needs `fences_by_subject`); otherwise the publish is refused with an
    `APIError` that `is_wrong_last_sequence`.
    """
    # The trace of the work that caused the event goes with it (the stats projection continues it).
    all_headers = inject_context(dict(headers or {}))
    if msg_id is not None:
        all_headers["Nats-Msg-Id"] = msg_id
    if expect_last is not None:
        all_headers["Nats-Expected-Last-Subject-Sequence"] = str(expect_last[1])
        all_headers["Nats-Expected-Last-Subject-Sequence-Subject"] = expect_last[0]
    return await js.publish(subject_for(event), encoder.encode(event), headers=all_headers or None)
