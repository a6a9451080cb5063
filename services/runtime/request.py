"""Calling a service over NATS: request/reply and streamed replies, error replies raised.

Any process that calls a service endpoint uses this (the CLI, the bench job, tests,
benchmarks): the trace context goes along, an error reply is raised as the catalogued class
of its code (`services.runtime.errors.from_code`: ``no_worker`` is `NoWorker`, a code nobody
catalogued a `RemoteError` that keeps it), and the bus's own failures are mapped to the
project's errors here, by nats.py's classes: nobody answering (or in time) is `NoResponder`,
a request over the server's ``max_payload`` `TooLarge`, a closed or reconnecting connection
`Unavailable`.

A route request that waits names its task (`new_task_id`) and is asked again, with the same
id, when the router goes silent for too long (`stream_call`'s ``reask_s``): a router answers
such a request as the task it names, so a client whose router died while it waited (or whose
connection dropped the answer) still gets the outcome.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager, suppress

import msgspec
import nats.errors
from nats.aio.client import Client

from schemas.route import CHUNK_HEADER, ErrorBody, StreamChunk
from services.runtime.errors import NoResponder, TooLarge, Unavailable, from_code
from services.runtime.tracing import inject_context

# The errors of the connection itself: the call may work again once it has reconnected.
_CONNECTION_ERRORS = (
    nats.errors.ConnectionClosedError,
    nats.errors.ConnectionDrainingError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.OutboundBufferLimitError,
    nats.errors.StaleConnectionError,
)

_error_decoder = msgspec.json.Decoder(ErrorBody)
_chunk_decoder = msgspec.json.Decoder(StreamChunk)

# A route request waiting on a router that says nothing for this long is asked again by its
# task id: a router that died takes its answer with it, and a live one stays silent until the
# end of a task that streams nothing.
REASK_AFTER_S = 10.0


def new_task_id() -> str:
    """Time-ordered, unique and safe as a subject token: the router's ids, and the ids a
    client chooses for its own route requests (`schemas.route.RouteRequest.task_id`)."""
    return f"{time.time_ns():x}-{uuid.uuid4().hex[:12]}"


@contextmanager
def _bus_errors(subject: str) -> Iterator[None]:
    """nats.py's failures to send, as the project's errors (a timeout is the caller's to say)."""
    try:
        yield
    except nats.errors.NoRespondersError as exc:
        raise NoResponder(f"no service answers {subject}: is the stack running?") from exc
    except nats.errors.MaxPayloadError as exc:
        raise TooLarge(f"the request to {subject} is over the NATS server's max_payload") from exc
    except _CONNECTION_ERRORS as exc:
        raise Unavailable(f"{subject}: the NATS connection failed: {exc}") from exc


async def call(nc: Client, subject: str, body: bytes, timeout_s: float) -> bytes:
    """Request/reply; an error reply raises the catalogued class of its code.

    The current trace context goes along (``traceparent``), so the service continues it.
    """
    with _bus_errors(subject):
        try:
            reply = await nc.request(
                subject, body, timeout=timeout_s, headers=inject_context({}) or None
            )
        except nats.errors.TimeoutError as exc:
            raise NoResponder(f"{subject} did not answer within {timeout_s:g} s") from exc
    raise_if_error(reply.data, reply.headers or {})
    return reply.data


def raise_if_error(data: bytes, headers: dict[str, str]) -> None:
    """Raise the error a reply is (``Nats-Service-Error-Code``), as its code's class."""
    code = headers.get("Nats-Service-Error-Code")
    if code is None:
        return
    try:
        detail = _error_decoder.decode(data).error
    except msgspec.DecodeError:
        raise from_code(code, headers.get("Nats-Service-Error", "")) from None
    raise from_code(detail.code, detail.message)


async def stream_call(
    nc: Client, subject: str, body: bytes, timeout_s: float, *, reask_s: float | None = None
) -> AsyncIterator[StreamChunk | bytes]:
    """A request whose answer comes as chunks, then one final reply (yielded as bytes).

    The reply subject is subscribed before the request goes out, so no chunk can be missed;
    ``timeout_s`` bounds the silence before the answer's end. With ``reask_s`` (a request
    that can be asked again, such as a route request naming its task), a silence that long
    sends the request again to the same reply subject, and a bus with nobody to answer at
    that moment (a router restarting) is waited out rather than an error.
    """
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    headers = inject_context({}) or None
    try:
        with _bus_errors(subject):
            await nc.publish(subject, body, reply=inbox, headers=headers)
        asked_again = False
        heard = time.monotonic()
        while True:
            left = timeout_s - (time.monotonic() - heard)
            wait = left if reask_s is None else min(left, reask_s)
            try:
                with _bus_errors(subject):
                    msg = await sub.next_msg(timeout=max(wait, 0.001))
            except (nats.errors.TimeoutError, Unavailable) as exc:
                if reask_s is None or time.monotonic() - heard >= timeout_s:
                    if isinstance(exc, Unavailable):
                        raise
                    raise NoResponder(f"{subject}: nothing arrived for {timeout_s:g} s") from exc
                if isinstance(exc, Unavailable):
                    await asyncio.sleep(min(reask_s, 1.0))  # reconnecting: ask once it is back
                asked_again = True
                with suppress(Unavailable, NoResponder), _bus_errors(subject):
                    await nc.publish(subject, body, reply=inbox, headers=headers)
                continue
            msg_headers = msg.headers or {}
            if msg_headers.get("Status") == "503":
                if not asked_again:
                    raise NoResponder(f"no service answers {subject}: is the stack running?")
                continue  # nobody there to ask again just now: the next silence asks again
            heard = time.monotonic()
            if CHUNK_HEADER in msg_headers:
                yield _chunk_decoder.decode(msg.data)
                continue
            raise_if_error(msg.data, msg_headers)
            yield msg.data
            return
    finally:
        with suppress(Exception):
            await sub.unsubscribe()
