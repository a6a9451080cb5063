"""The nightly bench's history per worker, folded from its events (``events.bench.>``), for
the dashboard's chart. Pure: no I/O.

A run's point for a model on a worker is the median total duration of its done prompts (as
the bench's own table has it). Whether it was slow is the bench's own verdict, recorded in
its ``bench_finished`` event (twice its baseline or worse), never judged again here. The
baseline drawn beside the points is the stats service's (``coordinator.stats.baselines``:
per prompt, the median of the earlier clean runs), summed up per model and worker as the
bench does: the median over the prompts.
"""

from __future__ import annotations

import statistics
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Final

import msgspec

from schemas.events import AnyEvent, BenchFinished, BenchResult, BenchStarted
from schemas.stats import Baseline

# Runs kept: about half a year of nightly runs.
RUNS: Final = 200


class BenchPoint(msgspec.Struct, frozen=True, kw_only=True):
    run_id: str
    at: float
    median_ms: float | None
    """None when no prompt of the run was done on this worker."""
    done: int
    failed: int
    slow: bool


class BenchSeries(msgspec.Struct, frozen=True, kw_only=True):
    model: str
    worker: str
    baseline_ms: float | None
    points: list[BenchPoint]


@dataclass
class _Run:
    run_id: str
    at: float
    finished: bool = False
    slow: frozenset[str] = frozenset()
    totals: dict[tuple[str, str], list[float]] = field(default_factory=dict)
    failed: dict[tuple[str, str], int] = field(default_factory=dict)


def slow_label(model: str, worker: str) -> str:
    """How ``bench_finished`` names a slow model on a worker (`BenchFinished.slow`)."""
    return f"{model} ({worker})"


@dataclass
class BenchHistory:
    """Every run read, in the log's order (the oldest dropped past `RUNS`)."""

    runs: OrderedDict[str, _Run] = field(default_factory=OrderedDict)

    def apply(self, event: AnyEvent) -> bool:
        """Fold one event in; whether it was a bench event."""
        match event:
            case BenchStarted():
                self._run(event.run_id, event.at)
            case BenchResult():
                run = self._run(event.run_id, event.at)
                key = (event.model, event.worker)
                if event.ok and event.total_ms is not None:
                    run.totals.setdefault(key, []).append(event.total_ms)
                else:
                    run.failed[key] = run.failed.get(key, 0) + 1
            case BenchFinished():
                run = self._run(event.run_id, event.at)
                run.finished, run.slow = True, frozenset(event.slow)
            case _:
                return False
        return True

    def _run(self, run_id: str, at: float) -> _Run:
        run = self.runs.get(run_id)
        if run is None:
            run = self.runs[run_id] = _Run(run_id, at)
            while len(self.runs) > RUNS:
                self.runs.popitem(last=False)
        return run

    def models(self) -> list[str]:
        """Every model a kept run measured (what to ask the baselines of)."""
        return sorted({model for run in self.runs.values() for model, _ in run.totals})

    def series(self, baselines: Iterable[Baseline]) -> list[BenchSeries]:
        """One series per model and worker, its runs oldest first."""
        per_prompt: dict[tuple[str, str], list[float]] = {}
        for b in baselines:
            per_prompt.setdefault((b.model, b.worker), []).append(b.median_ms)
        keys = sorted({key for run in self.runs.values() for key in (*run.totals, *run.failed)})
        out = []
        for model, worker in keys:
            if not worker:
                continue  # a prompt no worker could take: no worker to chart it under
            points = [
                BenchPoint(
                    run_id=run.run_id,
                    at=run.at,
                    median_ms=statistics.median(totals) if totals else None,
                    done=len(totals),
                    failed=run.failed.get((model, worker), 0),
                    slow=slow_label(model, worker) in run.slow,
                )
                for run in self.runs.values()
                if (totals := run.totals.get((model, worker), [])) or (model, worker) in run.failed
            ]
            medians = per_prompt.get((model, worker))
            baseline = statistics.median(medians) if medians else None
            out.append(BenchSeries(model=model, worker=worker, baseline_ms=baseline, points=points))
        return out
