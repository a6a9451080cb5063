"""Client side of the CLI: finding the stack and calling its endpoints."""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import msgspec
from nats.aio.client import Client

from schemas.route import CHUNK_HEADER, ErrorBody, StreamChunk
from services.runtime.bus import connect
from services.runtime.errors import CoordinatorError
from services.runtime.tracing import inject_context

STACK_FILE = "stack.json"

_error_decoder = msgspec.json.Decoder(ErrorBody)


def coordinator_home() -> Path:
    return Path(os.environ.get("COORDINATOR_HOME") or Path.home() / ".coordinator")


def stack_file() -> Path:
    return coordinator_home() / STACK_FILE


def find_nats_url() -> str:
    """``NATS_URL``; else the stack ``coordinator up`` recorded; else the default URL."""
    if os.environ.get("NATS_URL"):
        return os.environ["NATS_URL"]
    path = stack_file()
    if path.exists():
        try:
            return str(json.loads(path.read_text())["nats_url"])
        except (ValueError, KeyError):
            pass
    return "nats://127.0.0.1:4222"


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


async def open_client() -> Client:
    return await connect(find_nats_url(), "coordinator-cli", connect_timeout_s=3.0)


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
