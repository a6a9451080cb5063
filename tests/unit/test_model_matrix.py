"""The fleet's model matrix (`coordinator models`) from workers and figures: pure."""

from __future__ import annotations

from schemas.models import ModelDetails, ModelFacts
from schemas.queries import WorkerView
from schemas.stats import FigureView
from services.cli.model_table import table
from services.fleet.model_matrix import matrix

NOW = 1_800_000_000.0


def worker(worker_id: str, models: list[str], **fields: object) -> WorkerView:
    return WorkerView(
        worker_id=worker_id,
        host=f"host-{worker_id}",
        tier=str(fields.pop("tier", "cpu")),
        models=models,
        state="idle",
        last_heartbeat=NOW,
        **fields,  # type: ignore[arg-type]
    )


def figure(
    model: str, domain: str, worker_id: str, count: int, speed: float, at: float
) -> FigureView:
    return FigureView(
        model=model,
        domain=domain,
        worker=worker_id,
        count=count,
        failures=0,
        tokens_per_s=speed,
        last_at=at,
    )


def test_speed_is_weighted_over_domains_and_the_last_use_is_the_latest() -> None:
    facts = [
        ModelFacts(
            name="m",
            digest="d1" * 32,
            size=4_200_000_000,
            details=ModelDetails(quantization_level="Q4_K_M"),
        )
    ]
    found = matrix(
        [
            worker("b", ["m"], facts=[ModelFacts(name="m", digest="d2" * 32)], resident=[]),
            worker("a", ["m"], facts=facts, resident=["m"]),
            worker("web-1", ["m"], tier="web"),
            worker("c", ["m"]),
        ],
        [figure("m", "code", "a", 3, 30.0, NOW - 120), figure("m", "chat", "a", 1, 10.0, NOW - 60)],
    )

    (row,) = found.models
    assert [c.worker for c in row.copies] == ["a", "b", "c"]  # the web worker serves no model
    a, b, c = row.copies
    assert (a.tasks, a.tokens_per_s, a.last_used, a.loaded) == (4, 25.0, NOW - 60, True)
    assert (b.tasks, b.tokens_per_s, b.last_used, b.loaded) == (0, None, None, False)
    assert c.loaded is None  # it does not say what its backend holds
    assert row.digests_differ  # c has no digest: not counted as a third copy
    lines = table(found, now=NOW)
    assert lines[1].split() == [
        "m",
        "a",
        "4.2",
        "GB",
        "Q4_K_M",
        ("d1" * 6),
        "yes",
        "1",
        "min",
        "ago",
        "25.0",
        "tok/s",
    ]
    assert lines[-1].startswith("  ! m differs by digest between workers: a d1d1")


def test_without_figures_last_use_is_unknown_not_never() -> None:
    lines = table(matrix([worker("a", ["m"])], None), now=NOW)

    assert lines[1].split()[-2:] == ["?", "-"]
    assert lines[-1].startswith("(the stats service did not answer")
    assert table(matrix([], [])) == ["no live worker serves a model"]
