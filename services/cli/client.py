"""Client side of the CLI: finding the stack and calling its endpoints."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import msgspec
from nats.aio.client import Client

from schemas.route import ErrorBody
from services.runtime.bus import connect
from services.runtime.errors import CoordinatorError

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
    """Request/reply; an error reply raises `RemoteError` with its code."""
    try:
        reply = await nc.request(subject, body, timeout=timeout_s)
    except Exception as exc:
        name = type(exc).__name__
        if "NoResponders" in name:
            raise NoResponder(f"no service answers {subject}: is the stack running?") from exc
        if "Timeout" in name:
            raise NoResponder(f"{subject} did not answer within {timeout_s:g} s") from exc
        raise
    headers = reply.headers or {}
    if "Nats-Service-Error-Code" in headers:
        try:
            detail = _error_decoder.decode(reply.data).error
            raise RemoteError(detail.code, detail.message)
        except msgspec.DecodeError:
            raise RemoteError(
                headers["Nats-Service-Error-Code"], headers.get("Nats-Service-Error", "")
            ) from None
    return reply.data


async def open_client() -> Client:
    return await connect(find_nats_url(), "coordinator-cli", connect_timeout_s=3.0)
