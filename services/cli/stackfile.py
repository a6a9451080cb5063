"""The stack file: what ``coordinator up`` records of the stack it runs, for other commands.

``$COORDINATOR_HOME/stack.json`` holds where the stack listens (NATS, PostgreSQL) and its
processes: ``coordinator up`` itself and the nats-server it started, each with the time the
system says it started, so that a process id used again by something else is not taken for
it. ``coordinator up`` removes the file when it stops. A file left by a stack that was killed
(``kill -9``, a power cut) names a process that is gone: commands say so (`stale_message`)
instead of timing out against its addresses, and the next ``coordinator up`` stops what it
left running and replaces the file.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Final

import msgspec

STACK_FILE: Final = "stack.json"
# A leftover process asked to stop (SIGTERM) is killed after this long.
LEFTOVER_STOP_S: Final = 10.0


class StackRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One running stack, as ``coordinator up`` wrote it."""

    nats_url: str
    pg_dsn: str = ""
    pid: int
    """``coordinator up``'s process."""
    started: str | None = None
    """When that process started, as `process_started` reads it (None where it cannot)."""
    nats_pid: int | None = None
    """The nats-server ``coordinator up`` started (None: NATS_URL named another)."""
    nats_started: str | None = None


_decoder = msgspec.json.Decoder(StackRecord)
_encoder = msgspec.json.Encoder()


def read(path: Path) -> StackRecord | None:
    """The record in ``path``; None when there is none, or it cannot be read as one."""
    try:
        return _decoder.decode(path.read_bytes())
    except (OSError, msgspec.DecodeError):
        return None


def write(path: Path, record: StackRecord) -> None:
    """Write ``record`` whole: to a temporary file first, then renamed over ``path``, so a
    reader never sees half of it."""
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    partial.write_bytes(_encoder.encode(record))
    partial.replace(path)


def stale_message(path: Path, record: StackRecord) -> str:
    """What a command says of a stack file whose ``coordinator up`` is gone."""
    return (
        f"the stack recorded in {path} is not running (pid {record.pid} gone); "
        "start it with `coordinator up` or remove the file"
    )


def process_started(pid: int) -> str | None:
    """When process ``pid`` started, as the system counts it (ticks since boot, from
    ``/proc``; else ``ps``'s start time); None when it cannot be told, or the process is
    gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        if Path("/proc/self/stat").exists():
            return None  # there is /proc, and no such process
    except OSError:
        return None
    else:
        # The command name (field 2) is in parentheses and may hold spaces: fields after it.
        fields = stat.rsplit(")", 1)[1].split()
        return f"boot+{fields[19]}"  # field 22, starttime
    try:
        shown = subprocess.run(
            ["ps", "-o", "lstart=", "-p", str(pid)],
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return shown.stdout.strip() or None


def is_running(pid: int, started: str | None) -> bool:
    """Whether process ``pid`` runs and is the one that started at ``started`` (None: any
    process with that id counts). A zombie (ended, not yet reaped) does not run."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: it exists
    if _is_zombie(pid):
        return False
    if started is None:
        return True
    now = process_started(pid)
    return now is None or now == started


def _is_zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def stop_leftover(pid: int, started: str | None) -> bool:
    """Stop a process a killed stack left running, if it is still the one recorded (only
    then: a process id is used again): SIGTERM, then SIGKILL after `LEFTOVER_STOP_S`.
    True when one was stopped."""
    if started is None or not is_running(pid, started):
        return False
    try:
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + LEFTOVER_STOP_S
        while is_running(pid, started):
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                deadline = time.monotonic() + LEFTOVER_STOP_S
            time.sleep(0.05)
    except ProcessLookupError:
        pass  # gone meanwhile
    return True
