"""Client side of the CLI: finding the stack and connecting to it.

Calling the endpoints (`call`, `stream_call`: an error reply raised as its code's class) is
`services.runtime.request`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from nats.aio.client import Client

from services.runtime.bus import connect

STACK_FILE = "stack.json"


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


async def open_client() -> Client:
    return await connect(find_nats_url(), "coordinator-cli", connect_timeout_s=3.0)
