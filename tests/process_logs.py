"""A service process's log, read as it is written: JSON lines from its stdout, kept in order.

A thread reads the pipe to its end, so a process that logs a lot never blocks on a full pipe,
and a test can wait for a line or count them at any time (a killed process's lines stay).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import threading
import time
from typing import Any


class ProcessLog:
    """Every line ``proc`` writes to stdout, decoded when it is JSON."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self.lines: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        # The pipe is this reader's alone: `Popen.communicate` (the fixture's clean-up)
        # reading it too would take lines from it, or find it closed under it.
        assert proc.stdout is not None
        self._stdout, proc.stdout = proc.stdout, None
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _read(self) -> None:
        with self._stdout:
            for raw in self._stdout:
                self._add(raw)

    def _add(self, raw: str) -> None:
        try:
            line = json.loads(raw)
        except ValueError:
            line = {"event": raw.rstrip("\n")}
        if not isinstance(line, dict):
            line = {"event": str(line)}
        line["_seen_at"] = time.monotonic()
        with self._lock:
            self.lines.append(line)

    def events(self, event: str) -> list[dict[str, Any]]:
        """The lines whose message is ``event``, in order."""
        with self._lock:
            return [line for line in self.lines if line.get("event") == event]

    def count(self, event: str) -> int:
        return len(self.events(event))

    async def wait_for(self, event: str, timeout_s: float = 30.0) -> dict[str, Any]:
        """The first line whose message is ``event`` (logged already, or to come)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = self.events(event)
            if found:
                return found[0]
            if self.proc.poll() is not None and not self._reader.is_alive():
                raise AssertionError(f"process {self.pid} ended before logging {event!r}")
            await asyncio.sleep(0.05)
        raise AssertionError(f"process {self.pid} did not log {event!r} within {timeout_s} s")
