"""The nightly benchmark's judgement, pure: is a worker running a model far slower than usual?

That is how the duplicate-worker incident (lesson 2) was found: every benchmark of one worker
took twice as long, for two nights. A worker's *baseline* for a model is the median total
duration of each prompt over its earlier clean runs (excluded periods left out, so a polluted
night does not become the norm). Tonight's run is compared prompt by prompt with that
baseline; the worker's ratio for the model is the median of those ratios, and a ratio of
`SLOW_FACTOR` or more is a warning. Prompts without a baseline (new prompt, new worker) are
shown but not judged.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Final

SLOW_FACTOR: Final = 2.0


@dataclass(frozen=True, slots=True)
class Sample:
    """One done prompt of tonight's run."""

    model: str
    worker: str
    prompt_key: str
    total_ms: float


@dataclass(frozen=True, slots=True)
class PromptBaseline:
    median_ms: float
    runs: int


@dataclass(frozen=True, slots=True)
class Comparison:
    """A model on a worker tonight, against its own baseline."""

    model: str
    worker: str
    median_ms: float
    """Median total duration of tonight's done prompts."""
    baseline_ms: float | None
    """Median of the baselines of the prompts that have one; None when none has."""
    ratio: float | None
    """Median of tonight/baseline over prompts with a baseline."""
    baseline_runs: int
    """The fewest earlier runs behind any baseline used (0 when none)."""

    @property
    def slow(self) -> bool:
        """Twice its own baseline or worse."""
        return self.ratio is not None and self.ratio >= SLOW_FACTOR


def compare(
    samples: Iterable[Sample], baselines: Mapping[tuple[str, str, str], PromptBaseline]
) -> list[Comparison]:
    """One `Comparison` per (model, worker) in ``samples``, ordered by model then worker.

    ``baselines`` is keyed by ``(model, worker, prompt_key)``.
    """
    groups: dict[tuple[str, str], list[Sample]] = {}
    for sample in samples:
        groups.setdefault((sample.model, sample.worker), []).append(sample)
    comparisons = []
    for (model, worker), group in sorted(groups.items()):
        ratios: list[float] = []
        used: list[PromptBaseline] = []
        for sample in group:
            baseline = baselines.get((model, worker, sample.prompt_key))
            if baseline is None or baseline.median_ms <= 0:
                continue
            ratios.append(sample.total_ms / baseline.median_ms)
            used.append(baseline)
        comparisons.append(
            Comparison(
                model=model,
                worker=worker,
                median_ms=statistics.median(s.total_ms for s in group),
                baseline_ms=statistics.median(b.median_ms for b in used) if used else None,
                ratio=statistics.median(ratios) if ratios else None,
                baseline_runs=min((b.runs for b in used), default=0),
            )
        )
    return comparisons
