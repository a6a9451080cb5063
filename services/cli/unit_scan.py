"""Which worker each systemd unit starts, read from the unit files (file parsing only: no
systemctl), so ``coordinator doctor`` can name units that start the same worker (the
two-units incident behind lesson 2)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

from services.runtime.settings import default_worker_id

_WORKER_COMMAND = re.compile(r"\bcoordinator\b.*\s(worker|web-search)\b|\bworker\.py\b")


def unit_worker_ids(
    units: Iterable[tuple[str, Path]], default_id: str | None = None
) -> dict[str, list[str]]:
    """Which worker each unit starts, for ``(unit name, file to read)`` pairs: its
    ``WORKER_ID`` from ``Environment=``, an ``EnvironmentFile=`` or the command line, with a
    template's ``%i`` read as the instance name; a unit that runs a worker with no id starts the
    host's default one. Returns worker id -> unit names."""
    default = default_id or default_worker_id()
    found: dict[str, set[str]] = {}
    for name, path in units:
        unit = _read_unit(path)
        if unit is None:
            continue
        exec_start = " ".join(unit.get("ExecStart", []))
        if not _WORKER_COMMAND.search(exec_start):
            continue
        instance = name.split("@", 1)[1].rsplit(".", 1)[0] if "@" in name else ""
        if "@" in name and not instance:
            continue  # a template: its instances are what run
        worker_id: str | None = None
        for line in unit.get("Environment", []):
            for item in _split_words(line):
                key, _, value = item.partition("=")
                if key == "WORKER_ID":
                    worker_id = value
        for env_file in unit.get("EnvironmentFile", []):
            worker_id = (
                _worker_id_in(Path(env_file.lstrip("-").replace("%i", instance))) or worker_id
            )
        match = re.search(r"WORKER_ID=(\S+)", exec_start)
        if match:
            worker_id = match.group(1)
        worker_id = (worker_id or default).replace("%i", instance).replace("%I", instance)
        found.setdefault(worker_id, set()).add(name)
    return {worker: sorted(names) for worker, names in found.items()}


def scan_unit_dirs(
    dirs: Iterable[str | Path], default_id: str | None = None
) -> dict[str, list[str]]:
    """`unit_worker_ids` over the unit files in ``dirs`` and their ``*.wants`` folders, where
    an enabled template instance (``coordinator-worker@cpu1.service``) is a link whose file is
    the template."""
    units: dict[str, Path] = {}
    for folder in dirs:
        base = Path(folder).expanduser()
        if not base.is_dir():
            continue
        for path in sorted([*base.glob("*.service"), *base.glob("*.wants/*.service")]):
            if path.name not in units and path.exists():
                units[path.name] = path
    return unit_worker_ids(units.items(), default_id)


def _read_unit(path: Path) -> dict[str, list[str]] | None:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return None
    values: dict[str, list[str]] = {}
    for raw in text.replace("\\\n", " ").splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";", "[")) or "=" not in line:
            continue
        key, _, value = line.partition("=")
        values.setdefault(key.strip(), []).append(value.strip())
    return values


def _split_words(line: str) -> list[str]:
    return [w.strip('"') for w in re.findall(r'"[^"]*"|\S+', line)]


def _worker_id_in(path: Path) -> str | None:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return None
    for raw in text.splitlines():
        key, _, value = raw.strip().removeprefix("export ").partition("=")
        if key.strip() == "WORKER_ID":
            return value.strip().strip("\"'") or None
    return None
