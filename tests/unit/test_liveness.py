"""The one liveness rule: fresh while younger than the TTL, live while fresh and not stopping."""

from __future__ import annotations

from typing import Any

from nats.js.api import PeerInfo

from schemas.workers import WorkerRecord
from services.fleet.liveness import in_touch, is_fresh, is_live, live, stale_in
from services.runtime.stall import leader_cut_off


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


def test_a_heartbeat_goes_stale_when_its_seconds_until_stale_run_out() -> None:
    assert stale_in(90.0, now=100.0, ttl_s=15.0) == 5.0
    assert is_fresh(90.0, now=100.0 + 4.9, ttl_s=15.0)
    assert not is_fresh(90.0, now=100.0 + 5.0, ttl_s=15.0)
    assert stale_in(80.0, now=100.0, ttl_s=15.0) <= 0  # stale already


def test_a_stopping_worker_is_not_live_however_fresh() -> None:
    running, stopping = record("a", 99.0), record("b", 99.0, state="stopping")
    assert is_live(running, 100.0, 15.0)
    assert not is_live(stopping, 100.0, 15.0)
    assert live([stopping, running, record("c", 80.0)], 100.0, 15.0) == [running]


def test_a_worker_stays_in_touch_until_one_interval_before_its_entry_goes_stale() -> None:
    # TTL 3 s, heartbeats every 1 s: others judge the entry stale 3 s after it was written,
    # so the worker stops working 2 s after it, one interval ahead.
    assert in_touch(100.0, 101.9, ttl_s=3.0, interval_s=1.0)
    assert not in_touch(100.0, 102.0, ttl_s=3.0, interval_s=1.0)
    assert not in_touch(100.0, 110.0, ttl_s=3.0, interval_s=1.0)
    # Always before anyone else may say it is not fresh.
    for now in (101.0, 101.5, 101.99):
        assert is_fresh(100.0, now + 1.0, 3.0) == in_touch(100.0, now, 3.0, 1.0)


def test_a_stream_leader_that_hears_none_of_its_replicas_is_cut_off() -> None:
    heard = PeerInfo(name="n2", current=True, active=int(0.5e9))
    silent = PeerInfo(name="n3", current=True, active=int(2.5e9))
    gone = PeerInfo(name="n3", current=False, offline=True)
    assert not leader_cut_off([heard, silent])  # one still hears it: a quorum
    assert not leader_cut_off([heard, gone])
    assert leader_cut_off([silent, gone])  # cut off from both: it stores nothing that stays
    assert not leader_cut_off([])  # a stream of one copy has no replicas to hear
