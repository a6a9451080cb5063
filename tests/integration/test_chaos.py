"""A small run of the chaos harness (benchmarks/chaos.py): services killed with SIGKILL at
random while tasks flow; nothing may be lost and nothing may run twice at once on a worker."""

from __future__ import annotations

from pathlib import Path

from benchmarks.chaos import Config, render, run


async def test_under_chaos_no_task_is_lost_and_none_runs_concurrently_on_one_worker(
    tmp_path: Path,
) -> None:
    config = Config(tasks=100, workers=3, seconds=10, kill_every_s=2.5, settle_s=40, seed=7)

    report = await run(config, logs=tmp_path)

    assert report.submitted == 100
    assert report.lost == 0, render(report)
    assert report.concurrent == 0, render(report)
    assert report.done + sum(report.failed.values()) == 100
    assert sum(report.kills.values()) >= 2
