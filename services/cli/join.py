"""``coordinator join TOKEN``: this machine (or person) joins the fleet in one command.

The token (`coordinator invite`) carries the fleet's servers, its CA when TLS is on, and an
identity for this machine only. ``join`` writes them into one directory (0700; files 0600),
checks that the fleet answers that identity and, for a worker, that its model server answers,
then installs and starts the role's service: a systemd unit where systemd runs and it may
(root), on macOS a LaunchAgent in the person's own launchd domain; otherwise it prints the
unit (or the agent) and how to start it.
"""

from __future__ import annotations

import argparse
import asyncio
import getpass
import os
import pwd
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import httpx
import nats.errors

from schemas.subjects import TASKS_STREAM
from services.cli.identities import write_private
from services.cli.roles import PER_WORKER, SERVICE_ROLES
from services.cli.units import (
    launchd_agent,
    render_launchd,
    render_systemd,
    systemd_unit_name,
)
from services.errors import ConfigError, Unavailable
from services.fleet.identity import WITH_WORKER_ID, JoinToken, decode_token
from services.runtime.bus import connect
from services.runtime.settings import NatsAuth

# Roles whose identity may look at the TASKS stream: join checks JetStream answers them.
_SEES_TASKS: Final = frozenset({"worker", "web-search", "router", "stats", "reaper", "operator"})
SYSTEMD_UNITS: Final = Path("/etc/systemd/system")
DEFAULT_BACKEND: Final = "http://127.0.0.1:11434"


@dataclass(frozen=True)
class Written:
    """What ``join`` wrote: the settings file the service reads, and the creds it names."""

    env_file: Path
    creds: Path
    ca: Path | None


def default_dir(role: str) -> Path:
    """A service's settings in /etc/coordinator as root (its unit reads them there); a
    person's in their home."""
    if os.geteuid() == 0 and role in SERVICE_ROLES:
        return Path("/etc/coordinator")
    return Path("~/.config/coordinator").expanduser()


def env_lines(token: JoinToken, written: Written, backend: str) -> list[str]:
    """The role's settings (``KEY=value``): the fleet, the identity, and a worker's backend.
    No WORKER_ID: a unit's instance name sets it (deploy/systemd)."""
    lines = [f"NATS_URL={','.join(token.servers)}", f"NATS_CREDS={written.creds}"]
    if written.ca is not None:
        lines.append(f"NATS_TLS_CA={written.ca}")
    if token.role in WITH_WORKER_ID:
        lines.append(f"OLLAMA_HOST={backend}")
    if token.role == "worker":
        lines.append(f"WORKER_SUPPORTS={'gpu_inference' if token.gpu else 'cpu_inference'}")
    return lines


def write_config(token: JoinToken, directory: Path, backend: str, owner: str | None) -> Written:
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    creds = directory / f"{token.identity}.creds"
    ca = directory / f"{token.identity}-ca.pem" if token.ca else None
    written = Written(env_file=directory / f"{token.identity}.env", creds=creds, ca=ca)
    write_private(creds, token.creds.encode())
    if ca is not None and token.ca is not None:
        write_private(ca, token.ca.encode())
    header = f"# {token.identity} ({token.role}), written by `coordinator join`\n"
    settings = header + "\n".join(env_lines(token, written, backend)) + "\n"
    write_private(written.env_file, settings.encode())
    if owner is not None and os.geteuid() == 0:
        # The service's account reads them; nobody else.
        entry = pwd.getpwnam(owner)
        for path in (directory, creds, written.env_file, *([ca] if ca else [])):
            os.chown(path, entry.pw_uid, entry.pw_gid)
    return written


async def check_fleet(token: JoinToken, written: Written) -> None:
    """The fleet's NATS takes this identity (and, for a role that uses it, JetStream answers)."""
    auth = NatsAuth(creds=str(written.creds), tls_ca=str(written.ca) if written.ca else None)
    url = ",".join(token.servers)
    try:
        nc = await connect(url, f"coordinator-join-{token.identity}", auth=auth)
    except Unavailable as exc:
        raise Unavailable(f"the fleet's NATS does not take {token.identity}: {exc}") from None
    try:
        await nc.flush(timeout=5)
        if token.role in _SEES_TASKS:
            await nc.jetstream().stream_info(TASKS_STREAM)
    except (nats.errors.Error, TimeoutError) as exc:
        raise Unavailable(
            f"{url} took {token.identity} but JetStream did not answer it ({exc!r}): has "
            "`coordinator setup` run?"
        ) from None
    finally:
        await nc.close()


async def check_backend(backend: str) -> None:
    """The worker's model server answers (Ollama's ``/api/version``)."""
    try:
        async with httpx.AsyncClient(timeout=5) as client:
            reply = await client.get(f"{backend.rstrip('/')}/api/version")
            reply.raise_for_status()
    except httpx.HTTPError as exc:
        raise Unavailable(
            f"the model server at {backend} does not answer ({exc!r}): start Ollama, or give "
            "its address with --backend"
        ) from None


def install(token: JoinToken, written: Written, *, user: str, coordinator: str, start: bool) -> str:
    """Install and start the role's unit where systemd runs and this process may (on macOS,
    its LaunchAgent); else say what to do. Returns what to tell the person."""
    role = token.role
    if role not in SERVICE_ROLES:
        return (
            f"{token.identity} is ready: `set -a; . {written.env_file}; set +a`, then "
            "`coordinator workers` (or any command) speaks as it."
        )
    if sys.platform == "darwin":
        return _install_launchd(token, written, coordinator=coordinator, start=start)
    worker_id = token.name if role in PER_WORKER else None
    unit_name = systemd_unit_name(role, worker_id)
    unit = render_systemd(role, written.env_file, coordinator=coordinator, user=user)
    template = unit_name.split("@")[0] + "@.service" if worker_id else unit_name
    can = Path("/run/systemd/system").is_dir() and shutil.which("systemctl") is not None
    if not start or not can or os.geteuid() != 0:
        why = "as asked" if not start else "systemd is not running here, or this is not root"
        return (
            f"{unit}\nNot installed ({why}). Save the unit above as {SYSTEMD_UNITS / template}, "
            f"then `systemctl daemon-reload && systemctl enable --now {unit_name}`; or run it "
            f"by hand: `set -a; . {written.env_file}; set +a; "
            f"{'WORKER_ID=' + token.name + ' ' if worker_id else ''}coordinator "
            f"{' '.join(SERVICE_ROLES[role])}`."
        )
    (SYSTEMD_UNITS / template).write_text(unit)
    for command in (["daemon-reload"], ["enable", "--now", unit_name]):
        done = subprocess.run(["systemctl", *command], capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise Unavailable(f"systemctl {' '.join(command)}: {done.stderr.strip()}")
    return f"{token.identity} joined: {unit_name} is enabled and started."


def _install_launchd(token: JoinToken, written: Written, *, coordinator: str, start: bool) -> str:
    """macOS: the role's LaunchAgent in the person's own launchd domain (a Mac's model server
    runs as its person), loaded and started; as root, or when asked not to, it is printed."""
    worker_id = token.name if token.role in PER_WORKER else None
    agent = launchd_agent(token.role, worker_id, uid=os.getuid(), home=Path.home())
    plist = render_launchd(
        token.role,
        written.env_file,
        coordinator=coordinator,
        worker_id=worker_id,
        log_dir=agent.log_dir,
    )
    if not start or os.geteuid() == 0 or shutil.which("launchctl") is None:
        why = "as asked" if not start else "a LaunchAgent is a person's: run join as yourself"
        return (
            f"{plist}\nNot installed ({why}). Save the agent above as {agent.path}, then "
            f"`launchctl {' '.join(agent.bootstrap)}`."
        )
    agent.path.parent.mkdir(parents=True, exist_ok=True)
    agent.log_dir.mkdir(parents=True, exist_ok=True)
    agent.path.write_text(plist)
    # An agent loaded before (this machine joining again) is unloaded first: launchd refuses
    # to bootstrap a label it has. Not loaded: launchctl says so, nothing to do.
    subprocess.run(["launchctl", *agent.bootout], capture_output=True, check=False)
    done = subprocess.run(
        ["launchctl", *agent.bootstrap], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise Unavailable(f"launchctl {' '.join(agent.bootstrap)}: {done.stderr.strip()}")
    return f"{token.identity} joined: {agent.label} is loaded and started ({agent.path})."


def register(sub: Any) -> None:
    join = sub.add_parser(
        "join",
        help="join the fleet with a token from `coordinator invite` (one command per machine)",
        description="Writes this identity's settings (0600), checks that the fleet and the "
        "model server answer, then installs and starts the service (systemd, as root) or "
        "prints the unit and how to start it.",
    )
    join.add_argument("token", help="the line `coordinator invite` printed")
    join.add_argument(
        "--dir",
        type=Path,
        default=None,
        help="where its settings go (default: a service's in /etc/coordinator as root, "
        "else ~/.config/coordinator)",
    )
    join.add_argument(
        "--backend",
        default=DEFAULT_BACKEND,
        help=f"a worker's model server (Ollama; default {DEFAULT_BACKEND})",
    )
    join.add_argument("--user", default=None, help="the account the service runs as")
    join.add_argument(
        "--no-start", action="store_true", help="write and check only; print the unit"
    )
    join.set_defaults(func=cmd_join)


def cmd_join(args: argparse.Namespace) -> int:
    from services.runtime.logging import setup_logging

    setup_logging("error", "console", stream=sys.stderr)  # its checks' connections: no chatter
    token = decode_token(args.token)
    user = args.user or getpass.getuser()
    try:
        pwd.getpwnam(user)
    except KeyError:
        raise ConfigError(f"--user {user}: no such account on this machine") from None
    written = write_config(token, args.dir or default_dir(token.role), args.backend, user)
    asyncio.run(check_fleet(token, written))
    if token.role in WITH_WORKER_ID:
        asyncio.run(check_backend(args.backend))
    coordinator = str(Path(sys.executable).parent / "coordinator")
    print(install(token, written, user=user, coordinator=coordinator, start=not args.no_start))
    return 0
