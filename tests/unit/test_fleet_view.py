from __future__ import annotations

from services.router.view import Figure, FleetView


def test_typical_durations_fall_back_from_own_domain_to_own_model_to_peers() -> None:
    view = FleetView()
    view.put_figure("m", "code", "a", Figure(typical_ms=1_000.0, recent_failure_rate=0.0))
    view.put_figure("m", "math", "b", Figure(typical_ms=4_000.0, recent_failure_rate=0.1))
    view.put_figure("m", "code", "c", Figure(typical_ms=3_000.0, recent_failure_rate=0.0))

    typical = view.typical_ms("m", "code", ["a", "b", "d"])

    assert typical["a"] == 1_000.0  # its own figure for the domain
    assert typical["b"] == 4_000.0  # its figure for the model in another domain
    assert typical["d"] == 2_000.0  # new worker: the median of the peers' figures
    assert view.failure_rate("m", "math", ["b", "a"]) == {"b": 0.1}


def test_with_no_figures_for_the_model_nobody_gets_a_typical_duration() -> None:
    view = FleetView()
    view.put_figure("other", "code", "a", Figure(typical_ms=1_000.0, recent_failure_rate=0.0))
    assert view.typical_ms("m", "code", ["a"]) == {}


def test_in_flight_tasks_count_per_worker_until_they_end_or_expire() -> None:
    view = FleetView()
    view.routed("t1", "a", at=100.0)
    view.routed("t2", "a", at=150.0)
    view.routed("t3", "b", at=150.0)
    view.ended("t3")
    assert view.depth() == {"a": 2}
    view.expire(now=200.0, max_age_s=60.0)
    assert view.depth() == {"a": 1}
