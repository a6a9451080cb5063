"""The reaper's settings: defaults that move a dead worker's task in under 5 s, checked values."""

from __future__ import annotations

import pytest

from services.errors import ConfigError
from services.reaper.settings import ReaperSettings
from services.router.settings import RouterSettings
from services.runtime.settings import WorkerSettings


def test_the_reaper_judges_liveness_as_the_workers_and_the_router_do() -> None:
    reaper = ReaperSettings.from_env({})
    worker = WorkerSettings.from_env({})
    router = RouterSettings.from_env({})
    assert reaper.worker_ttl_s == worker.worker_ttl_s == router.worker_ttl_s == 3.0
    assert worker.heartbeat_interval_s == 1.0
    # A dead worker is found within a TTL and a look: under the 5 s failover target.
    assert reaper.worker_ttl_s + reaper.reaper_interval_s < 5.0
    assert reaper.ghost_after_s > reaper.worker_ttl_s  # a dead worker's tasks are `dead_worker`'s


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"REAPER_INTERVAL_S": "0"}, "REAPER_INTERVAL_S"),
        ({"GHOST_AFTER_S": "soon"}, "GHOST_AFTER_S='soon'"),
        ({"STUCK_GRACE_S": "-1"}, "STUCK_GRACE_S"),
        ({"DUPLICATE_SAMPLES": "0"}, "DUPLICATE_SAMPLES"),
        ({"MAX_ATTEMPTS": "0"}, "MAX_ATTEMPTS"),
    ],
)
def test_a_malformed_value_is_refused_naming_the_variable(env: dict[str, str], named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        ReaperSettings.from_env(env)
