"""Client side of the CLI: finding the stack, connecting to it, and routing a task that the
command waits for.

Calling the endpoints (`call`, `stream_call`: an error reply raised as its code's class) is
`services.runtime.request`.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import msgspec
from nats.aio.client import Client

from schemas.route import RouteReply, RouteRequest
from schemas.subjects import ROUTE
from services.cli import stackfile
from services.errors import CoordinatorError, Unavailable
from services.runtime.bus import connect
from services.runtime.logging import setup_logging
from services.runtime.request import REASK_AFTER_S, UNSERVED_FOR_S, new_task_id, stream_call

_reply_decoder = msgspec.json.Decoder(RouteReply)


def coordinator_home() -> Path:
    return Path(os.environ.get("COORDINATOR_HOME") or Path.home() / ".coordinator")


def stack_file() -> Path:
    return coordinator_home() / stackfile.STACK_FILE


def find_nats_url() -> str:
    """``NATS_URL``; else the stack ``coordinator up`` recorded; else the default URL.

    A recorded stack whose ``coordinator up`` is gone (killed, so it left its file behind) is
    an `Unavailable` that says so, rather than a wait on addresses nothing serves."""
    if os.environ.get("NATS_URL"):
        return os.environ["NATS_URL"]
    path = stack_file()
    record = stackfile.read(path)
    if record is None:
        return "nats://127.0.0.1:4222"
    if not stackfile.is_running(record.pid, record.started):
        raise Unavailable(stackfile.stale_message(path, record))
    return record.nats_url


def find_pg_dsn(nats_url: str) -> str | None:
    """``PG_DSN``; else the PostgreSQL of the stack ``coordinator up`` recorded, when
    ``nats_url`` is that stack's NATS too (a PostgreSQL beside another NATS would be checked
    against the wrong event log); else None."""
    if os.environ.get("PG_DSN"):
        return os.environ["PG_DSN"]
    record = stackfile.read(stack_file())
    if record is None or record.nats_url != nats_url or not record.pg_dsn:
        return None
    if not stackfile.is_running(record.pid, record.started):
        return None
    return record.pg_dsn


async def open_client() -> Client:
    return await connect(find_nats_url(), "coordinator-cli", connect_timeout_s=3.0)


def say_asking_again(exc: CoordinatorError, within_s: float) -> None:
    """What a command says on stderr when nobody can serve its request just now and it asks
    again (`services.runtime.request`'s ``on_unserved``): once, before it waits."""
    print(f"asking again for up to {within_s:g} s: {exc.code}: {exc.message}", file=sys.stderr)


def route_and_wait(request: RouteRequest, timeout_s: float, *, quiet: bool) -> bytes:
    """Route ``request`` (it waits), printing a stream's pieces as they arrive (thinking to
    stderr) unless ``quiet``; returns the final reply's body.

    The request names its task, and is asked again with that id when the router says nothing
    for `REASK_AFTER_S`: a router that died while the task ran takes its answer with it, and
    another (or the same one, restarted) answers the task from the event log. So it is, every
    moment, while no router can take it (none started yet, a JetStream leader being chosen)
    for up to `UNSERVED_FOR_S`: a router answers a request naming a task it already holds as
    that task, so nothing runs twice.
    """
    if request.task_id is None:
        request = msgspec.structs.replace(request, task_id=new_task_id())
    body = msgspec.json.encode(request)

    async def go() -> bytes:
        nc = await open_client()
        final = b""
        printed = ""
        try:
            async for item in stream_call(
                nc,
                ROUTE,
                body,
                timeout_s,
                reask_s=REASK_AFTER_S,
                unserved_s=UNSERVED_FOR_S,
                on_unserved=say_asking_again,
            ):
                if isinstance(item, bytes):
                    final = item
                elif not quiet:
                    if item.thinking:
                        print(item.thinking, end="", file=sys.stderr, flush=True)
                    if item.response:
                        print(item.response, end="", flush=True)
                        printed += item.response
        finally:
            await nc.close()
        if request.stream and not quiet:
            # Pieces lost with a router that died are in the final reply: print the rest.
            response = _reply_decoder.decode(final).response or ""
            if response.startswith(printed):
                print(response[len(printed) :], end="")
            print()
        return final

    setup_logging("error", "console", stream=sys.stderr)
    return asyncio.run(go())
