"""Running the real services in-process for integration tests.

Each service runs as an asyncio task with its own NATS connection, exactly as ``coordinator up``
runs them; `ServiceRunner` stops them through their stop events, as SIGTERM would.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine
from contextlib import suppress
from pathlib import Path
from typing import Any

import msgspec
from nats.aio.client import Client
from nats.js.api import RawStreamMsg
from nats.js.client import JetStreamContext
from nats.js.errors import NotFoundError

from schemas.route import ErrorBody
from services.router.service import run as run_router
from services.router.settings import RouterSettings
from services.runtime.lifecycle import set_current_stop
from services.runtime.settings import WorkerSettings
from services.stats.settings import StatsSettings
from services.worker.service import run as run_worker

_log = logging.getLogger("tests.services")

FAST_WORKER = {
    "heartbeat_interval_s": 0.5,
    "worker_ttl_s": 3.0,
    "ack_wait_s": 6.0,
    "stop_grace_s": 5.0,
}
# The reaper looking five times a second, with thresholds a test can wait out.
FAST_REAPER = {
    "worker_ttl_s": 3.0,
    "reaper_interval_s": 0.2,
    "ghost_after_s": 1.5,
    "stuck_grace_s": 0.5,
}


def _report_end(service: str, stop: asyncio.Event, task: asyncio.Task[None]) -> None:
    """A service that ended by itself with an error says so in the test's log, with its
    traceback: `ServiceRunner.stop_all` does not raise it, and a test that fails later for
    want of that service would otherwise not say why."""
    if task.cancelled() or (error := task.exception()) is None:
        return
    when = "after its stop" if stop.is_set() else "before its stop"
    _log.error("service %s ended %s with %r", service, when, error, exc_info=error)


class ServiceRunner:
    """Starts services as tasks and stops them all at the end."""

    def __init__(self) -> None:
        self._running: list[tuple[asyncio.Event, asyncio.Task[None]]] = []

    def start(
        self, fn: Callable[[Any, asyncio.Event], Coroutine[Any, Any, None]], settings: Any
    ) -> asyncio.Task[None]:
        stop = asyncio.Event()

        async def service() -> None:
            # As in its own process: it waits for the bus until its stop, never just once.
            set_current_stop(stop)
            await fn(settings, stop)

        task = asyncio.create_task(service())
        task.add_done_callback(functools.partial(_report_end, fn.__module__, stop))
        self._running.append((stop, task))
        return task

    def router(self, nats_url: str, **overrides: Any) -> asyncio.Task[None]:
        return self.start(
            run_router, RouterSettings(nats_url=nats_url, worker_ttl_s=3.0, **overrides)
        )

    def worker(
        self, nats_url: str, ollama_url: str, worker_id: str, **overrides: Any
    ) -> asyncio.Task[None]:
        options = {**FAST_WORKER, **overrides}
        return self.start(
            run_worker,
            WorkerSettings(
                nats_url=nats_url,
                ollama_host=ollama_url,
                worker_id=worker_id,
                worker_host=f"host-{worker_id}",
                **options,
            ),
        )

    def stats(self, nats_url: str, pg_dsn: str) -> asyncio.Task[None]:
        from services.stats.service import run as run_stats

        return self.start(run_stats, StatsSettings(nats_url=nats_url, pg_dsn=pg_dsn))

    def reaper(self, nats_url: str, **overrides: Any) -> asyncio.Task[None]:
        from services.reaper.service import run as run_reaper
        from services.reaper.settings import ReaperSettings

        options = {**FAST_REAPER, **overrides}
        return self.start(run_reaper, ReaperSettings(nats_url=nats_url, **options))

    async def stop(self, task: asyncio.Task[None]) -> None:
        for stop, running in self._running:
            if running is task:
                stop.set()
        with suppress(Exception):
            await asyncio.wait_for(task, timeout=15)

    async def stop_all(self) -> None:
        for stop, _ in self._running:
            stop.set()
        for _, task in self._running:
            with suppress(Exception):
                await asyncio.wait_for(task, timeout=15)
        self._running.clear()


async def request(
    nc: Client, subject: str, body: Any, timeout_s: float = 30.0
) -> tuple[dict[str, Any], dict[str, str]]:
    """Send a JSON request; return the decoded reply body and its headers."""
    data = body if isinstance(body, bytes) else msgspec.json.encode(body)
    reply = await nc.request(subject, data, timeout=timeout_s)
    return msgspec.json.decode(reply.data), dict(reply.headers or {})


def error_of(body: dict[str, Any]) -> ErrorBody:
    return msgspec.convert(body, ErrorBody)


async def last_task_event(js: JetStreamContext, task_id: str, kind: str) -> RawStreamMsg:
    """A task's latest stored ``kind`` event, whoever recorded it: a worker, on its own
    subject (``events.task.<task>.<worker>.<kind>``), or the router or the reaper (``events.
    task.<task>.<kind>``). Raises `NotFoundError` when there is none."""
    found = []
    for subject in (f"events.task.{task_id}.{kind}", f"events.task.{task_id}.*.{kind}"):
        with suppress(NotFoundError):
            found.append(await js.get_last_msg("EVENTS", subject))
    if not found:
        raise NotFoundError
    return max(found, key=lambda msg: msg.seq or 0)


async def eventually(
    check: Callable[[], Awaitable[Any]], timeout_s: float = 10.0, interval_s: float = 0.05
) -> Any:
    """Poll ``check`` until it returns something truthy; fail with its last value otherwise."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        last = await check()
        if last:
            return last
        await asyncio.sleep(interval_s)
    raise AssertionError(f"condition not met within {timeout_s} s (last value: {last!r})")


async def workers_live(nc: Client, count: int, timeout_s: float = 20.0) -> list[dict[str, Any]]:
    """Wait until ``coordinator.workers`` lists ``count`` live workers."""

    async def check() -> list[dict[str, Any]] | None:
        try:
            body, _ = await request(nc, "coordinator.workers", {}, timeout_s=2.0)
        except Exception:
            return None
        # A starting worker holds its lease before its models have passed their sanity runs:
        # it is live when it lists them.
        workers: list[dict[str, Any]] = [w for w in body["workers"] if w.get("models")]
        return workers if len(workers) >= count else None

    result: list[dict[str, Any]] = await eventually(check, timeout_s=timeout_s)
    return result


COORDINATOR = str(Path(sys.executable).parent / "coordinator")


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without any Coordinator setting, plus ``extra``."""
    names = ("NATS_URL", "PG_DSN", "OLLAMA_HOST", "WORKER_ID", "WORKER_SUPPORTS", "WORKER_MODELS")
    env = {k: v for k, v in os.environ.items() if k not in names}
    env.update(LOG_FORMAT="json", **extra)
    return env


class Processes:
    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[str]] = []

    def start(self, args: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        self.procs.append(proc)
        return proc

    def stop_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.communicate(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()


async def logged(proc: subprocess.Popen[str], text: str, timeout_s: float = 20.0) -> str:
    """Read the process's log (stdout) up to the first line that holds ``text``; what was read."""
    assert proc.stdout is not None
    stdout = proc.stdout
    lines: list[str] = []

    async def read() -> str:
        while True:
            line = await asyncio.to_thread(stdout.readline)
            if not line:
                raise AssertionError(f"the process ended before logging {text!r}: {lines}")
            lines.append(line)
            if text in line:
                return "".join(lines)

    return await asyncio.wait_for(read(), timeout=timeout_s)


def run_cli(
    *args: str, env: dict[str, str], timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [COORDINATOR, *args], env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
