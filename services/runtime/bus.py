"""The bus: connecting to NATS, and creating or updating the streams and buckets.

Stream setup is idempotent: every service calls `ensure_streams` at start, so whichever starts
first creates them and a changed setting (say, the events' max age) is applied on the next
start. It looks before it writes (``STREAM.INFO`` first), so a service whose NATS user may not
create or change streams (deploy/nats/nats-server.conf: they are made by ``coordinator setup``
with the operator user) starts as long as they exist. Only features of nats-server 2.9 are needed;
`fences_by_subject` tells when a 2.11 feature saves a round trip.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import ssl
import sys
from collections.abc import Awaitable, Callable
from contextlib import suppress
from pathlib import Path
from typing import Any, Final, Protocol, TypeVar

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
    StreamInfo,
)
from nats.js.errors import (
    APIError,
    BadRequestError,
    NoStreamResponseError,
    NotFoundError,
    ServiceUnavailableError,
)
from nats.js.kv import KeyValue

from schemas.events import AnyEvent, encoder, subject_for
from schemas.subjects import (
    EVENTS_STREAM,
    EVENTS_SUBJECTS,
    TASKS_STREAM,
    TASKS_SUBJECTS,
    WORKERS_BUCKET,
    InvalidId,
    inbox_prefix,
)
from services.errors import ConfigError, StopRequested, Unavailable
from services.fleet.identity import asker_of, identity_of_creds
from services.runtime.lifecycle import current_stop
from services.runtime.settings import DEFAULT_WORKER_TTL_S, NatsAuth, Settings, nats_servers
from services.runtime.tracing import inject_context

log = structlog.get_logger("bus")

T = TypeVar("T")

# A retried publish of the same task attempt within this window is stored once.
# The message limit every shipped nats-server configuration sets (deploy/nats, the embedded
# server of `coordinator up`, the tests' servers): one task with its images must fit, and the
# gateway's body limit (GATEWAY_MAX_BODY_BYTES) stays below it. Services read the limit in
# force from the server (`Client.max_payload`) and refuse what exceeds it with `too_large`.
MAX_PAYLOAD: Final = "8MB"
DUPLICATE_WINDOW_S = 120.0
# JetStream's error codes for a publish whose expected last sequence is not the stream's:
# found in the stream (10071, "wrong last sequence: N"), or, on a replicated stream, another
# write on the fenced subject still being proposed (10164, "wrong last sequence").
WRONG_LAST_SEQUENCE: Final = frozenset({10071, 10164})


# A service waiting for NATS tries again after 0.5 s, then 1 s, then every 2 s.
FIRST_CONNECT_RETRY_S = 0.5
FIRST_CONNECT_RETRY_MAX_S = 2.0
# The client pings its server this often, and takes the connection as dead after this many
# pings unanswered: a server cut off without a reset (a partition, a host that lost power) is
# left for another of NATS_URL's within about 6-9 s, not the client library's 4-6 minutes.
PING_INTERVAL_S: Final = 3
MAX_OUTSTANDING_PINGS: Final = 2


async def connect(
    url: str,
    name: str,
    *,
    connect_timeout_s: float = 5.0,
    auth: NatsAuth | None = None,
    stop: asyncio.Event | None = None,
) -> Client:
    """Connect; once connected, reconnect for ever (changes are logged, not printed as tracebacks).

    ``url`` is ``NATS_URL``: one server, or the nodes of a cluster comma-separated. The client
    connects to any one of them, and when that one goes away it reconnects to another (and to
    the cluster's other servers, which the server it is connected to advertises), so a
    service fails over without a restart.

    Until the first connection, a process that runs until stopped (``stop``; by default the
    stop event `install_stop_signals` installed: a service, ``coordinator up``) tries again and
    again, logging each failed attempt, and gives up with `StopRequested` when ``stop`` is set.
    Anything else (a CLI command, a job) gives up with `Unavailable` at the first failed attempt
    or once every server has had its ``connect_timeout_s``: each server gets that long, so a
    node that does not answer at all (powered off) costs one server's timeout, and the next
    one is tried.

    ``auth`` is the service's `Settings.nats_auth`; without it the ``NATS_*`` credential
    variables of this process's environment apply (the CLI and the jobs).
    """
    if auth is None:
        auth = Settings.from_env().nats_auth()
    if stop is None:
        stop = current_stop()
    servers = nats_servers(url)
    # Every server's URL, as people read them in messages: each one was tried.
    where = ", ".join(servers)
    options = {
        "servers": servers,
        "name": name,
        "connect_timeout": connect_timeout_s,
        **_auth_options(auth),
        "allow_reconnect": True,
        "max_reconnect_attempts": -1,
        "reconnect_time_wait": 0.5,
        "ping_interval": PING_INTERVAL_S,
        "max_outstanding_pings": MAX_OUTSTANDING_PINGS,
    }
    # nats.py gives each server ``connect_timeout`` in turn: the attempt allows all of them.
    within_s = connect_timeout_s * len(servers)
    if stop is None:
        try:
            return await _connect_once(where, name, options, within_s=within_s, stop=None)
        except _Unreached as exc:
            raise Unavailable(f"cannot reach NATS at {where}: {exc}") from exc.__cause__
    attempt = 0
    while not stop.is_set():
        attempt += 1
        try:
            return await _connect_once(where, name, options, within_s=within_s, stop=stop)
        except _Unreached as exc:
            if _refused_credentials(exc.__cause__):
                # The server is up and said no: waiting will not change its mind.
                raise ConfigError(
                    f"NATS at {where} refused this service's credentials ({exc}): check "
                    "NATS_USER/NATS_PASSWORD, NATS_TOKEN or NATS_CREDS"
                ) from exc.__cause__
            retry_in_s = _retry_in_s(attempt)
            log.warning(
                "cannot reach NATS; trying again",
                url=where,
                error=str(exc),
                client=name,
                attempt=attempt,
                retry_in_s=retry_in_s,
            )
        with suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), retry_in_s)
    raise StopRequested(f"stopped before NATS at {where} answered")


def _retry_in_s(attempt: int) -> float:
    """How long a service waits before its ``attempt``-th try again (NATS, JetStream)."""
    return float(min(FIRST_CONNECT_RETRY_S * 2.0 ** (attempt - 1), FIRST_CONNECT_RETRY_MAX_S))


class _Unreached(Exception):
    """One attempt at a first connection failed; the message says why."""


async def _connect_once(
    where: str, name: str, options: dict[str, Any], *, within_s: float, stop: asyncio.Event | None
) -> Client:
    """The connected client; `_Unreached` once every server has failed an attempt (at once
    when one refuses the credentials: they are the same everywhere) or after ``within_s``,
    `StopRequested` when ``stop`` is set first. A client given up on is closed."""
    nc = Client()
    failed: asyncio.Future[Exception] = asyncio.get_running_loop().create_future()
    connected = False
    failures: list[Exception] = []

    async def on_error(exc: Exception) -> None:
        if not connected:
            failures.append(exc)
            # nats.py tries the servers in turn; the last one's failure ends this attempt.
            done = len(failures) >= len(options["servers"]) or _refused_credentials(exc)
            if done and not failed.done():
                failed.set_result(exc)
            return
        log.warning("nats error", error=repr(exc), client=name)

    async def on_disconnected() -> None:
        if connected:
            log.warning("nats disconnected", client=name)

    async def on_reconnected() -> None:
        log.info(
            "nats reconnected",
            client=name,
            url=str(nc.connected_url.netloc if nc.connected_url else ""),
        )

    async def on_closed() -> None:
        if connected:
            log.info("nats connection closed", client=name)

    connecting = asyncio.ensure_future(
        nc.connect(
            **options,
            error_cb=on_error,
            disconnected_cb=on_disconnected,
            reconnected_cb=on_reconnected,
            closed_cb=on_closed,
        )
    )
    stopping = asyncio.ensure_future(stop.wait()) if stop is not None else None
    waits: set[asyncio.Future[Any]] = {connecting, failed}
    if stopping is not None:
        waits.add(stopping)
    try:
        await asyncio.wait(waits, timeout=within_s, return_when=asyncio.FIRST_COMPLETED)
        if connecting.done() and not connecting.cancelled() and connecting.exception() is None:
            connected = True
            return nc
    finally:
        if stopping is not None:
            stopping.cancel()
        if not connected:
            connecting.cancel()
            await asyncio.wait({connecting})
            await nc.close()
    error = None if connecting.cancelled() else connecting.exception()
    if stopping is not None and stopping.done() and not stopping.cancelled():
        raise StopRequested(f"stopped before NATS at {where} answered")
    if failed.done():
        error = failed.result()
    if error is None:
        raise _Unreached(f"no answer within {within_s:g} s")
    # One reason when every server failed alike (the usual case), else each one once.
    said: list[BaseException] = [*failures] or [error]
    reasons = dict.fromkeys(_why(failure, within_s) for failure in said)
    raise _Unreached("; ".join(reasons)) from error


def _refused_credentials(exc: BaseException | None) -> bool:
    """Did the server turn the credentials down? (During the handshake nats.py reports it
    as a plain error carrying the server's words.)"""
    return isinstance(exc, nats.errors.AuthorizationError) or (
        exc is not None and "authorization violation" in str(exc).lower()
    )


def _why(exc: BaseException, timeout_s: float) -> str:
    """A failed connection attempt, in a few words."""
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, TimeoutError):
        return f"no answer within {timeout_s:g} s"
    if isinstance(exc, OSError) and exc.strerror:
        said = exc.strerror[:1].lower() + exc.strerror[1:]
        return said + local_network_hint(exc.errno, sys.platform)
    return str(exc) or type(exc).__name__


# macOS's EHOSTUNREACH. There, a program without the Local Network permission gets it for
# every address on the LAN while `nc` and `ping` (which have it) reach the same host.
_DARWIN_EHOSTUNREACH = 65


def local_network_hint(errno: int | None, platform: str) -> str:
    """What to do about "no route to host" on macOS, where it usually means a missing
    permission rather than a network fault; "" elsewhere."""
    if platform != "darwin" or errno != _DARWIN_EHOSTUNREACH:
        return ""
    return (
        " (on macOS this usually means this Python lacks the Local Network permission: allow"
        " it in System Settings → Privacy & Security → Local Network; macOS asks only in a"
        " desktop session, so start it once from a logged-in Terminal, not over SSH or"
        " launchd)"
    )


def identity_of(nc: Client) -> str | None:
    """The identity this connection's inbox names (`services.fleet.identity.asker_of`): the
    one whose subjects it may publish on (`schemas.subjects.cancel_from`); None on a bus
    without users."""
    return asker_of(nc.new_inbox())


def _auth_options(auth: NatsAuth) -> dict[str, Any]:
    # An identity's inbox is named after it (its creds file's JWT says which), a password
    # user's after the user: the server lets each read its own only.
    user = identity_of_creds(Path(auth.creds).read_text()) if auth.creds else auth.user
    try:
        prefix = auth.inbox_prefix or inbox_prefix(user)
    except InvalidId as exc:
        raise ConfigError(f"{exc}; set NATS_INBOX_PREFIX for this user") from None
    options: dict[str, Any] = {"inbox_prefix": prefix}
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


# A JetStream that does not answer at all: a stream's leader being elected, a node still
# catching up after a restart (JetStream answers "unavailable" or not at all for seconds).
_JETSTREAM_SILENT: Final = (
    nats.errors.TimeoutError,
    nats.errors.NoRespondersError,
    NoStreamResponseError,  # a write to a stream without a leader
    ServiceUnavailableError,
)


async def answered(call: Callable[[], Awaitable[T]], what: str) -> T:
    """``call()``, asked again while JetStream does not answer it (`_JETSTREAM_SILENT`). A
    service waits so at start, as it waits for NATS, until it is stopped: leaving would need a
    supervisor to start it again, and a fleet's elections last seconds. A one-shot command (no
    stop event) asks once. ``call`` must be safe to repeat (a write whose answer was lost is
    found stored the next time)."""
    stop = current_stop()
    attempt = 0
    while True:
        try:
            return await call()
        except _JETSTREAM_SILENT as exc:
            if stop is None:
                raise
            attempt += 1
            retry_in_s = _retry_in_s(attempt)
            log.warning(
                "JetStream does not answer; asking again",
                what=what,
                error=repr(exc),
                attempt=attempt,
                retry_in_s=retry_in_s,
            )
        with suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), retry_in_s)
        if stop.is_set():
            raise StopRequested(f"stopped before JetStream answered ({what})")


class Startable(Protocol):
    async def start(self) -> None: ...

    async def stop(self) -> None: ...


S = TypeVar("S", bound=Startable)


async def started(make: Callable[[], S], what: str) -> S:
    """A service made by ``make()`` and started. A start that fails is stopped; while one
    fails for JetStream not answering, a fresh service is made and started again (`answered`),
    so that no step of a start fails a service for a supervisor to restart."""

    async def once() -> S:
        service = make()
        try:
            await service.start()
        except BaseException:
            await service.stop()  # bounded, never raising
            raise
        return service

    return await answered(once, what)


async def _stream_info(js: JetStreamContext, name: str) -> StreamInfo:
    """The stream's info (`answered`)."""
    return await answered(lambda: js.stream_info(name), f"stream {name}")


async def _add_or_update(
    js: JetStreamContext, config: StreamConfig, owned: tuple[str, ...] = _OWNED
) -> None:
    """Create the stream if it is missing, bring the ``owned`` settings in line if they differ."""
    assert config.name is not None
    try:
        info = await _stream_info(js, config.name)
    except NotFoundError:
        try:
            await js.add_stream(config)
            return
        except BadRequestError:
            await js.update_stream(config)  # made meanwhile by another service
            return
        except nats.errors.TimeoutError as exc:
            # Unanswered: JetStream went silent meanwhile, or this user may not create streams
            # (a refused request gets no answer). Asked again once JetStream answers: a stream
            # still missing was refused; one there was made meanwhile.
            try:
                info = await _stream_info(js, config.name)
            except NotFoundError:
                raise Unavailable(
                    f"stream {config.name} does not exist and could not be created (this NATS "
                    "user may not create streams?): run `coordinator setup` with the operator "
                    "user"
                ) from exc
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
            "run `coordinator setup` with the operator user",
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


async def bucket_keys(js: JetStreamContext, bucket: str) -> list[str]:
    """The keys a KV bucket holds a value or a delete marker for, sorted, as its stream's
    leader lists them (``subjects_filter``). Not nats.py's ``KeyValue.keys()``: its watch may
    mark the end of the initial values before counting those already delivered, and then
    says the bucket is empty (seen: ``coordinator keys list`` right after two adds). A key
    whose last entry is a delete marker is listed: reading it raises ``KeyDeletedError``."""
    prefix = f"$KV.{bucket}."
    info = await js.stream_info(f"KV_{bucket}", subjects_filter=f"{prefix}>")
    return sorted(subject.removeprefix(prefix) for subject in info.state.subjects or {})


async def ensure_bucket(js: JetStreamContext, bucket: str, *, ttl_s: float | None) -> KeyValue:
    """Create the KV bucket, or update its TTL when it exists with another one."""
    config = KeyValueConfig(bucket=bucket, history=1, ttl=ttl_s, storage=StorageType.FILE)
    try:
        info = await _stream_info(js, f"KV_{bucket}")
    except NotFoundError:
        try:
            return await js.create_key_value(config)
        except BadRequestError:
            info = await js.stream_info(f"KV_{bucket}")  # made meanwhile by another service
        except nats.errors.TimeoutError as exc:
            raise Unavailable(
                f"bucket {bucket} does not exist and could not be created (this NATS user may "
                "not create streams?): run `coordinator setup` with the operator user"
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
                "run `coordinator setup` with the operator user",
                bucket=bucket,
                ttl_s=ttl_s,
                bucket_ttl_s=info.config.max_age,
            )
    return await js.key_value(bucket)


async def flush_written(nc: Client, timeout_s: float = 2.0) -> None:
    """Return once the server has processed everything this connection wrote so far (its
    subscriptions are in place for every other connection, its publishes delivered).

    nats.py's ``flush()`` writes its PING straight to the socket, ahead of the commands still
    queued for its flusher task, so the PONG can come back before a subscription made just
    before it reaches the server (another connection's request then gets "no responders"). By
    the time that first PONG is read the flusher has written the queue, so a second PING,
    written after it, is answered only once the queue has been processed."""
    await nc.flush(timeout=int(timeout_s) or 1)
    await nc.flush(timeout=int(timeout_s) or 1)


def fences_by_subject(nc: Client) -> bool:
    """Does the server take ``Nats-Expected-Last-Subject-Sequence-Subject`` (nats-server 2.11
    and newer)? An older one ignores that header and would compare the wrong subject."""
    version = nc.connected_server_version
    return (version.major, version.minor) >= (2, 11)


def is_wrong_last_sequence(exc: BaseException) -> bool:
    """Was a publish refused because its expected last sequence was not the stream's (or, on
    a replicated stream, because another write on the fenced subject was being proposed)?"""
    return isinstance(exc, APIError) and exc.err_code in WRONG_LAST_SEQUENCE


_LAST_SEQUENCE_SAID: Final = re.compile(r"wrong last sequence: (\d+)")


def last_sequence_said(exc: BaseException) -> int | None:
    """The last sequence a refused fence found on its subject, as the stream's leader says it
    in the refusal (``wrong last sequence: 12``); None when the error does not say."""
    if not is_wrong_last_sequence(exc):
        return None
    found = _LAST_SEQUENCE_SAID.search(str(getattr(exc, "description", "") or ""))
    return int(found.group(1)) if found else None


async def publish_event(
    js: JetStreamContext,
    event: AnyEvent,
    *,
    msg_id: str | None = None,
    headers: dict[str, str] | None = None,
    expect_last: tuple[str, int] | None = None,
    by: str | None = None,
) -> Any:
    """Store one event; returns the stream's acknowledgement (raises if it was not stored).

    ``by``: the worker recording a task's failure, on its own subject (`subject_for`).

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
    return await js.publish(
        subject_for(event, by), encoder.encode(event), headers=all_headers or None
    )
