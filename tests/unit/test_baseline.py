"""The bench's judgement: a worker far slower than its own baseline is a warning."""

from __future__ import annotations

from services.stats.baseline import SLOW_FACTOR, Comparison, PromptBaseline, Sample, compare


def sample(worker: str, prompt: str, ms: float, model: str = "gemma3:1b") -> Sample:
    return Sample(model=model, worker=worker, prompt_key=prompt, total_ms=ms)


def test_twice_the_baseline_is_slow() -> None:
    baselines = {("gemma3:1b", "esxi", "p1"): PromptBaseline(median_ms=4500.0, runs=5)}

    [comparison] = compare([sample("esxi", "p1", 9000.0)], baselines)

    assert comparison == Comparison(
        model="gemma3:1b",
        worker="esxi",
        median_ms=9000.0,
        baseline_ms=4500.0,
        ratio=2.0,
        baseline_runs=5,
    )
    assert comparison.slow
    assert SLOW_FACTOR == 2.0


def test_a_little_slower_is_not_slow() -> None:
    baselines = {("gemma3:1b", "esxi", "p1"): PromptBaseline(4500.0, 5)}

    [comparison] = compare([sample("esxi", "p1", 8000.0)], baselines)

    assert not comparison.slow


def test_the_ratio_is_the_median_over_prompts_so_one_odd_prompt_does_not_decide() -> None:
    baselines = {
        ("gemma3:1b", "esxi", "p1"): PromptBaseline(1000.0, 3),
        ("gemma3:1b", "esxi", "p2"): PromptBaseline(2000.0, 4),
        ("gemma3:1b", "esxi", "p3"): PromptBaseline(500.0, 2),
    }
    samples = [
        sample("esxi", "p1", 1100.0),
        sample("esxi", "p2", 2000.0),
        sample("esxi", "p3", 5000.0),  # 10x, but alone
    ]

    [comparison] = compare(samples, baselines)

    assert comparison.ratio == 1.1
    assert not comparison.slow
    assert comparison.baseline_runs == 2


def test_without_a_baseline_there_is_no_judgement() -> None:
    [comparison] = compare([sample("new-box", "p1", 9000.0)], {})

    assert (comparison.ratio, comparison.baseline_ms, comparison.baseline_runs) == (None, None, 0)
    assert not comparison.slow


def test_one_comparison_per_model_and_worker_each_against_its_own_baseline() -> None:
    baselines = {
        ("gemma3:1b", "esxi", "p1"): PromptBaseline(1000.0, 3),
        ("gemma3:1b", "mac", "p1"): PromptBaseline(300.0, 3),
        ("qwen3:8b", "mac", "p1"): PromptBaseline(2000.0, 3),
    }
    samples = [
        sample("mac", "p1", 600.0),  # 2x its own baseline, though faster than esxi's
        sample("esxi", "p1", 1000.0),
        sample("mac", "p1", 2100.0, model="qwen3:8b"),
    ]

    comparisons = compare(samples, baselines)

    assert [(c.model, c.worker, c.slow) for c in comparisons] == [
        ("gemma3:1b", "esxi", False),
        ("gemma3:1b", "mac", True),
        ("qwen3:8b", "mac", False),
    ]
