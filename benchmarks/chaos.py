"""Chaos: thousands of tasks while workers, the router and the reaper are killed at random.

    .venv/bin/python -m benchmarks.chaos [--tasks 2000] [--workers 4] [--seconds 60]
                                         [--kill-every 2] [--seed N]

It starts its own nats-server (the pinned wheel's, temporary store), one Ollama stand-in per
worker (``devtools/fakes/ollama.py``, answering in ``--backend-delay`` seconds, each counting how
many generations it ran at once), and the services as separate processes, configured by the
environment only and with their default settings: ``coordinator router``, ``coordinator
reaper`` and ``--workers`` × ``coordinator worker``. Clients submit ``--tasks`` tasks spread
over ``--seconds`` (a refused or unanswered submission is retried: a task counts as submitted
only once the router accepted it) while every ``--kill-every`` seconds or so a random service
gets ``SIGKILL`` and is started again a moment later (never the last live worker). Then the
chaos stops, everything is started again, and the run waits up to ``--settle`` seconds for
every task to end.

The verdict comes from the event log alone (no PostgreSQL): for each submitted task, its
final state is the outcome of its latest attempt. It reports submitted, done, failed (by
reason), **lost** (no final state), **run concurrently on one worker** (two generations at
once on one worker's stand-in, or overlapping ``started``..outcome spans of one worker id),
duplicated answers (more than one ``completed``: a moved task whose old attempt also finished;
the stale one never counts), and the figures go to ``benchmarks/results/chaos-<time>.json``.

Exit status: 1 when anything was lost or run concurrently on one worker, else 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterable
from contextlib import ExitStack, suppress
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final, TextIO

import msgspec
import nats
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import DeliverPolicy

from devtools.fakes.ollama import FakeOllama
from devtools.servers import running_nats
from schemas.events import (
    TaskCompleted,
    TaskEvent,
    TaskFailed,
    TaskRouted,
    TaskStarted,
    TaskSubmitted,
    kind_of,
    task_event_decoder,
)
from schemas.route import RouteReply, RouteRequest
from schemas.subjects import EVENTS_STREAM, ROUTE, TASKS_STREAM, WORKERS, task_event_source
from schemas.tasks import TaskMessage
from services.runtime.bus import ensure_streams

RESULTS: Final = Path(__file__).resolve().parent / "results"
COORDINATOR: Final = str(Path(sys.executable).parent / "coordinator")
MODEL: Final = "qwen2.5:0.5b"
# A worker that exits this soon after its start was refused (its old lease is still fresh).
EARLY_EXIT_S: Final = 5.0

_encoder = msgspec.json.Encoder()
_reply_decoder = msgspec.json.Decoder(RouteReply)


@dataclass(frozen=True)
class Config:
    tasks: int = 2000
    workers: int = 4
    seconds: float = 60.0
    kill_every_s: float = 2.0
    settle_s: float = 120.0
    backend_delay_s: float = 0.01
    clients: int = 8
    seed: int | None = None
    kill_services: bool = True
    """Kill the router and the reaper too, not only workers."""
    log_level: str = "warning"
    """The services' ``LOG_LEVEL`` (their logs go to files, named in the report on failure)."""


@dataclass
class Report:
    config: dict[str, Any]
    submitted: int = 0
    done: int = 0
    failed: dict[str, int] = field(default_factory=dict)
    lost: int = 0
    lost_tasks: list[str] = field(default_factory=list)
    concurrent: int = 0
    concurrent_by_worker: dict[str, int] = field(default_factory=dict)
    concurrent_seen_by: dict[str, dict[str, int]] = field(default_factory=dict)
    concurrent_examples: list[str] = field(default_factory=list)
    """``events``: overlapping runs in the event log; ``backends``: the stand-ins' count."""
    duplicated_answers: int = 0
    moved: int = 0
    max_attempts: int = 0
    orphans: int = 0
    """Tasks the router recorded whose acceptance never reached a client (it was killed)."""
    kills: dict[str, int] = field(default_factory=dict)
    refused_submissions: int = 0
    elapsed_s: float = 0.0
    logs: str = ""
    lost_where: dict[str, int] = field(default_factory=dict)
    """The queue each lost task was last routed to."""
    lost_histories: dict[str, list[str]] = field(default_factory=dict)
    """The events of a few lost tasks (kind:attempt)."""
    consumers: dict[str, dict[str, Any]] = field(default_factory=dict)
    """At the end: each queue consumer's pending, in-flight and waiting pulls."""

    @property
    def ok(self) -> bool:
        return self.lost == 0 and self.concurrent == 0


class Service:
    """One ``coordinator`` service as a process that can be killed and started again."""

    def __init__(self, name: str, args: list[str], env: dict[str, str], logs: Path) -> None:
        self.name = name
        self.args = args
        self.env = env
        self.log_path = logs / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_at = 0.0
        self.down = False
        self._log: TextIO | None = None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        if self._log is None:
            self._log = self.log_path.open("a", encoding="utf-8")
        self.proc = subprocess.Popen(
            self.args, env=self.env, stdout=self._log, stderr=subprocess.STDOUT
        )
        self.started_at = time.monotonic()
        self.down = False

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
        self.down = True

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None


@dataclass
class _Task:
    submitted: bool = False
    routed: int = 0
    queue: str = ""
    kinds: list[str] = field(default_factory=list)
    """The task's history (`history_entry`)."""
    outcomes: list[tuple[int, str, bool, str | None]] = field(default_factory=list)
    """(attempt, code or "done", retryable, worker)"""
    completed: int = 0

    @property
    def ended(self) -> bool:
        """Completed, or failed for good (not a worker's retryable failure, which the reaper
        moves on)."""
        return any(
            code == "done" or not (retryable and worker is not None)
            for _, code, retryable, worker in self.outcomes
        )


def history_entry(event: TaskEvent) -> str:
    """One event of a task's history, for a report: ``kind:attempt@worker HH:MM:SS.mmm``."""
    worker = getattr(event, "worker", None)
    at = time.strftime("%H:%M:%S", time.gmtime(event.at)) + f".{int(event.at % 1 * 1000):03d}"
    where = f"@{worker}" if worker else ""
    return f"{kind_of(event)}:{getattr(event, 'attempt', '')}{where} {at}"


class EventLog:
    """Every task event since the start of the stream, folded into what the verdict needs."""

    def __init__(self) -> None:
        self.tasks: dict[str, _Task] = {}
        # worker -> [(task, attempt, started at)], and (task, attempt, worker) -> ended at
        self.starts: dict[str, list[tuple[str, int, float]]] = {}
        self.ends: dict[tuple[str, int, str], float] = {}
        self.overlaps: list[str] = []
        """Examples of runs that overlapped on one worker, for the report."""

    async def on_msg(self, msg: Msg) -> None:
        event = task_event_decoder.decode(msg.data)
        task = self.tasks.setdefault(event.task_id, _Task())
        task.kinds.append(history_entry(event))
        match event:
            case TaskSubmitted():
                task.submitted = True
            case TaskRouted():
                # A task's first end stands: a move that raced it went no further.
                if event.attempt >= task.routed and not task.ended:
                    task.routed, task.queue = event.attempt, event.queue
            case TaskStarted():
                self.starts.setdefault(event.worker, []).append(
                    (event.task_id, event.attempt, event.at)
                )
            case TaskCompleted():
                task.completed += 1
                task.outcomes.append((event.attempt, "done", False, event.worker))
                self.ends.setdefault((event.task_id, event.attempt, event.worker), event.at)
            case TaskFailed():
                task.outcomes.append((event.attempt, event.code, event.retryable, event.worker))
                # A run ends where its worker recorded its end; the reaper's or the router's
                # failure naming a dead worker says nothing of when that worker stopped.
                if event.worker is not None and task_event_source(msg.subject) == event.worker:
                    self.ends.setdefault((event.task_id, event.attempt, event.worker), event.at)

    def final(self, task_id: str, *, settled: bool) -> str | None:
        """``done``, a failure's code, or None while the task has no final state.

        The final state is the outcome of the latest attempt; while ``settled`` is False a
        retryable failure a worker reported is not final (the reaper moves it on)."""
        task = self.tasks.get(task_id)
        if task is None:
            return None
        current = [o for o in task.outcomes if o[0] >= task.routed]
        if not current:
            return None
        _, code, retryable, worker = max(current, key=lambda o: (o[0], o[1] == "done"))
        if retryable and worker is not None and not settled:
            return None
        return code

    def concurrent_runs(self) -> dict[str, int]:
        """Per worker id: runs that began while another of its runs had not ended.

        A run is the span from a ``started`` to the outcome of the same attempt from the same
        worker; of several starts of one attempt (an instance that died, then a redelivery),
        the last one before the outcome is the run that produced it."""
        found: dict[str, int] = {}
        for worker, starts in self.starts.items():
            begun: dict[tuple[str, int], list[float]] = {}
            for task, attempt, at in starts:
                begun.setdefault((task, attempt), []).append(at)
            spans = []
            for (task, attempt), ats in begun.items():
                end = self.ends.get((task, attempt, worker))
                before = [at for at in ats if end is not None and at <= end]
                if end is not None and before:
                    spans.append((max(before), end, task, attempt))
            overlaps, latest_end, latest = 0, float("-inf"), ("", 0)
            for begin, end, task, attempt in sorted(spans):
                if begin < latest_end:
                    overlaps += 1
                    self.overlaps.append(
                        f"{worker}: {task}:{attempt} began {latest_end - begin:.3f} s before "
                        f"{latest[0]}:{latest[1]} ended"
                    )
                if end > latest_end:
                    latest_end, latest = end, (task, attempt)
            if overlaps:
                found[worker] = overlaps
        return found


@dataclass(frozen=True)
class Verdict:
    """What the event log alone says of a run's tasks (`judge`): each one's final state, and
    whether any ran twice at once on one worker or was answered twice."""

    finals: dict[str, str | None]
    """Per task: ``done``, its failure's code, or None (lost: no final state)."""
    concurrent_by_worker: dict[str, int]
    """Per worker id: runs that began while another of its runs had not ended."""
    overlap_examples: list[str]
    answered_twice: list[str]
    """Tasks with more than one ``completed`` (two answers recorded)."""
    moved: int
    """Tasks routed more than once."""
    max_attempts: int

    @property
    def lost(self) -> list[str]:
        return sorted(t for t, f in self.finals.items() if f is None)

    @property
    def done(self) -> int:
        return sum(1 for f in self.finals.values() if f == "done")

    @property
    def failed(self) -> dict[str, int]:
        """Failures by code."""
        return dict(
            sorted(Counter(f for f in self.finals.values() if f not in (None, "done")).items())
        )


def judge(events: EventLog, tasks: Iterable[str]) -> Verdict:
    """The verdict on ``tasks`` (every one the clients had accepted), once the run settled."""
    tasks = list(tasks)
    found = [events.tasks.get(t, _Task()) for t in tasks]
    return Verdict(
        finals={t: events.final(t, settled=True) for t in tasks},
        concurrent_by_worker=events.concurrent_runs(),
        overlap_examples=events.overlaps[:10],
        answered_twice=[t for t, task in zip(tasks, found, strict=True) if task.completed > 1],
        moved=sum(1 for task in found if task.routed > 1),
        max_attempts=max((task.routed for task in found), default=0),
    )


class Chaos:
    """One run: the stack, the load, the kills, the verdict."""

    def __init__(self, config: Config, nats_url: str, logs: Path) -> None:
        self.config = config
        self.nats_url = nats_url
        self.logs = logs
        self.rng = random.Random(config.seed)
        self.events = EventLog()
        self.accepted: list[str] = []
        self.refused = 0
        self.kills: Counter[str] = Counter()
        self.backends: list[FakeOllama] = []
        self.workers: list[Service] = []
        self.others: list[Service] = []
        self._restarts: set[asyncio.Task[None]] = set()
        self.consumers: dict[str, dict[str, Any]] = {}

    # -- the stack ---------------------------------------------------------------------------

    def env(self, **extra: str) -> dict[str, str]:
        names = ("NATS_URL", "PG_DSN", "OLLAMA_HOST", "WORKER_ID", "WORKER_MODELS")
        env = {k: v for k, v in os.environ.items() if k not in names}
        env.update(NATS_URL=self.nats_url, LOG_FORMAT="json", LOG_LEVEL=self.config.log_level)
        env.update(extra)
        return env

    def start_stack(self, stack: ExitStack) -> None:
        for n in range(self.config.workers):
            backend = stack.enter_context(FakeOllama(delay_s=self.config.backend_delay_s))
            self.backends.append(backend)
            env = self.env(
                OLLAMA_HOST=backend.url, WORKER_ID=f"chaos-w{n + 1}", WORKER_MODELS=MODEL
            )
            self.workers.append(Service(f"worker-{n + 1}", [COORDINATOR, "worker"], env, self.logs))
        self.others = [
            Service("router", [COORDINATOR, "router"], self.env(), self.logs),
            Service("reaper", [COORDINATOR, "reaper"], self.env(), self.logs),
        ]
        for service in [*self.others, *self.workers]:
            service.start()
            stack.callback(service.stop)

    async def wait_routable(self, nc: Client, timeout_s: float = 60.0) -> None:
        """Until the router lists every worker."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with suppress(Exception):
                reply = await nc.request(WORKERS, b"{}", timeout=2)
                if len(msgspec.json.decode(reply.data)["workers"]) >= len(self.workers):
                    return
            await asyncio.sleep(0.2)
        raise RuntimeError(
            f"the workers did not all register within {timeout_s} s; see {self.logs}"
        )

    # -- load --------------------------------------------------------------------------------

    async def submit(self, nc: Client, number: int) -> None:
        """One task, retried until the router accepts it."""
        body = _encoder.encode(RouteRequest(prompt=f"{number}+1", model=MODEL, timeout_s=60))
        while True:
            try:
                reply = await nc.request(ROUTE, body, timeout=5)
                decoded = _reply_decoder.decode(reply.data)
            except Exception:
                self.refused += 1
                await asyncio.sleep(0.2)
                continue
            self.accepted.append(decoded.task_id)
            return

    async def load(self, nc: Client) -> None:
        """The tasks, spread over 80 % of the chaos period, ``clients`` at a time."""
        spread_s = self.config.seconds * 0.8
        limit = asyncio.Semaphore(self.config.clients)
        started = time.monotonic()

        async def one(number: int) -> None:
            await asyncio.sleep(
                max(0.0, started + spread_s * number / self.config.tasks - time.monotonic())
            )
            async with limit:
                await self.submit(nc, number)

        await asyncio.gather(*(one(n) for n in range(self.config.tasks)))

    # -- kills -------------------------------------------------------------------------------

    async def monkey(self, until: float) -> None:
        """Kill a random service every ``kill_every_s`` or so, and start it again soon after."""
        while time.monotonic() < until:
            await asyncio.sleep(self.config.kill_every_s * self.rng.uniform(0.5, 1.5))
            up_workers = [w for w in self.workers if w.alive and not w.down]
            candidates = up_workers if len(up_workers) > 1 else []
            if self.config.kill_services:
                candidates += [s for s in self.others if s.alive and not s.down]
            if not candidates:
                continue
            victim = self.rng.choice(candidates)
            victim.kill()
            self.kills[victim.name.split("-")[0]] += 1
            restart = asyncio.create_task(self.restart(victim, self.rng.uniform(0.5, 3.0)))
            self._restarts.add(restart)
            restart.add_done_callback(self._restarts.discard)

    async def restart(self, service: Service, after_s: float) -> None:
        """Start ``service`` again; a worker refused because its old lease is still fresh is
        started again a second later."""
        await asyncio.sleep(after_s)
        while True:
            service.start()
            await asyncio.sleep(EARLY_EXIT_S)
            if service.alive or service.down:
                return
            await asyncio.sleep(1.0)

    async def everyone_up(self) -> None:
        while self._restarts:
            await asyncio.gather(*list(self._restarts), return_exceptions=True)
        for service in [*self.others, *self.workers]:
            if not service.alive:
                await self.restart(service, 0.0)

    # -- run ---------------------------------------------------------------------------------

    async def run(self) -> Report:
        started = time.monotonic()
        nc = await nats.connect(self.nats_url, max_reconnect_attempts=-1)
        js = nc.jetstream()
        await ensure_streams(js)
        sub = await js.subscribe(
            "events.task.>",
            stream=EVENTS_STREAM,
            cb=self.events.on_msg,
            ordered_consumer=True,
            deliver_policy=DeliverPolicy.ALL,
        )
        try:
            await self.wait_routable(nc)
            until = time.monotonic() + self.config.seconds
            monkey = asyncio.create_task(self.monkey(until))
            await self.load(nc)
            await monkey
            await self.everyone_up()
            settled = await self.settle()
            if not settled:
                self.consumers = await consumers(js)
        finally:
            with suppress(Exception):
                await sub.unsubscribe()
            await nc.close()
        return self.report(time.monotonic() - started, settled)

    async def settle(self) -> bool:
        """Wait until every accepted task has a final state (or ``settle_s`` passed)."""
        deadline = time.monotonic() + self.config.settle_s
        while time.monotonic() < deadline:
            if all(self.events.final(t, settled=False) is not None for t in self.accepted):
                await asyncio.sleep(1.0)  # the last stale outcomes, if any, come in
                return True
            await asyncio.sleep(0.5)
        return False

    def _unacked(self) -> list[str]:
        """The tasks first in line, unacknowledged, on each consumer (when the run stuck)."""
        firsts = (c.get("first_unacked") for c in self.consumers.values())
        return [first.split(":", 1)[0] for first in firsts if first]

    def report(self, elapsed_s: float, settled: bool) -> Report:
        verdict = judge(self.events, self.accepted)
        lost = verdict.lost
        by_events = verdict.concurrent_by_worker
        by_backend = {
            f"chaos-w{n + 1}": backend.stats()["concurrent_max"] - 1
            for n, backend in enumerate(self.backends)
            if backend.stats()["concurrent_max"] > 1
        }
        concurrent = {
            w: max(by_events.get(w, 0), by_backend.get(w, 0)) for w in {*by_events, *by_backend}
        }
        accepted = set(self.accepted)
        recorded = {t for t, task in self.events.tasks.items() if task.submitted}
        return Report(
            config=asdict(self.config),
            submitted=len(self.accepted),
            done=verdict.done,
            failed=verdict.failed,
            lost=len(lost),
            lost_tasks=lost[:20],
            concurrent=sum(concurrent.values()),
            concurrent_by_worker=dict(sorted(concurrent.items())),
            concurrent_seen_by={"events": by_events, "backends": by_backend},
            concurrent_examples=verdict.overlap_examples,
            duplicated_answers=len(verdict.answered_twice),
            moved=verdict.moved,
            max_attempts=verdict.max_attempts,
            orphans=len(recorded - accepted),
            kills=dict(sorted(self.kills.items())),
            refused_submissions=self.refused,
            elapsed_s=round(elapsed_s, 1),
            logs=str(self.logs) if not settled else "",
            lost_where=dict(Counter(self.events.tasks.get(t, _Task()).queue for t in lost)),
            lost_histories={
                t: self.events.tasks.get(t, _Task()).kinds for t in [*lost[:5], *self._unacked()]
            },
            consumers=self.consumers,
        )


async def consumers(js: JetStreamContext) -> dict[str, dict[str, Any]]:
    """Each ``TASKS`` consumer's pending, in-flight and waiting pulls: where work sits, and
    which task is the first one not acknowledged."""
    found: dict[str, dict[str, Any]] = {}
    for info in await js.consumers_info(TASKS_STREAM):
        first: str | None = None
        if info.ack_floor is not None and info.config.filter_subject:
            with suppress(Exception):
                raw = await js.get_msg(
                    TASKS_STREAM,
                    seq=info.ack_floor.stream_seq + 1,
                    subject=info.config.filter_subject,
                    next=True,
                )
                message = msgspec.json.decode(raw.data or b"", type=TaskMessage)
                first = f"{message.task_id}:{message.attempt} (seq {raw.seq})"
        found[info.name] = {
            "first_unacked": first,
            "pending": info.num_pending or 0,
            "in_flight": info.num_ack_pending or 0,
            "waiting": info.num_waiting or 0,
            "redelivered": info.num_redelivered or 0,
            "delivered_seq": info.delivered.stream_seq if info.delivered else 0,
            "ack_floor_seq": info.ack_floor.stream_seq if info.ack_floor else 0,
        }
    return found


async def run(config: Config, logs: Path | None = None) -> Report:
    """One chaos run on a nats-server of its own; process logs go to ``logs`` (a temporary
    directory by default, kept and named in the report when the run did not settle)."""
    keep = logs or Path(tempfile.mkdtemp(prefix="coord-chaos-"))
    with running_nats() as server, ExitStack() as stack:
        chaos = Chaos(config, server.url, keep)
        chaos.start_stack(stack)
        report = await chaos.run()
    if not report.ok and not report.logs:
        report.logs = str(keep)
    return report


def render(report: Report) -> str:
    c = report.config
    failed = ", ".join(f"{code} {n}" for code, n in report.failed.items()) or "-"
    kills = ", ".join(f"{name} {n}" for name, n in report.kills.items()) or "-"
    rows = [
        ("submitted", report.submitted),
        ("done", report.done),
        ("failed", f"{sum(report.failed.values())}  ({failed})"),
        ("lost", report.lost),
        ("concurrent on one worker", report.concurrent),
        ("duplicated answers", report.duplicated_answers),
        ("moved (more than one attempt)", report.moved),
        ("most attempts", report.max_attempts),
        ("orphans (acceptance lost)", report.orphans),
        ("kills", kills),
        ("refused submissions retried", report.refused_submissions),
        ("elapsed", f"{report.elapsed_s} s"),
    ]
    head = (
        f"chaos: {c['tasks']} tasks, {c['workers']} workers, {c['seconds']:g} s, "
        f"a kill every ~{c['kill_every_s']:g} s"
    )
    width = max(len(name) for name, _ in rows)
    lines = [head, *(f"  {name:<{width}}  {value}" for name, value in rows)]
    if report.lost_tasks:
        lines.append(f"  lost tasks: {', '.join(report.lost_tasks)}")
        lines.append(f"  last routed to: {report.lost_where}")
        for task_id, kinds in report.lost_histories.items():
            lines.append(f"  {task_id}: {' '.join(kinds)}")
        lines.append(f"  queue consumers at the end: {report.consumers}")
    if report.logs:
        lines.append(f"  process logs: {report.logs}")
    lines.append("OK" if report.ok else "FAILED: tasks lost or run concurrently on one worker")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.chaos", description=__doc__)
    parser.add_argument("--tasks", type=int, default=2000)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=60.0, help="how long the chaos lasts")
    parser.add_argument("--kill-every", type=float, default=2.0, help="seconds between kills")
    parser.add_argument("--settle", type=float, default=120.0, help="seconds to wait at the end")
    parser.add_argument("--backend-delay", type=float, default=0.01)
    parser.add_argument("--clients", type=int, default=8, help="submissions in flight")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--workers-only", action="store_true", help="kill only workers")
    parser.add_argument("--log-level", default="warning", help="the services' LOG_LEVEL")
    args = parser.parse_args(argv)
    config = Config(
        tasks=args.tasks,
        workers=args.workers,
        seconds=args.seconds,
        kill_every_s=args.kill_every,
        settle_s=args.settle,
        backend_delay_s=args.backend_delay,
        clients=args.clients,
        seed=args.seed,
        kill_services=not args.workers_only,
        log_level=args.log_level,
    )
    report = asyncio.run(run(config))
    print(render(report))
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"chaos-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.json"
    figures = {
        "benchmark": "chaos",
        **asdict(report),
        "ok": report.ok,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
    }
    path.write_text(json.dumps(figures, indent=2) + "\n", encoding="utf-8")
    print(f"figures: {path}")
    return 0 if report.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
