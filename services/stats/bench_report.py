"""A bench run's report (pure): its results, the exit status they make, and the lines people
read (the summary table, the slow-worker warnings, the closing line).

The run itself, which asks the fleet and records events, is `bench.Bench`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

from services.errors import BackendTimeout, CoordinatorError, WaitTimeout
from services.stats.baseline import Comparison
from services.stats.bench_prompts import BenchPrompt

EXIT_OK: Final = 0
EXIT_FAILED: Final = 1
EXIT_SLOW: Final = 3


@dataclass(frozen=True)
class Result:
    model: str
    worker: str
    prompt: BenchPrompt
    ok: bool
    total_ms: float | None = None
    load_ms: float | None = None
    task_id: str | None = None
    error: str | None = None
    """Why it failed, for people (and the ``result`` event): ``code: message`` mostly."""
    error_code: str | None = None
    """The code of the failure, for the program (`describe_error`)."""


@dataclass
class BenchReport:
    run_id: str
    results: list[Result] = field(default_factory=list)
    comparisons: list[Comparison] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    """Things that did not stop the run but should be seen (no baseline, event not stored)."""

    @property
    def failed(self) -> int:
        return sum(not r.ok for r in self.results)

    @property
    def slow(self) -> list[Comparison]:
        return [c for c in self.comparisons if c.slow]

    @property
    def exit_status(self) -> int:
        if self.failed:
            return EXIT_FAILED
        return EXIT_SLOW if self.slow else EXIT_OK


def failed_result(model: str, worker: str, prompt: BenchPrompt, error: CoordinatorError) -> Result:
    """The result of a prompt whose request raised ``error``."""
    summary = f"{error.code}: {error.message}"
    return Result(model, worker, prompt, ok=False, error=summary, error_code=error.code)


# Codes a progress line says as ``timed out``.
_TIMEOUTS: Final = frozenset({BackendTimeout.code, WaitTimeout.code})


def describe_error(code: str | None, text: str) -> str:
    """A short reason for a progress line: ``timed out`` for timeouts, else the text."""
    return "timed out" if code in _TIMEOUTS else text


def progress_line(result: Result) -> str:
    """The line printed as a result arrives: ``done 9005ms m (w) [p]`` or ``error - …``."""
    where = f"{result.model} ({result.worker or '-'})"
    if result.ok:
        return f"done {result.total_ms or 0:.0f}ms {where} [{result.prompt.name}]"
    reason = describe_error(result.error_code, result.error or "failed")
    return f"error - {where} {reason} [{result.prompt.name}]"


def table(report: BenchReport) -> list[str]:
    """The summary table, one line per model and worker."""
    rows: dict[tuple[str, str], list[Result]] = {}
    for result in report.results:
        rows.setdefault((result.model, result.worker), []).append(result)
    comparisons = {(c.model, c.worker): c for c in report.comparisons}
    width = max([len(m) for m, _ in rows] + [5])
    lines = [
        f"{'MODEL':<{width}}  {'WORKER':<16} {'DONE':>4} {'FAILED':>6} {'MEDIAN_MS':>10} "
        f"{'BASELINE_MS':>11} {'RATIO':>6}"
    ]
    for (model, worker), results in sorted(rows.items()):
        comparison = comparisons.get((model, worker))
        done = sum(r.ok for r in results)
        median = f"{comparison.median_ms:.0f}" if comparison else "-"
        baseline = (
            f"{comparison.baseline_ms:.0f}"
            if comparison and comparison.baseline_ms is not None
            else "-"
        )
        ratio = f"{comparison.ratio:.2f}x" if comparison and comparison.ratio is not None else "-"
        flag = "  SLOW" if comparison and comparison.slow else ""
        lines.append(
            f"{model:<{width}}  {worker or '-':<16} {done:>4} {len(results) - done:>6} "
            f"{median:>10} {baseline:>11} {ratio:>6}{flag}"
        )
    return lines


def warnings(report: BenchReport) -> list[str]:
    """One line per worker running a model at twice its own baseline or worse."""
    return [
        f"warning: {c.model} on {c.worker} ran at {c.ratio:.1f}x its baseline "
        f"({c.median_ms:.0f} ms against {c.baseline_ms:.0f} ms, the median of its earlier "
        f"clean runs, {c.baseline_runs} or more): is a second instance of {c.worker} running?"
        for c in report.slow
        if c.ratio is not None and c.baseline_ms is not None
    ]


def summary(report: BenchReport) -> str:
    """The closing line: how many prompts were done, failed, and how many workers were slow."""
    done = len(report.results) - report.failed
    return f"bench {report.run_id}: {done} done, {report.failed} failed, {len(report.slow)} slow"
