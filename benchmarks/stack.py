"""The whole stack as separate processes, for the end-to-end benchmarks, and what they cost.

`Stack` starts, on loopback only: a nats-server from the pinned wheel (free port, temporary
store), an Ollama stand-in (`benchmarks.standin`, instant; or ``devtools/fakes/ollama.py`` with
``standin="fake"``), a scratch PostgreSQL database (the machine's server on 127.0.0.1:5432
when it answers, else an embedded one, as the tests do), then ``coordinator stats serve``,
``coordinator router`` and N ``coordinator worker`` processes configured by the environment
only, as in production (logs: JSON lines to a file, level ``info``). It waits until every
worker is routable, and stops everything on exit (a SIGTERM to the benchmark included).

CPU time is read from ``/proc/<pid>/stat`` (user + system) for each process, the PostgreSQL
backends serving the scratch database included, so a benchmark can say what each part
costs per task. The load helpers send ``coordinator.route`` requests with ``wait`` from this
process and time them.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Final, Literal, Self

import asyncpg
import msgspec
import nats
from nats.aio.client import Client

from devtools.servers import NatsServer, Postgres, free_port, wait_for_port
from schemas.queries import WorkersReply
from schemas.route import RouteReply, RouteRequest
from schemas.subjects import EVENTS_STREAM, ROUTE, STATS, WORKERS

RESULTS: Final = Path(__file__).resolve().parent / "results"
CLK_TCK: Final = os.sysconf("SC_CLK_TCK")
MODEL: Final = "qwen2.5:0.5b"
PROMPT: Final = "Say something short."
READY_TIMEOUT_S: Final = 60.0
REQUEST_TIMEOUT_S: Final = 30.0

Standin = Literal["instant", "fake"]

_reply_decoder = msgspec.json.Decoder(RouteReply)
_workers_decoder = msgspec.json.Decoder(WorkersReply)
_encoder = msgspec.json.Encoder()


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (0 when it is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    # The command name (field 2) may hold spaces; the fields after it are fixed.
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def load_average() -> list[float]:
    """1, 5 and 15 minute load averages, rounded."""
    return [round(x, 2) for x in os.getloadavg()]


def machine() -> dict[str, Any]:
    """What the figures were measured on."""
    model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return {
        "cpu": model,
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "kernel": platform.release(),
    }


@dataclass
class Proc:
    """One process of the stack; ``role`` groups them in the CPU table."""

    name: str
    role: str
    popen: subprocess.Popen[bytes]

    @property
    def pid(self) -> int:
        return self.popen.pid


@dataclass
class CpuSample:
    """CPU seconds per process name at one moment."""

    at: float
    seconds: dict[str, float] = field(default_factory=dict)
    roles: dict[str, str] = field(default_factory=dict)

    def minus(self, earlier: CpuSample) -> dict[str, float]:
        """CPU seconds spent per process since ``earlier``."""
        return {
            name: max(0.0, value - earlier.seconds.get(name, 0.0))
            for name, value in self.seconds.items()
        }


class Stack:
    """Everything a route request touches, each in its own process; an async context manager."""

    def __init__(
        self,
        workers: int,
        *,
        standin: Standin = "instant",
        supports: str = "cpu_inference",
        stats: bool = True,
        log_level: str = "info",
        extra_env: dict[str, str] | None = None,
        monitor: bool = False,
    ) -> None:
        self.workers = workers
        self.standin = standin
        self.supports = supports
        self.with_stats = stats
        self.log_level = log_level
        self.extra_env = extra_env or {}
        self.procs: list[Proc] = []
        self.tmp = Path(tempfile.mkdtemp(prefix="coord-bench-"))
        # nats-server's monitoring port (its /connz counts each connection's messages).
        self.monitor_port = free_port() if monitor else None
        self.nats = NatsServer(
            str(self.tmp / "nats"),
            extra_args=["-m", str(self.monitor_port)] if self.monitor_port else (),
        )
        self.postgres = Postgres()
        self.dsn = ""
        self.standin_url = ""
        self.nc: Client | None = None
        self._logs: list[Any] = []

    # -- start and stop ------------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        # A SIGTERM to the benchmark cancels it, so its ``async with`` stops the stack: the
        # services run in sessions of their own and would otherwise outlive it.
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        if task is not None:
            loop.add_signal_handler(signal.SIGTERM, task.cancel)
        try:
            await self._start()
        except BaseException:
            await self._stop()
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._stop()

    async def _start(self) -> None:
        self.nats.start()
        assert self.nats.proc is not None
        port = free_port()
        self.standin_url = f"http://127.0.0.1:{port}"
        cmd = "benchmarks.standin" if self.standin == "instant" else "devtools.fakes.ollama"
        self._spawn("standin", "standin", [sys.executable, "-m", cmd, "--port", str(port)], {})
        wait_for_port(port)
        if self.with_stats:
            await self.postgres.start()
            self.dsn = await self.postgres.create_database()
            self._spawn("stats", "stats", [_coordinator(), "stats", "serve"], {"PG_DSN": self.dsn})
        self._spawn("router", "router", [_coordinator(), "router"], {})
        for i in range(1, self.workers + 1):
            worker_id = f"bench-{i}"
            self._spawn(
                worker_id,
                "workers",
                [_coordinator(), "worker"],
                {
                    "WORKER_ID": worker_id,
                    "WORKER_HOST": "bench-host",
                    "WORKER_SUPPORTS": self.supports,
                    "OLLAMA_HOST": self.standin_url,
                    "SANITY_CHECK": "false",
                },
            )
        self.nc = await nats.connect(self.nats.url, name="benchmark-client")
        await self._wait_ready()

    def _spawn(self, name: str, role: str, argv: list[str], env: dict[str, str]) -> None:
        log = (self.tmp / f"{name}.log").open("wb")
        self._logs.append(log)
        full_env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("NATS_", "OTEL_", "PG_", "WORKER_", "OLLAMA_"))
        }
        full_env.update(
            NATS_URL=self.nats.url,
            LOG_LEVEL=self.log_level,
            LOG_FORMAT="json",
            # BENCH_SERVICES_PATH: another checkout's services, to compare two versions
            # under the same load (run them alternately).
            PYTHONPATH=os.environ.get("BENCH_SERVICES_PATH")
            or str(Path(__file__).resolve().parent.parent),
            **self.extra_env,
            **env,
        )
        popen = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=full_env, start_new_session=True
        )
        self.procs.append(Proc(name, role, popen))

    async def _wait_ready(self) -> None:
        assert self.nc is not None
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            self._check_alive()
            with contextlib.suppress(Exception):
                reply = await self.nc.request(WORKERS, b"{}", timeout=1.0)
                # A starting worker holds its lease before it lists its models.
                live = [w for w in _workers_decoder.decode(reply.data).workers if w.models]
                if len(live) == self.workers and (not self.with_stats or await self._stats_up()):
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the stack did not come up within {READY_TIMEOUT_S:g} s")
            await asyncio.sleep(0.2)

    async def _stats_up(self) -> bool:
        assert self.nc is not None
        try:
            await self.nc.request(STATS, b"{}", timeout=2.0)
        except Exception:
            return False
        return True

    def _check_alive(self) -> None:
        for proc in self.procs:
            if proc.popen.poll() is not None:
                tail = (self.tmp / f"{proc.name}.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"{proc.name} exited ({proc.popen.returncode}):\n{tail}")

    async def _stop(self) -> None:
        with contextlib.suppress(RuntimeError):  # once stopping, a SIGTERM ends it as usual
            asyncio.get_running_loop().remove_signal_handler(signal.SIGTERM)
        if self.nc is not None:
            with contextlib.suppress(Exception):
                await self.nc.close()
        # Workers first (they deregister), then the rest; SIGTERM, then SIGKILL after a while.
        for group in (
            [p for p in self.procs if p.role == "workers"],
            [p for p in self.procs if p.role != "workers"],
        ):
            for proc in group:
                if proc.popen.poll() is None:
                    proc.popen.send_signal(signal.SIGTERM)
            for proc in group:
                try:
                    proc.popen.wait(15)
                except subprocess.TimeoutExpired:
                    proc.popen.kill()
                    proc.popen.wait()
        for log in self._logs:
            log.close()
        self.nats.stop()
        if self.dsn:
            with contextlib.suppress(Exception):
                await self.postgres.drop_database(self.dsn)
        self.postgres.stop()
        if os.environ.get("BENCH_KEEP_LOGS"):
            print(f"logs kept in {self.tmp}", file=sys.stderr)
        else:
            shutil.rmtree(self.tmp, ignore_errors=True)

    # -- measuring -----------------------------------------------------------------------------

    async def cpu(self) -> CpuSample:
        """CPU seconds of every process now: services, nats-server, the stand-in, PostgreSQL's
        backends for the scratch database, and this benchmark's own process (the client)."""
        sample = CpuSample(at=time.monotonic())
        for proc in self.procs:
            sample.seconds[proc.name] = cpu_seconds(proc.pid)
            sample.roles[proc.name] = proc.role
        assert self.nats.proc is not None
        sample.seconds["nats-server"] = cpu_seconds(self.nats.proc.pid)
        sample.roles["nats-server"] = "nats-server"
        for pid in await self._postgres_pids():
            name = f"postgres-{pid}"
            sample.seconds[name] = cpu_seconds(pid)
            sample.roles[name] = "postgres"
        sample.seconds["client"] = cpu_seconds(os.getpid())
        sample.roles["client"] = "client"
        return sample

    async def _postgres_pids(self) -> list[int]:
        if not self.dsn:
            return []
        name = self.dsn.rsplit("/", 1)[-1].split("?", 1)[0]
        try:
            conn = await asyncpg.connect(self.postgres.admin_dsn)
        except Exception:
            return []
        try:
            rows = await conn.fetch(
                "SELECT pid FROM pg_stat_activity WHERE datname = $1 AND pid <> pg_backend_pid()",
                name,
            )
        finally:
            await conn.close()
        return [int(r["pid"]) for r in rows]

    async def stats_caught_up(self, timeout_s: float = 120.0) -> float:
        """Wait until the stats projection has applied every event; returns the wait (s)."""
        if not self.with_stats:
            return 0.0
        assert self.nc is not None
        js = self.nc.jetstream()
        started = time.monotonic()
        while time.monotonic() - started < timeout_s:
            info = await js.consumer_info(EVENTS_STREAM, "stats")
            if not info.num_pending and not info.num_ack_pending:
                return time.monotonic() - started
            await asyncio.sleep(0.1)
        raise RuntimeError(f"the stats projection has not caught up after {timeout_s:g} s")


def _coordinator() -> str:
    return str(Path(sys.executable).with_name("coordinator"))


# -- load ----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Sample:
    """One routed request: its time end to end and the backend's own time, in ms."""

    total_ms: float
    backend_ms: float
    ok: bool


_REQUEST: Final = _encoder.encode(RouteRequest(prompt=PROMPT, model=MODEL, wait=True))


async def route_once(nc: Client, body: bytes = _REQUEST) -> Sample:
    """One ``coordinator.route`` with ``wait``, timed from send to the reply's arrival."""
    started = time.perf_counter()
    msg = await nc.request(ROUTE, body, timeout=REQUEST_TIMEOUT_S)
    total_ms = (time.perf_counter() - started) * 1000
    reply = _reply_decoder.decode(msg.data) if not (msg.headers or {}).get("Status") else None
    if reply is None or reply.status != "done":
        return Sample(total_ms, 0.0, False)
    backend_ms = reply.durations.total_ms if reply.durations is not None else 0.0
    return Sample(total_ms, backend_ms, True)


async def closed_loop(
    nc: Client, *, clients: int, duration_s: float, max_requests: int
) -> tuple[list[Sample], float]:
    """``clients`` loops each sending one request after the other, until ``duration_s`` has
    passed or ``max_requests`` were sent; returns the samples and the wall time taken."""
    samples: list[Sample] = []
    sent = 0
    deadline = time.monotonic() + duration_s

    async def client() -> None:
        nonlocal sent
        while sent < max_requests and time.monotonic() < deadline:
            sent += 1
            try:
                samples.append(await route_once(nc))
            except Exception:
                samples.append(Sample(REQUEST_TIMEOUT_S * 1000, 0.0, False))

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    return samples, time.perf_counter() - started


# -- figures -------------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0-100), interpolated between the closest ranks."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def median(values: list[float]) -> float:
    return percentile(values, 50)


def table(headers: list[str], rows: list[list[Any]]) -> str:
    """A plain text table, numbers right-aligned."""
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    for row, raw in zip(cells, rows, strict=True):
        lines.append(
            "  ".join(
                c.rjust(w) if isinstance(v, int | float) else c.ljust(w)
                for c, w, v in zip(row, widths, raw, strict=True)
            )
        )
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"
    return str(value)


def write_result(name: str, figure: dict[str, Any]) -> Path:
    """Write ``figure``, with the machine it ran on, to ``results/<name>-<time>.json``."""
    import json

    RESULTS.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    path = RESULTS / f"{name}-{stamp}.json"
    body = {
        "benchmark": name,
        **figure,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        **machine(),
    }
    path.write_text(json.dumps(body, indent=2) + "\n", encoding="utf-8")
    return path


@contextlib.contextmanager
def timed() -> Iterator[list[float]]:
    """``with timed() as took: ...``; ``took[0]`` is the seconds the block took."""
    took: list[float] = []
    started = time.perf_counter()
    try:
        yield took
    finally:
        took.append(time.perf_counter() - started)
