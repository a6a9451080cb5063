"""The one liveness rule: fresh while younger than the TTL, live while fresh and not stopping."""

from __future__ import annotations

from typing import Any

from schemas.workers import WorkerRecord
from services.fleet.liveness import is_fresh, is_live, live


def record(worker_id: str, heartbeat_at: float, **fields: Any) -> WorkerRecord:
    return WorkerRecord(
        worker_id=worker_id,
        instance_id="i",
        host="h",
        pid=1,
        version="1",
        supports=["cpu_inference"],
        models=[],
        started_at=0.0,
        heartbeat_at=heartbeat_at,
        **fields,
    )


def test_a_heartbeat_is_fresh_until_exactly_the_ttl() -> None:
    assert is_fresh(85.1, now=100.0, ttl_s=15.0)
    assert not is_fresh(85.0, now=100.0, ttl_s=15.0)


def test_a_stopping_worker_is_not_live_however_fresh() -> None:
    running, stopping = record("a", 99.0), record("b", 99.0, state="stopping")
    assert is_live(running, 100.0, 15.0)
    assert not is_live(stopping, 100.0, 15.0)
    assert live([stopping, running, record("c", 80.0)], 100.0, 15.0) == [running]
