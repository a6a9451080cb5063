"""The end-to-end benchmarks' stack (`benchmarks.stack`) stops what it started when the
benchmark is sent SIGTERM: its services run in sessions of their own, so without that they
would outlive it and load the machine every later figure is measured on."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.harness import clean_env

CHECKOUT = Path(__file__).resolve().parents[2]


def children(pid: int) -> dict[int, str]:
    """The live children of ``pid``, with their command lines."""
    found: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
        except OSError:
            continue
        # Fields after the command's closing parenthesis: state, then the parent's pid.
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid and cmdline:
            found[int(entry.name)] = cmdline
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_a_benchmark_sent_sigterm_stops_every_service_it_started(tmp_path: Path) -> None:
    log = (tmp_path / "bench.log").open("wb")
    bench = subprocess.Popen(
        [
            *(sys.executable, "-m", "benchmarks.throughput"),
            *("--workers", "1", "--runs", "1", "--duration", "120"),
        ],
        cwd=CHECKOUT,
        env=clean_env(),
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    started: dict[int, str] = {}
    try:
        # Under load: the worker has logged a task done (its log is in the stack's scratch
        # directory, which nats-server's store sits in).
        deadline = time.monotonic() + 90
        scratch: Path | None = None
        while time.monotonic() < deadline and bench.poll() is None:
            started = children(bench.pid)
            scratch = next(
                (
                    Path(cmd.split(" -sd ")[1].split()[0]).parent
                    for cmd in started.values()
                    if "nats-server" in cmd and " -sd " in cmd
                ),
                None,
            )
            worker_log = scratch / "bench-1.log" if scratch else None
            if worker_log and worker_log.exists() and '"task done"' in worker_log.read_text():
                break
            time.sleep(0.2)
        said = (tmp_path / "bench.log").read_text()
        assert scratch is not None and bench.poll() is None, (started, said)
        assert '"task done"' in (scratch / "bench-1.log").read_text(), said
        assert any("coordinator router" in cmd for cmd in started.values()), started
        bench.send_signal(signal.SIGTERM)
        bench.wait(60)
        # Each service was given its SIGTERM and waited for (or killed) before the exit.
        left = {pid: cmd for pid, cmd in started.items() if alive(pid)}
        assert not left, left
        assert not scratch.exists()
    finally:
        log.close()
        if bench.poll() is None:
            bench.kill()
            bench.wait()
        for pid in started:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
