"""Calling a service over NATS: request/reply and streamed replies, error replies raised.

Any process that calls a service endpoint uses this (the CLI, the bench job, tests,
benchmarks): the trace context goes along, an error reply is raised as the catalogued class
of its code (`services.runtime.errors.from_code`: ``no_worker`` is `NoWorker`, a code nobody
catalogued a `RemoteError` that keeps it), and the bus's own failures are mapped to the
project's errors here, by nats.py's classes: nobody answering (or in time) is `NoResponder`,
a request over the server's ``max_payload`` `TooLarge`, a closed or reconnecting connection
`Unavailable`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager

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
    nc: Client, subject: str, body: bytes, timeout_s: float
) -> AsyncIterator[StreamChunk | bytes]:
    """A request whose answer comes as chunks, then one final reply (yielded as bytes).

    The reply subject is subscribed before the request goes out, so no chunk can be missed;
    ``timeout_s`` bounds each wait for the next message.
    """
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    try:
        with _bus_errors(subject):
            await nc.publish(subject, body, reply=inbox, headers=inject_context({}) or None)
        while True:
            with _bus_errors(subject):
                try:
                    msg = await sub.next_msg(timeout=timeout_s)
                except nats.errors.TimeoutError as exc:
                    raise NoResponder(f"{subject}: nothing arrived for {timeout_s:g} s") from exc
            headers = msg.headers or {}
            if headers.get("Status") == "503":
                raise NoResponder(f"no service answers {subject}: is the stack running?")
            if CHUNK_HEADER in headers:
                yield _chunk_decoder.decode(msg.data)
                continue
            raise_if_error(msg.data, headers)
            yield msg.data
            return
    finally:
        await sub.unsubscribe()
