"""The worker's watchdog process (`services.runtime.watchdog`), against real processes: it kills
a worker that stops running while busy, leaves an idle one alone, and does not count a stop of
its own (a Ctrl-C or Ctrl-Z reaches the whole process group)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

LIMIT_S = 0.6
# For a worker that must not be killed while it runs: a busy machine may keep a process off
# the CPU for a while, but not for this long.
SAFE_LIMIT_S = 2.0

# A stand-in worker: starts its watchdog and says busy (or idle) for a while; then, when told to
# stall, runs no code (blocked in time.sleep, as a stalled process) until it is killed or the
# sleep ends; else goes on running (and saying so) for as long.
WORKER = """
import asyncio, sys, time
from services.runtime.watchdog import Watchdog

async def main(state: str, stall: bool, limit_s: float) -> None:
    watchdog = Watchdog(limit_s)
    await watchdog.start()
    watchdog.mark(state == "busy")
    feeding = asyncio.create_task(watchdog.feed(lambda: state == "busy"))
    await asyncio.sleep(limit_s * 2)
    print("stalling" if stall else "running", flush=True)
    if stall:
        time.sleep(limit_s * 5)  # the event loop runs nothing meanwhile
    else:
        await asyncio.sleep(limit_s * 4)
    feeding.cancel()
    await watchdog.close()
    print("survived", flush=True)

asyncio.run(main(sys.argv[1], sys.argv[2] == "stall", float(sys.argv[3])))
"""


def start(state: str, how: str = "stall", limit_s: float = LIMIT_S) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", WORKER, state, how, str(limit_s)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # a group of its own: a test may stop the watchdog with it
    )


def test_a_busy_worker_that_stops_running_is_killed_and_told_why() -> None:
    worker = start("busy")
    out, err = worker.communicate(timeout=30)
    assert worker.returncode == -signal.SIGKILL, (out, err)
    assert "stalling" in out and "survived" not in out
    assert f"the limit is {LIMIT_S:g} s" in err and "killing it" in err


def test_an_idle_worker_that_stops_running_is_left_alone() -> None:
    worker = start("idle")
    out, err = worker.communicate(timeout=30)
    assert worker.returncode == 0, (out, err)
    assert "survived" in out


def test_a_stop_of_the_whole_group_is_no_stall() -> None:
    """Ctrl-Z stops the worker and its watchdog together: the watchdog counts from when it
    runs again, and the worker, which then runs again too, is not killed."""
    worker = start("busy", "run", SAFE_LIMIT_S)
    assert worker.stdout is not None
    while (line := worker.stdout.readline()) and line.strip() != "running":
        pass  # its log lines
    os.killpg(worker.pid, signal.SIGSTOP)
    time.sleep(SAFE_LIMIT_S * 2)
    os.killpg(worker.pid, signal.SIGCONT)
    out, err = worker.communicate(timeout=30)
    assert worker.returncode == 0, (out, err)
    assert "survived" in out
