"""The settling of a registry view: no verdict that a worker is not live on a stale view."""

from __future__ import annotations

from typing import Any

from schemas.workers import WorkerRecord
from services.fleet.settling import (
    SettlingTracker,
    awaited_after_outage,
    begin,
    gone,
    heard,
    is_quiet,
    is_settled,
    read_in_full,
    retry_after_s,
)

TTL = 3.0


def record(worker_id: str, heartbeat_at: float, **fields: Any) -> WorkerRecord:
    return WorkerRecord(
        worker_id=worker_id,
        instance_id="i",
        host="h",
        pid=1,
        version="1",
        supports=["cpu_inference"],
        models=["m"],
        started_at=0.0,
        heartbeat_at=heartbeat_at,
        **fields,
    )


def test_a_fresh_start_settles_at_the_first_full_read_of_the_bucket() -> None:
    start = begin(0, now=100.0)
    assert not is_settled(start, 100.0, TTL)
    assert is_settled(read_in_full(start, 0), 100.0, TTL)


def test_a_read_on_an_older_connection_does_not_count() -> None:
    assert not is_settled(read_in_full(begin(2, now=100.0), 1), 200.0, TTL)


def test_after_a_reconnect_it_waits_for_the_workers_live_before_or_a_ttl() -> None:
    settling = read_in_full(begin(1, now=100.0, awaited={"a": 95.0, "b": 95.5}), 1)
    assert not is_settled(settling, 100.0, TTL)
    # The re-read hands back the last value from before the outage: no news.
    assert heard(settling, record("a", 95.0)) == settling
    settling = heard(settling, record("a", 100.4))
    assert not is_settled(settling, 100.5, TTL)
    settling = heard(settling, record("b", 100.6))
    assert is_settled(settling, 100.7, TTL)
    # A worker that never comes back is dead by the one rule once a TTL has passed.
    silent = read_in_full(begin(1, now=100.0, awaited={"a": 95.0}), 1)
    assert not is_settled(silent, 102.9, TTL)
    assert is_settled(silent, 103.0, TTL)


def test_a_deregistered_worker_is_news_too() -> None:
    settling = read_in_full(begin(1, now=100.0, awaited={"a": 95.0}), 1)
    assert is_settled(gone(settling, "a"), 100.1, TTL)


def test_the_workers_awaited_are_those_live_when_the_bus_went_quiet() -> None:
    # The outage began after the newest heartbeat seen, however long it lasted.
    records = [
        record("a", 50.0),
        record("b", 49.0),
        record("dead", 40.0),
        record("leaving", 50.0, state="stopping"),
    ]
    assert awaited_after_outage(records, TTL) == {"a": 50.0, "b": 49.0}
    assert awaited_after_outage([], TTL) == {}


def test_the_retry_hint_is_the_time_left_in_whole_seconds_and_at_least_one() -> None:
    settling = begin(1, now=100.0, awaited={"a": 95.0})
    assert retry_after_s(settling, 100.2, TTL) == 3
    assert retry_after_s(settling, 102.5, TTL) == 1
    assert retry_after_s(settling, 110.0, TTL) == 1


def test_the_tracker_settles_again_on_each_new_connection_only() -> None:
    tracker = SettlingTracker(0, now=10.0)
    tracker.read(0)
    assert tracker.settled(10.0, TTL)
    tracker.put(record("a", 9.5))
    assert not tracker.reconnected(0, 11.0, [record("a", 9.5)], TTL)
    assert tracker.reconnected(1, 20.0, [record("a", 9.5)], TTL)
    assert not tracker.settled(20.0, TTL)
    tracker.read(1)
    assert not tracker.settled(20.0, TTL)  # "a" not heard from since
    tracker.put(record("a", 20.1))
    assert tracker.settled(20.2, TTL)


def test_the_tracker_remembers_a_read_reported_before_the_reconnect_is_noticed() -> None:
    tracker = SettlingTracker(0, now=10.0)
    tracker.read(0)
    tracker.read(1)  # the watch started again and read the bucket first
    assert tracker.reconnected(1, 20.0, [], TTL)
    assert tracker.settled(20.0, TTL)


def test_a_start_can_wait_for_workers_named_elsewhere() -> None:
    # The reaper: workers holding open tasks that the registry does not show live.
    tracker = SettlingTracker(0, now=10.0)
    tracker.read(0)
    tracker.wait_for(10.0, {"a": float("-inf")})
    assert not tracker.settled(11.0, TTL)
    tracker.put(record("a", 11.0))
    assert tracker.settled(11.1, TTL)


def test_a_registry_is_quiet_when_no_running_worker_was_heard_for_a_third_of_a_ttl() -> None:
    fleet = [record("a", 100.0), record("b", 99.2), record("c", 200.0, state="stopping")]
    assert not is_quiet(fleet, 100.9, ttl_s=3.0)
    assert is_quiet(fleet, 101.0, ttl_s=3.0)  # the newest running heartbeat is 1 s old
    assert not is_quiet([], 500.0, ttl_s=3.0)  # nobody to hear from: nothing to ask
    assert not is_quiet([record("c", 0.0, state="stopping")], 500.0, ttl_s=3.0)
