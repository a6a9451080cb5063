"""Service units: a systemd unit or a launchd agent for one role, from deploy/'s templates,
reading its settings from one ``KEY=value`` env file."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from services.cli.roles import DEPLOY_DIR, PER_WORKER, SERVICE_ROLES
from services.errors import ConfigError


def read_env_file(path: Path) -> dict[str, str]:
    """``KEY=value`` lines (systemd's EnvironmentFile and a shell's ``set -a; .`` both read
    them); ``#`` comments and blank lines are skipped, one level of quotes removed."""
    values: dict[str, str] = {}
    for line in path.read_text().splitlines():
        text = line.strip()
        if not text or text.startswith("#") or "=" not in text:
            continue
        key, _, value = text.removeprefix("export ").partition("=")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
            value = value[1:-1]
        values[key.strip()] = value
    return values


def _fill(template: str, values: Mapping[str, str]) -> str:
    for key, value in values.items():
        template = template.replace(f"@{key}@", value)
    left = re.findall(r"@[A-Z_]+@", template)
    if left:
        raise ConfigError(f"template placeholders left unfilled: {', '.join(sorted(set(left)))}")
    return template


def render_systemd(role: str, env_file: Path, *, coordinator: str, user: str) -> str:
    """The unit for ``role``: ``coordinator-<role>.service``, or for a worker role the template
    ``coordinator-<role>@.service`` whose instance name is the WORKER_ID."""
    command = SERVICE_ROLES[role]
    name = "coordinator-role@.service.in" if role in PER_WORKER else "coordinator-role.service.in"
    return _fill(
        (DEPLOY_DIR / "systemd" / name).read_text(),
        {
            "ROLE": role,
            "ENV_FILE": str(env_file),
            "COORDINATOR": coordinator,
            "COMMAND": " ".join(command),
            "USER": user,
        },
    )


def systemd_unit_name(role: str, worker_id: str | None = None) -> str:
    if role in PER_WORKER:
        return f"coordinator-{role}@{worker_id or ''}.service"
    return f"coordinator-{role}.service"


def render_launchd(
    role: str, env_file: Path, *, coordinator: str, worker_id: str | None, log_dir: Path
) -> str:
    """A LaunchAgent for macOS: the env file is read at each start (``launchctl kickstart -k``
    after editing it), so it stays the one place the settings live."""
    command = SERVICE_ROLES[role]
    label = launchd_label(role, worker_id)
    # The label's worker id wins over one in the env file, as a systemd instance name does.
    script = 'set -a; . "$0"; ' + ('WORKER_ID="$2"; ' if role in PER_WORKER else "")
    parts = ["/bin/sh", "-c", f'{script}exec "$1" {" ".join(command)}', str(env_file), coordinator]
    if role in PER_WORKER:
        parts.append(worker_id or "")
    arguments = "\n".join(f"    <string>{_xml(part)}</string>" for part in parts)
    return _fill(
        (DEPLOY_DIR / "launchd" / "coordinator.plist.in").read_text(),
        {"LABEL": label, "ARGUMENTS": arguments, "LOG": _xml(str(log_dir / f"{label}.log"))},
    )


def launchd_label(role: str, worker_id: str | None) -> str:
    return f"org.coordinator.{role}" + (f".{worker_id}" if role in PER_WORKER else "")


@dataclass(frozen=True)
class LaunchdAgent:
    """Where a person's LaunchAgent for a role goes, its log, and the ``launchctl`` arguments
    that load (``bootstrap``) and unload (``bootout``) it in that person's GUI domain."""

    label: str
    path: Path
    log_dir: Path
    bootstrap: tuple[str, ...]
    bootout: tuple[str, ...]


def launchd_agent(role: str, worker_id: str | None, *, uid: int, home: Path) -> LaunchdAgent:
    label = launchd_label(role, worker_id)
    path = home / "Library" / "LaunchAgents" / f"{label}.plist"
    domain = f"gui/{uid}"
    return LaunchdAgent(
        label=label,
        path=path,
        log_dir=home / "Library" / "Logs",
        bootstrap=("bootstrap", domain, str(path)),
        bootout=("bootout", f"{domain}/{label}"),
    )


def _xml(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
