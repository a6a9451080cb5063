"""The fault run's verdict (benchmarks/cluster_verdict.py): overlapping generations, the time to
flow again, the longest silence, and the three properties."""

from __future__ import annotations

import dataclasses
from typing import Any

from benchmarks.cluster_verdict import (
    Ask,
    Generation,
    Report,
    flowing_after,
    generations_overlapping,
    longest_silence,
    overlapping,
    render,
)


def test_a_span_that_begins_before_an_earlier_one_ended_overlaps_it() -> None:
    assert overlapping([(0.0, 1.0, "a"), (1.0, 2.0, "b"), (3.0, 4.0, "c")]) == []
    assert overlapping([(0.0, 5.0, "a"), (1.0, 2.0, "b"), (3.0, 4.0, "c")]) == [
        "b began 4.000 s before a ended",
        "c began 2.000 s before a ended",
    ]
    assert overlapping([(2.0, 3.0, "late"), (0.0, 2.5, "early")]) == [
        "late began 0.500 s before early ended"
    ]


def test_one_task_on_two_stand_ins_at_once_and_one_stand_in_running_two_are_told_apart() -> None:
    tasks = {"p1": "t1", "p2": "t2"}
    generations = [
        Generation("host1-ollama1", "p1", 10.0, 12.0),
        Generation("host2-ollama1", "p1", 11.5, 13.0),  # t1 again while it still ran
        Generation("host2-ollama1", "p2", 14.0, None),  # still running: ends "now"
        Generation("host2-ollama1", "probe", 15.0, 15.1),  # no task's: one stand-in, two at once
    ]
    twice, two_at_once = generations_overlapping(generations, tasks, now=20.0)
    assert twice == ["t1 on host2-ollama1 began 0.500 s before t1 on host1-ollama1 ended"]
    assert two_at_once == ["probe on host2-ollama1 began 5.000 s before t2 on host2-ollama1 ended"]

    one_after_another = [
        Generation("host1-ollama1", "p1", 10.0, 12.0),
        Generation("host2-ollama1", "p1", 12.0, 13.0),  # moved after the first stopped
    ]
    assert generations_overlapping(one_after_another, tasks, now=20.0) == ([], [])


def ask(sent_at: float, answered_at: float | None, status: str | None = "done") -> Ask:
    return Ask(f"t{sent_at}", f"p{sent_at}", sent_at, answered_at, status)


def test_flowing_again_is_the_first_task_asked_after_the_fault_and_answered_done() -> None:
    asks = [
        ask(99.0, 100.5),  # asked before the fault: does not count
        ask(100.2, 101.0, "refused"),
        ask(100.4, 103.0),
        ask(101.0, 102.5),
    ]
    assert flowing_after(asks, 100.0) == 2.5
    assert flowing_after(asks[:2], 100.0) is None


def test_the_longest_silence_counts_from_the_fault_to_the_window_end() -> None:
    asks = [ask(0.0, 101.0), ask(0.0, 108.0), ask(0.0, 109.0), ask(0.0, 140.0)]
    assert longest_silence(asks, 100.0, 130.0) == 21.0  # 109 .. 130
    assert longest_silence([], 100.0, 130.0) == 30.0


def test_the_properties_and_what_the_report_says_of_them() -> None:
    report = Report(config={"nodes": 3, "workers_per_host": 1, "rate": 2.0, "generation_s": 0.5})
    assert report.ok
    assert "OK" in render(report).splitlines()[-1]

    faults: tuple[tuple[str, Any], ...] = (
        ("lost", ["t1"]),
        ("unanswered", ["t1"]),
        ("overlapping_generations", ["t1 on a began 1 s before t1 on b ended"]),
        ("standins_running_two", ["x"]),
        ("worker_runs_overlapping", {"w1": 1}),
        ("done_unseen", ["t1"]),
        ("answered_twice", ["t1"]),
        ("wrong_answers", ["t1: told refused (no_worker), yet it ran: done"]),
    )
    for name, value in faults:
        bad = dataclasses.replace(report, **{name: value})
        assert not bad.ok, name
        assert render(bad).splitlines()[-1] == "FAILED"
    assert not Report(config={}, lost=["t"]).all_ended
    assert not Report(config={}, done_unseen=["t"]).never_twice_at_once
    assert not Report(config={}, wrong_answers=["t"]).answered_once
