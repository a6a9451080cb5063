"""A test machine that runs systemd: a container booted with ``systemd-nspawn`` inside a test
host (`devtools.hosts`), so ``coordinator join`` can install and start its unit as it does on
a real Linux machine.

The container boots this machine's own ``/usr`` with ``--volatile=yes``: its ``/etc``, ``/var``
and ``/root`` start empty, in memory, and are gone when it stops, so nothing it writes reaches
this machine. systemd is its PID 1 and reaches only ``sysinit.target`` (none of this machine's
own services start inside); a unit that ``systemctl enable --now`` starts runs as on any
machine. The container shares the test host's network namespace: the host's loopback is the
container's (an Ollama stand-in started in the host is the machine's local backend), and this
machine is the host's ``gateway_ip``. Read-only binds bring in what the container's programs
need that ``/usr`` does not hold (this checkout and its Python).

Needs root, ``systemd-nspawn`` (Debian's systemd-container) and systemd's own binary;
`systemd_unavailable` says why not, for a skip.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Final

from devtools.hosts import NetnsHost

SYSTEMD: Final = Path("/usr/lib/systemd/systemd")
BOOT_TIMEOUT_S: Final = 60.0
STOP_TIMEOUT_S: Final = 30.0
# What `systemctl is-system-running` says once the boot has ended. "degraded": some unit of
# the boot failed (systemd-firstboot's wizard always does without a console).
_BOOTED: Final = frozenset({"running", "degraded"})
_PATH: Final = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def systemd_unavailable() -> str | None:
    """Why a systemd machine cannot be booted here, or None when it can."""
    if os.geteuid() != 0:
        return "systemd-nspawn needs root"
    if shutil.which("systemd-nspawn") is None:
        return "systemd-nspawn is not installed (Debian: systemd-container)"
    if not SYSTEMD.exists():
        return f"{SYSTEMD} is not installed"
    return None


class SystemdMachine:
    """A booted container: run commands in it as root (`run`), ask its systemd (`systemctl`)."""

    def __init__(self, init_pid: int) -> None:
        self.init_pid = init_pid  # its PID 1, as this machine numbers it

    def run(
        self, *argv: str, env: dict[str, str] | None = None, timeout: float = 60.0
    ) -> subprocess.CompletedProcess[str]:
        """``argv`` inside the machine (all its namespaces), as root, with only ``env`` and a
        PATH in its environment; never raises for a non-zero exit."""
        inner_env = {"PATH": _PATH, "HOME": "/root", "USER": "root", **(env or {})}
        command = [
            *("nsenter", "--target", str(self.init_pid), "--all"),
            *("env", "-i", *(f"{key}={value}" for key, value in inner_env.items())),
            *argv,
        ]
        return subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)

    def systemctl(self, *args: str) -> str:
        """What ``systemctl args`` printed (its exit status says a state too: not checked)."""
        return self.run("systemctl", "--no-pager", *args).stdout.strip()


def _init_pid(host: NetnsHost) -> int | None:
    """The container's PID 1: the systemd in the host whose pid in its own namespace is 1."""
    for pid in host.pids():
        with suppress(OSError):
            status = Path(f"/proc/{pid}/status").read_text()
            fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
            if fields.get("Name", "").strip() == "systemd" and fields["NSpid"].split()[-1] == "1":
                return pid
    return None


def _wait_booted(host: NetnsHost, nspawn: subprocess.Popen[bytes], log: Path) -> SystemdMachine:
    deadline = time.monotonic() + BOOT_TIMEOUT_S
    state = "not started"
    while time.monotonic() < deadline:
        if nspawn.poll() is not None:
            raise RuntimeError(
                f"systemd-nspawn exited ({nspawn.returncode}): {log.read_text()[-2000:]}"
            )
        pid = _init_pid(host)
        if pid is not None:
            machine = SystemdMachine(pid)
            state = machine.systemctl("is-system-running")
            if state in _BOOTED:
                return machine
        time.sleep(0.2)
    raise RuntimeError(f"the machine did not boot within {BOOT_TIMEOUT_S:g} s ({state}): {log}")


@contextmanager
def systemd_machine(
    host: NetnsHost, *, binds: Sequence[Path], log: Path
) -> Iterator[SystemdMachine]:
    """A machine booted in ``host`` with ``binds`` (read-only, same paths inside); powered off
    at the end (killed if it does not stop within `STOP_TIMEOUT_S`). Its console goes to
    ``log``."""
    name = f"co-{host.name}"
    command = [
        *("systemd-nspawn", "--directory=/", "--volatile=yes", f"--machine={name}"),
        # No machined, no scope of its own: this machine's PID 1 need not be systemd.
        *("--register=no", "--keep-unit"),
        f"--network-namespace-path=/run/netns/{host.name}",
        *(f"--bind-ro={path}" for path in binds),
        *("--console=pipe", "--boot", "--", "--unit=sysinit.target"),
    ]
    with log.open("wb") as out:
        nspawn = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT
        )
    try:
        yield _wait_booted(host, nspawn, log)
    finally:
        # SIGTERM: nspawn asks the machine's systemd to power off, and waits for it.
        nspawn.send_signal(signal.SIGTERM)
        try:
            nspawn.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            nspawn.kill()
            nspawn.wait()
            host.kill_all()
