"""A worker's watchdog: a small process of its own that kills the worker when the worker stops
running while a task runs, so that its backend stops generating before anyone may move the task.

A worker process that is stopped (SIGSTOP, a debugger), or stalls (swapped out, frozen), runs
no code: it cannot stop its backend, which goes on generating for the stalled worker, and after
``WORKER_TTL_S`` without a heartbeat the reaper moves the task to another worker. Without a
watchdog the two generations would overlap for as long as the stall lasts beyond the TTL (what
`services.runtime.touch` does is only possible once the process runs again). The watchdog is a
separate process, so it runs on: the worker writes it a byte every quarter of its limit ("busy"
while a task runs, else "idle"); when the worker has written nothing for ``limit_s`` while busy,
the watchdog kills it (SIGKILL). The kernel then closes the worker's connections: its backend
sees the client gone and stops generating (Ollama does), and the NATS server drops the worker's
connection. The limit is below the TTL (by default the TTL less one heartbeat interval), so the
generation has stopped before the reaper may judge the worker dead and move its task. The
service manager (systemd, launchd, compose) starts the worker again.

The bound, as docs/guarantees.md states it: two generations of one task never overlap when a
worker's process stalls, as long as its watchdog runs (a separate process: a stop or a stall of
the worker alone does not stop it). If the whole host is frozen the watchdog is frozen with it,
and so is a backend on that host; a backend on another host (``OLLAMA_HOST`` elsewhere) is the
one case left open. An idle worker is not killed: nothing of it runs twice.

The watchdog itself, when it is the one stopped (a Ctrl-Z stops both), gives the worker a fresh
limit from when it runs again: it judges only silence it was awake to see.

Run by a worker that is its own process (``coordinator worker``); as ``python -m
services.runtime.watchdog <worker pid> <limit seconds>``, reading the worker's bytes on its
standard input, and ending when that closes (the worker stopped, or is gone).
"""

from __future__ import annotations

import asyncio
import os
import select
import signal
import sys
import time
from collections.abc import Callable
from contextlib import suppress
from typing import Final

import structlog

log = structlog.get_logger("watchdog")

BUSY: Final = b"b"
IDLE: Final = b"i"
# The worker writes this many times per limit.
TICKS_PER_LIMIT: Final = 4
# How long a stopping worker waits for its watchdog to end.
CLOSE_WAIT_S: Final = 2.0


class Watchdog:
    """The worker's side: starts the watchdog process, tells it whether a task runs, ends it."""

    def __init__(self, limit_s: float) -> None:
        self.limit_s = limit_s
        self._proc: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        """Start the watchdog process for this process."""
        self._proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "services.runtime.watchdog",
            str(os.getpid()),
            repr(self.limit_s),
            stdin=asyncio.subprocess.PIPE,
        )
        log.info("watchdog started", pid=self._proc.pid, limit_s=self.limit_s)

    def mark(self, busy: bool) -> None:
        """Tell the watchdog now that a task's work starts (``busy``) or ends: a stall right
        after a task started must not wait for the next tick to count."""
        proc = self._proc
        if proc is not None and proc.stdin is not None and not proc.stdin.is_closing():
            with suppress(BrokenPipeError, ConnectionResetError):
                proc.stdin.write(BUSY if busy else IDLE)

    async def feed(self, busy: Callable[[], bool]) -> None:
        """Tell the watchdog, every quarter of its limit, whether a task runs (``busy()``); run
        it as a task, cancel to stop."""
        assert self._proc is not None and self._proc.stdin is not None
        stdin = self._proc.stdin
        while True:
            try:
                stdin.write(BUSY if busy() else IDLE)
                await stdin.drain()
            except (BrokenPipeError, ConnectionResetError) as exc:
                log.warning("watchdog gone; the worker runs on without one", error=repr(exc))
                return
            await asyncio.sleep(self.limit_s / TICKS_PER_LIMIT)

    async def close(self) -> None:
        """End the watchdog: its input closes, and it exits."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.stdin is not None:
            proc.stdin.close()
        try:
            await asyncio.wait_for(proc.wait(), CLOSE_WAIT_S)
        except TimeoutError:
            with suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()


def watch(worker_pid: int, limit_s: float, fd: int) -> str:
    """Read the worker's bytes on ``fd`` until it closes; kill the worker when it has been
    silent for ``limit_s`` while busy. Returns why it ended."""
    step = limit_s / TICKS_PER_LIMIT
    last = time.monotonic()
    busy = False
    while True:
        before = time.monotonic()
        ready, _, _ = select.select([fd], [], [], step)
        now = time.monotonic()
        if now - before > step + limit_s / 2:
            last = now  # this process was stopped itself: judge only what it saw
        if ready:
            data = os.read(fd, 4096)
            if not data:
                return "the worker closed its watchdog"
            last, busy = now, data[-1:] == BUSY
            continue
        if os.getppid() != worker_pid:
            return "the worker is gone"
        if busy and now - last >= limit_s:
            print(
                f"watchdog: worker process {worker_pid} has not run for {now - last:.1f} s while "
                f"a task ran (stopped or stalled; the limit is {limit_s:g} s): killing it, so "
                "its backend stops generating before the task can be moved to another worker",
                file=sys.stderr,
                flush=True,
            )
            with suppress(ProcessLookupError):
                os.kill(worker_pid, signal.SIGKILL)
            return "killed the worker"


def main(argv: list[str]) -> int:
    """``python -m services.runtime.watchdog <worker pid> <limit seconds>``."""
    worker_pid, limit_s = int(argv[1]), float(argv[2])
    # A Ctrl-C in the worker's terminal, or a service manager's SIGTERM to the whole group,
    # stops the worker, which closes this watchdog's input at its end: that ends it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    watch(worker_pid, limit_s, sys.stdin.fileno())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
