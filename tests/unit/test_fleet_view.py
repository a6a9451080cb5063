from __future__ import annotations

from collections import Counter

from services.fleet.figures import Figure, Figures, Queued, decode_figure
from services.fleet.policy import PRIOR_COLD_LOAD_MS
from services.router.view import FleetView


def test_typical_durations_fall_back_from_own_domain_to_own_model_to_peers() -> None:
    figures = Figures()
    figures.put("m", "code", "a", Figure(typical_ms=1_000.0, recent_failure_rate=0.0))
    figures.put("m", "math", "b", Figure(typical_ms=4_000.0, recent_failure_rate=0.1))
    figures.put("m", "code", "c", Figure(typical_ms=3_000.0, recent_failure_rate=0.0))

    typical = figures.estimates("m", "code", ["a", "b", "d"], {}).typical_ms

    assert typical["a"] == 1_000.0  # its own figure for the domain
    assert typical["b"] == 4_000.0  # its figure for the model in another domain
    assert typical["d"] == 2_000.0  # new worker: the median of the peers' figures
    assert figures.estimates("m", "math", ["b", "a"], {}).failure_rate == {"b": 0.1}
    # A new figure counts at once, in the fallbacks too.
    figures.put("m", "math", "b", Figure(typical_ms=8_000.0, recent_failure_rate=0.1))
    figures.put("m", "code", "e", Figure(typical_ms=9_000.0, recent_failure_rate=0.0))
    typical = figures.estimates("m", "code", ["b", "d"], {}).typical_ms
    assert typical == {"b": 8_000.0, "d": 3_000.0}


def test_with_no_figures_for_the_model_nobody_gets_a_typical_duration() -> None:
    figures = Figures()
    figures.put("other", "code", "a", Figure(typical_ms=1_000.0, recent_failure_rate=0.0))
    estimates = figures.estimates("m", "code", ["a"], {})
    assert (estimates.typical_ms, estimates.warm_ms, estimates.cold_load_ms) == ({}, {}, {})


def test_warm_durations_and_cold_loads_have_their_own_fallbacks() -> None:
    figures = Figures()
    old = Figure(typical_ms=2_000.0, recent_failure_rate=0.0)  # a stats service without warm
    figures.put("m", "code", "a", old)
    both = Figure(typical_ms=9_000.0, recent_failure_rate=0.0, warm_ms=1_000.0)
    figures.put("m", "code", "b", both)
    figures.put("m", "code", "c", Figure(1_000.0, 0.0, cold_load_ms=4_000.0))
    figures.put("m", "math", "c", Figure(1_000.0, 0.0, cold_load_ms=6_000.0))
    figures.put("m", "code", "d", Figure(1_000.0, 0.0, cold_load_ms=20_000.0))

    estimates = figures.estimates("m", "code", ["a", "b", "c", "e"], {})
    assert estimates.warm_ms == {"a": 2_000.0, "b": 1_000.0, "c": 1_000.0, "e": 1_000.0}
    # Loads do not depend on the domain: c's own over its domains, else everyone's.
    everyone = 6_000.0  # the median of 4 s, 6 s and 20 s
    assert estimates.cold_load_ms == {"a": everyone, "b": everyone, "c": 5_000.0, "e": everyone}


def test_queued_work_is_each_tasks_typical_duration_on_its_worker() -> None:
    figures = Figures()
    figures.put("big", "code", "a", Figure(typical_ms=30_000.0, recent_failure_rate=0.0))
    figures.put("m", "code", "a", Figure(typical_ms=1_000.0, recent_failure_rate=0.0))
    queued: Queued = {
        "a": Counter({("big", "code"): 1, (None, None): 2}),  # two tasks of unknown model
        "b": Counter({("never-seen", "code"): 1}),
    }
    ahead = figures.queued_ms("m", "code", ["a", "b", "c"], queued)
    # Unknown models count as the task routed; a model without figures as the prior.
    assert sorted(ahead["a"]) == [1_000.0, 1_000.0, 30_000.0]
    assert ahead["b"] == [1_000.0] and "c" not in ahead
    # And the models to load for them, each once, with its cold-load time (else the prior).
    figures.put("big", "math", "a", Figure(30_000.0, 0.0, cold_load_ms=9_000.0))
    estimates = figures.estimates("m", "code", ["a", "b"], queued)
    assert estimates.queued_loads == {
        "a": {"big": 9_000.0},
        "b": {"never-seen": PRIOR_COLD_LOAD_MS},
    }
    # Any model's, asked of a load that pushes it out: its own, else everyone's, else the prior.
    figures.put("big", "code", "c", Figure(30_000.0, 0.0, cold_load_ms=5_000.0))
    assert estimates.cold_load_of("big", "a") == 9_000.0
    assert estimates.cold_load_of("big", "b") == 7_000.0  # the median of a's and c's
    assert estimates.cold_load_of("never-seen", "a") == PRIOR_COLD_LOAD_MS


def test_a_stats_bucket_value_is_read_with_its_routing_fields() -> None:
    data = (
        b'{"model":"m","domain":"code","worker":"a","count":3,"failures":0,"recent_count":3,'
        b'"recent_failure_rate":0.25,"typical_ms":900.0,"warm_ms":700.0,"cold_load_ms":4000.0,'
        b'"last_at":1.0,"updated_at":2.0}'
    )
    assert decode_figure(data) == ("m", "code", "a", Figure(900.0, 0.25, 700.0, 4000.0))


def test_in_flight_tasks_count_per_worker_until_they_end_or_expire() -> None:
    view = FleetView()
    view.routed("t1", "a", at=100.0, model="m", domain="code")
    view.routed("t2", "a", at=150.0)
    view.routed("t3", "b", at=150.0, model="m", domain="code")
    view.ended("t3")
    assert view.depth() == {"a": 2}
    assert view.queued() == {"a": Counter({("m", "code"): 1, (None, None): 1})}
    view.expire(now=200.0, max_age_s=60.0)
    assert view.depth() == {"a": 1}
    view.routed("t2", "b", at=210.0, model="m", domain="math")  # moved on
    assert view.queued() == {"b": Counter({("m", "math"): 1})}
