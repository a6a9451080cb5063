from __future__ import annotations

import pytest

from schemas.subjects import (
    POOL_NAMES,
    SHARED_CPU,
    WEB,
    InvalidId,
    pool_of_queue,
    queue_consumer,
    task_event,
    task_event_source,
    task_events,
    worker_consumer,
    worker_event,
    worker_of_consumer,
    worker_queue,
    workers_task_event,
)


def test_subjects_are_built_from_safe_ids() -> None:
    assert worker_queue("cpu", "box-1") == "tasks.cpu.box-1"
    assert worker_queue("gpu", "mac_m2") == "tasks.gpu.mac_m2"
    assert task_event("t1", "routed") == "events.task.t1.routed"
    assert task_event("t1", "completed", "box-1") == "events.task.t1.box-1.completed"
    assert workers_task_event("t1", "started") == "events.task.t1.*.started"
    assert task_events("t1") == "events.task.t1.>"
    assert worker_event("box-1", "registered") == "events.worker.box-1.registered"


@pytest.mark.parametrize("bad", ["a.b", "a b", "*", ">", "a*", "", "x" * 129, "tab\t", "ü"])
def test_ids_that_would_break_a_subject_are_refused(bad: str) -> None:
    with pytest.raises(InvalidId, match="invalid worker id"):
        worker_queue("cpu", bad)
    with pytest.raises(InvalidId, match="invalid task id"):
        task_event(bad, "completed")


@pytest.mark.parametrize("reserved", ["shared", "web"])
def test_names_that_are_queues_of_their_own_cannot_be_worker_ids(reserved: str) -> None:
    with pytest.raises(InvalidId):
        worker_queue("cpu", reserved)


def test_each_queue_is_delivered_by_its_consumer() -> None:
    assert queue_consumer(worker_queue("gpu", "mac")) == worker_consumer("mac") == "worker-mac"
    assert queue_consumer(SHARED_CPU.queue) == SHARED_CPU.consumer
    assert queue_consumer(WEB.queue) == WEB.consumer
    assert worker_of_consumer(worker_consumer("mac")) == "mac"
    assert worker_of_consumer(SHARED_CPU.consumer) is None


def test_a_task_events_subject_names_the_worker_that_recorded_it() -> None:
    assert task_event_source(task_event("t1", "completed", "box-1")) == "box-1"
    assert task_event_source(task_event("t1", "failed")) is None  # the router's or reaper's
    assert task_event_source("events.worker.box-1.registered") is None
    assert task_event_source("coordinator.chunk.box-1.t1") is None


def test_each_pool_is_declared_once_with_its_queue_consumer_and_members() -> None:
    for pool in (SHARED_CPU, WEB):
        assert pool_of_queue(pool.queue) is pool
        assert queue_consumer(pool.queue) == pool.consumer
        assert pool.name in POOL_NAMES
    assert pool_of_queue(worker_queue("cpu", "box-1")) is None
    assert queue_consumer(worker_queue("cpu", "box-1")) == worker_consumer("box-1")
