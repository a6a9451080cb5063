"""The verdict of a fault run (`benchmarks.cluster_chaos`), from what its clients were told, the
event log (`benchmarks.chaos.judge`) and the stand-ins' records of their generations; pure.

Three properties: every task the clients asked for **ended** (done or an explicit failure, and
every client was answered), none ran **twice at once** (no two generations of one task
overlapping on any stand-ins, no stand-in running two, no worker's runs overlapping in the
log, and every task done has its generation on record), and none was **answered twice** (one
``completed`` per task, and no client told what the log contradicts: a refusal or failure for
a task that then ran, or another task's answer).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Final

from benchmarks.chaos import MODEL

# The test hosts a run makes.
HOSTS: Final = 3


@dataclass
class Ask:
    """One task a client asked for, and what it was told."""

    task_id: str
    prompt: str
    sent_at: float
    answered_at: float | None = None
    status: str | None = None
    """``done``, ``failed``, or ``refused`` (a coded error reply before it was recorded)."""
    code: str | None = None
    response: str | None = None
    retries: int = 0
    error: str | None = None
    """Why the client gave up, or the message of a refusal."""


@dataclass(frozen=True)
class Generation:
    """One generation as a stand-in recorded it (wall clock)."""

    standin: str
    prompt: str | None
    started_at: float
    ended_at: float | None


@dataclass
class Report:
    """One run: counts, the tasks behind each failed property, the figures."""

    config: dict[str, Any]
    asked: int = 0
    recorded: int = 0
    done: int = 0
    failed: dict[str, int] = field(default_factory=dict)
    refused: dict[str, int] = field(default_factory=dict)
    lost: list[str] = field(default_factory=list)
    """Recorded, with no final state in the log."""
    unanswered: list[str] = field(default_factory=list)
    """The client got no answer (or one for a task the log does not hold)."""
    overlapping_generations: list[str] = field(default_factory=list)
    standins_running_two: list[str] = field(default_factory=list)
    worker_runs_overlapping: dict[str, int] = field(default_factory=dict)
    done_unseen: list[str] = field(default_factory=list)
    """Tasks done with no generation in the stand-ins' records: the records are not whole,
    and "never twice at once" could not be judged for them."""
    answered_twice: list[str] = field(default_factory=list)
    wrong_answers: list[str] = field(default_factory=list)
    """A client told what the log contradicts: done with another task's answer, or a failure
    or a refusal for a task that then ran and was done (one id, two answers)."""
    moved: int = 0
    max_attempts: int = 0
    generations: int = 0
    client_retries: int = 0
    killed: str = ""
    cut: str = ""
    kill_to_flowing_s: float | None = None
    cut_to_flowing_s: float | None = None
    longest_silence_after_kill_s: float | None = None
    longest_silence_after_cut_s: float | None = None
    throughput: dict[str, float] = field(default_factory=dict)
    timeline: list[str] = field(default_factory=list)
    problems: dict[str, dict[str, Any]] = field(default_factory=dict)
    """A few tasks behind each failed property, refusal or retry: what the client saw and
    the task's history in the log."""
    elapsed_s: float = 0.0
    load: list[float] = field(default_factory=list)
    logs: str = ""

    @property
    def all_ended(self) -> bool:
        """Every task ended (done or an explicit failure) and every client was answered."""
        return not self.lost and not self.unanswered

    @property
    def never_twice_at_once(self) -> bool:
        """No task ran twice at once, judged on every done task's generations."""
        return not (
            self.overlapping_generations
            or self.standins_running_two
            or self.worker_runs_overlapping
            or self.done_unseen
        )

    @property
    def answered_once(self) -> bool:
        """No task answered twice, and no client told what the log contradicts."""
        return not self.answered_twice and not self.wrong_answers

    @property
    def ok(self) -> bool:
        """All three properties hold."""
        return self.all_ended and self.never_twice_at_once and self.answered_once


# -- pure judging ----------------------------------------------------------------------------


def overlapping(spans: Iterable[tuple[float, float, str]]) -> list[str]:
    """Of ``(start, end, label)`` spans, each one that began before an earlier one ended, said
    as "<label> began <s> before <earlier label> ended"."""
    found: list[str] = []
    latest_end, latest = float("-inf"), ""
    for start, end, label in sorted(spans):
        if start < latest_end:
            found.append(f"{label} began {latest_end - start:.3f} s before {latest} ended")
        if end > latest_end:
            latest_end, latest = end, label
    return found


def generations_overlapping(
    generations: Iterable[Generation], tasks: dict[str, str], now: float
) -> tuple[list[str], list[str]]:
    """Two generations of one task at once (on any stand-ins), and two generations at once on
    one stand-in (any tasks). ``tasks`` maps a prompt to its task; a generation still running
    ends ``now``."""
    by_task: dict[str, list[tuple[float, float, str]]] = {}
    by_standin: dict[str, list[tuple[float, float, str]]] = {}
    for g in generations:
        end = g.ended_at if g.ended_at is not None else now
        task = tasks.get(g.prompt or "")
        label = f"{task or g.prompt} on {g.standin}"
        by_standin.setdefault(g.standin, []).append((g.started_at, end, label))
        if task is not None:
            by_task.setdefault(task, []).append((g.started_at, end, label))
    twice = [o for spans in by_task.values() for o in overlapping(spans)]
    two_at_once = [o for spans in by_standin.values() for o in overlapping(spans)]
    return twice, two_at_once


def flowing_after(asks: Iterable[Ask], at: float) -> float | None:
    """Seconds from ``at`` until a task first asked for after it was answered done."""
    answered = [
        a.answered_at
        for a in asks
        if a.sent_at >= at and a.status == "done" and a.answered_at is not None
    ]
    return round(min(answered) - at, 2) if answered else None


def longest_silence(asks: Iterable[Ask], start: float, end: float) -> float:
    """The longest time within [start, end] without any answer done."""
    times = sorted(
        a.answered_at
        for a in asks
        if a.status == "done" and a.answered_at is not None and start <= a.answered_at <= end
    )
    edges = [start, *times, end]
    return round(max(b - a for a, b in itertools.pairwise(edges)), 2)


def expected_response(prompt: str) -> str:
    """What the stand-in answers ``prompt`` with."""
    return f"Echo from {MODEL}: {prompt}"


def _examples(items: list[str], n: int = 5) -> str:
    return "; ".join(items[:n]) + (f" … ({len(items)} in all)" if len(items) > n else "")


def render(report: Report, single: Report | None = None) -> str:
    """The run as people read it: the properties, the figures, the timeline."""
    c = report.config
    failed = ", ".join(f"{code} {n}" for code, n in report.failed.items()) or "-"
    refused = ", ".join(f"{code} {n}" for code, n in report.refused.items()) or "-"
    rows: list[tuple[str, object]] = [
        ("tasks asked for", report.asked),
        ("recorded by a router", report.recorded),
        ("done", report.done),
        ("failed (explicitly)", f"{sum(report.failed.values())}  ({failed})"),
        ("refused before recording", f"{sum(report.refused.values())}  ({refused})"),
        ("lost (no final state)", len(report.lost)),
        ("clients unanswered", len(report.unanswered)),
        ("generations of one task at once", len(report.overlapping_generations)),
        ("stand-ins running two at once", len(report.standins_running_two)),
        ("workers' runs overlapping (log)", sum(report.worker_runs_overlapping.values())),
        ("done, no generation on record", len(report.done_unseen)),
        ("answered twice", len(report.answered_twice)),
        ("answers the log contradicts", len(report.wrong_answers)),
        ("moved (more than one attempt)", report.moved),
        ("most attempts", report.max_attempts),
        ("generations recorded", report.generations),
        ("clients' asks again (errors)", report.client_retries),
    ]
    if report.killed:
        rows += [
            ("killed whole", report.killed),
            ("kill → a new task answered done", _seconds(report.kill_to_flowing_s)),
            ("longest without an answer (kill)", _seconds(report.longest_silence_after_kill_s)),
        ]
    if report.cut:
        rows += [
            (f"cut off for {c['cut_s']:g} s", report.cut),
            ("cut → a new task answered done", _seconds(report.cut_to_flowing_s)),
            ("longest without an answer (cut)", _seconds(report.longest_silence_after_cut_s)),
        ]
    for name, run in (("cluster", report), ("single server", single)):
        if run is not None and run.throughput:
            t = run.throughput
            rows.append(
                (
                    f"throughput, {name}",
                    f"{t['tasks_per_s']} tasks/s (p50 {t['p50_ms']} ms, p99 {t['p99_ms']} ms, "
                    f"{t['clients']:g} clients)",
                )
            )
    rows += [("elapsed", f"{report.elapsed_s} s"), ("load average", report.load)]
    head = (
        f"cluster chaos: {c['nodes']} nodes on {HOSTS} test hosts, {c['workers_per_host']} "
        f"workers each, {c['rate']:g} tasks/s, generations of ~{c['generation_s']:g} s, "
        + (f"faults on the {c.get('victim', 'leader')}" if c.get("faults", True) else "no faults")
    )
    width = max(len(name) for name, _ in rows)
    lines = [head, *(f"  {name:<{width}}  {value}" for name, value in rows)]
    for name, items in (
        ("lost", report.lost),
        ("unanswered", report.unanswered),
        ("one task twice at once", report.overlapping_generations),
        ("a stand-in running two", report.standins_running_two),
        ("answered twice", report.answered_twice),
        ("wrong answers", report.wrong_answers),
    ):
        if items:
            lines.append(f"  {name}: {_examples(items)}")
    for task_id, problem in report.problems.items():
        lines.append(f"  {task_id}: {problem}")
    if report.worker_runs_overlapping:
        lines.append(f"  workers' overlapping runs: {report.worker_runs_overlapping}")
    if report.logs:
        lines.append(f"  process logs: {report.logs}")
    verdicts = (
        ("every task ended (done or an explicit failure)", report.all_ended),
        ("none ran twice at once", report.never_twice_at_once),
        ("none was answered twice (nor told what the log contradicts)", report.answered_once),
    )
    lines += [f"  {'yes' if ok else 'NO '}  {what}" for what, ok in verdicts]
    lines.append("OK" if report.ok else "FAILED")
    return "\n".join(lines)


def _seconds(value: float | None) -> str:
    return "never" if value is None else f"{value:g} s"
