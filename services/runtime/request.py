"""Calling a service over NATS: request/reply and streamed replies, error replies raised.

Any process that calls a service endpoint uses this (the CLI, the bench job, tests,
benchmarks): the trace context goes along, an error reply becomes `RemoteError` with the
service's code, and nobody answering becomes `NoResponder`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import msgspec
from nats.aio.client import Client

from schemas.route import CHUNK_HEADER, ErrorBody, StreamChunk
from services.runtime.errors import CoordinatorError
from services.runtime.tracing import inject_context

_error_decoder = msgspec.json.Decoder(ErrorBody)


@dataclass
class RemoteError(Exception):
    """An error reply from a service."""

    code: str
    message: str


class NoResponder(CoordinatorError):
    code = "no_responder"


async def call(nc: Client, subject: str, body: bytes, timeout_s: float) -> bytes:
    """Request/reply; an error reply raises `RemoteError` with its code.

    The current trace context goes along (``traceparent``), so the service continues it.
    """
    try:
        reply = await nc.request(
            subject, body, timeout=timeout_s, headers=inject_context({}) or None
        )
    except Exception as exc:
        name = type(exc).__name__
        if "NoResponders" in name:
            raise NoResponder(f"no service answers {subject}: is the stack running?") from exc
        if "Timeout" in name:
            raise NoResponder(f"{subject} did not answer within {timeout_s:g} s") from exc
        raise
    _raise_if_error(reply.data, reply.headers or {})
    return reply.data


def _raise_if_error(data: bytes, headers: dict[str, str]) -> None:
    if "Nats-Service-Error-Code" not in headers:
        return
    try:
        detail = _error_decoder.decode(data).error
    except msgspec.DecodeError:
        code = headers["Nats-Service-Error-Code"]
        raise RemoteError(code, headers.get("Nats-Service-Error", "")) from None
    raise RemoteError(detail.code, detail.message)


_chunk_decoder = msgspec.json.Decoder(StreamChunk)


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
        await nc.publish(subject, body, reply=inbox, headers=inject_context({}) or None)
        while True:
            try:
                msg = await sub.next_msg(timeout=timeout_s)
            except Exception as exc:
                if "Timeout" in type(exc).__name__:
                    raise NoResponder(f"{subject}: nothing arrived for {timeout_s:g} s") from exc
                raise
            headers = msg.headers or {}
            if headers.get("Status") == "503":
                raise NoResponder(f"no service answers {subject}: is the stack running?")
            if CHUNK_HEADER in headers:
                yield _chunk_decoder.decode(msg.data)
                continue
            _raise_if_error(msg.data, headers)
            yield msg.data
            return
    finally:
        await sub.unsubscribe()
