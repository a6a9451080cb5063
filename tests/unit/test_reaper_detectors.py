"""The reaper's detectors on snapshots: what each one calls a problem, and what it does not."""

from __future__ import annotations

import dataclasses
from typing import Any

from schemas.subjects import SHARED_CPU, WEB
from schemas.workers import WorkerRecord
from services.reaper.detectors import Snapshot, TaskFinding, Thresholds, detect
from services.reaper.view import ConsumerHistory, Instance, TaskTrack

TH = Thresholds(dead_after_s=3.0, stuck_grace_s=30.0, ghost_after_s=10.0, duplicate_samples=2)
NOW = 1_000.0


def worker(worker_id: str, *, beat_age: float = 0.5, **fields: Any) -> WorkerRecord:
    values: dict[str, Any] = {
        "worker_id": worker_id,
        "host": f"host-{worker_id}",
        "instance_id": f"i-{worker_id}",
        "pid": 1,
        "version": "t",
        "supports": ["cpu_inference"],
        "models": ["m"],
        "started_at": NOW - 100,
        "heartbeat_at": NOW - beat_age,
        **fields,
    }
    return WorkerRecord(**values)


POOL_QUEUES: dict[str | None, str | None] = {
    "shared": "tasks.cpu.shared",
    "web": "tasks.web",
    None: None,
}


def task(
    status: str = "queued", *, worker: str | None = "a", age: float = 1.0, **fields: Any
) -> TaskTrack:
    values: dict[str, Any] = {
        "task_id": "t-1",
        "model": "m",
        "timeout_s": 60.0,
        "attempt": 1,
        "status": status,
        "since": NOW - age,
        "worker": worker,
        "queue": POOL_QUEUES.get(worker, f"tasks.cpu.{worker}"),
        **fields,
    }
    if status == "running":
        values.setdefault("runner", worker)
    return TaskTrack(**values)


def consumer(
    *, idle: float = 0.0, pending: int = 1, in_flight: int = 0, waiting: int = 1, crowded: int = 0
) -> ConsumerHistory:
    return ConsumerHistory(
        exists=True,
        num_pending=pending,
        num_ack_pending=in_flight,
        num_waiting=waiting,
        delivered_seq=0,
        ack_floor_seq=0,
        last_progress=NOW - idle,
        crowded=crowded,
    )


MISSING = ConsumerHistory(
    exists=False,
    num_pending=0,
    num_ack_pending=0,
    num_waiting=0,
    delivered_seq=0,
    ack_floor_seq=0,
    last_progress=NOW - 60,
    crowded=0,
)


def snap(
    tasks: list[TaskTrack],
    workers: list[WorkerRecord],
    consumers: dict[str, ConsumerHistory] | None = None,
    **fields: Any,
) -> Snapshot:
    return Snapshot(
        now=NOW,
        tasks={t.task_id: t for t in tasks},
        workers={w.worker_id: w for w in workers},
        consumers=consumers or {},
        **fields,
    )


def found(snapshot: Snapshot) -> list[tuple[str, str | None]]:
    return [(f.reason, f.worker) for f in detect(snapshot, TH).tasks]


def only(snapshot: Snapshot) -> TaskFinding:
    (finding,) = detect(snapshot, TH).tasks
    return finding


# -- dead worker


def test_a_task_running_on_a_worker_whose_heartbeat_is_older_than_the_ttl_is_a_dead_workers() -> (
    None
):
    finding = only(snap([task("running")], [worker("a", beat_age=3.5)]))
    assert (finding.reason, finding.worker) == ("dead_worker", "a")
    assert "last heartbeat 3.5 s ago (over 3 s)" in finding.detail


def test_a_task_queued_for_a_worker_without_a_lease_is_a_dead_workers() -> None:
    finding = only(snap([task("queued", age=5)], []))
    assert finding.detail == "worker 'a' holds no lease (stopped, or its entry expired)"


def test_a_task_routed_a_moment_ago_to_a_worker_not_yet_seen_is_left_alone() -> None:
    assert found(snap([task("queued", age=1)], [])) == []


def test_a_fresh_heartbeat_is_alive() -> None:
    assert found(snap([task("running")], [worker("a", beat_age=2.9, current_task="t-1")])) == []


def test_a_worker_restarted_since_it_started_the_task_and_not_running_it_lost_it() -> None:
    restarted = worker("a", instance_id="new", current_task=None, started_at=NOW - 1)
    finding = only(snap([task("running", age=10)], [restarted]))
    assert finding.reason == "dead_worker"
    assert "is not running the task it started" in finding.detail


def test_nothing_is_judged_dead_while_the_registry_settles_after_a_reconnect() -> None:
    after_outage = snap([task("running")], [worker("a", beat_age=9)], settling=True)
    assert found(after_outage) == []


def test_a_sleeping_workers_tasks_are_the_routers_to_wake_it_for() -> None:
    assert found(snap([task("queued", age=60)], [], asleep={"a"})) == []


def test_pool_tasks_not_yet_started_have_no_worker_to_die() -> None:
    shared = task("queued", worker="shared", age=1)
    assert found(snap([shared], [], {SHARED_CPU.consumer: consumer()})) == []


# -- stuck task


def test_a_task_running_past_its_timeout_plus_the_grace_is_stuck() -> None:
    running = task("running", age=91, timeout_s=60.0)
    finding = only(snap([running], [worker("a", current_task="t-1")]))
    assert (finding.reason, finding.worker) == ("stuck_task", "a")
    assert "past its timeout of 60 s and a grace of 30 s" in finding.detail
    assert found(snap([task("running", age=89)], [worker("a", current_task="t-1")])) == []


# -- ghost queue


def test_a_task_waiting_on_an_idle_live_worker_that_pulls_nothing_is_a_ghost() -> None:
    waiting = task("queued", age=11)
    finding = only(snap([waiting], [worker("a")], {"worker-a": consumer(idle=11, waiting=0)}))
    assert (finding.reason, finding.worker) == ("ghost_pending", "a")
    assert finding.detail.endswith("worker 'a' is live and idle but nothing pulls its queue")


def test_a_ghost_worker_may_have_no_consumer_at_all() -> None:
    finding = only(snap([task("queued", age=11)], [worker("a")], {"worker-a": MISSING}))
    assert "its consumer worker-a does not exist" in finding.detail


def test_a_task_whose_message_is_missing_is_a_ghost_even_if_the_worker_pulls() -> None:
    gone = consumer(idle=11, pending=0, waiting=1)
    assert (
        "message is missing" in only(snap([task(age=11)], [worker("a")], {"worker-a": gone})).detail
    )


def test_a_task_in_flight_nobody_works_on_blocks_an_idle_workers_queue_a_ghost() -> None:
    # Past the consumer's ack wait (30 s) and GHOST_AFTER_S: the server would have handed it
    # out again by now.
    blocked = consumer(idle=41, pending=3, in_flight=1, waiting=1)
    finding = only(snap([task(age=41)], [worker("a")], {"worker-a": blocked}))
    assert "held by no process that works on it" in finding.detail


def test_a_task_in_flight_is_no_ghost_before_the_server_hands_it_out_again() -> None:
    """A live worker's acknowledgement (or a delivery) lost in a reconnect leaves one task in
    flight on its consumer, which the server hands out again after the ack wait and the worker
    then settles: the task queued behind it waits, it is not moved (nor failed, when it was
    asked of that worker by name)."""
    for idle in (11.0, 25.0, 39.9):
        blocked = consumer(idle=idle, pending=3, in_flight=1, waiting=1)
        assert found(snap([task(age=idle)], [worker("a")], {"worker-a": blocked})) == [], idle
    short = dataclasses.replace(consumer(idle=16, in_flight=1), ack_wait_s=5.0)
    assert found(snap([task(age=16)], [worker("a")], {"worker-a": short})) == [
        ("ghost_pending", "a")
    ]


def test_a_busy_workers_queue_holding_fewer_messages_than_tasks_waiting_has_one_missing() -> None:
    """A busy worker is left to get to its queue in turn, unless its queue holds fewer messages
    than the tasks running from it and waiting on it: then the waiting ones are flagged, each
    to be acted on only if its own message is not in the queue (the reaper looks)."""
    busy = worker("a", state="busy", current_task="t-0")
    tasks = [
        task("running", age=30, task_id="t-0"),
        task(age=12, task_id="t-1"),
        task(age=11, task_id="t-2"),
        task(age=1, task_id="t-3"),  # too young: its message may not be queued yet
    ]
    full = consumer(idle=0, pending=3, in_flight=1, waiting=0)
    assert found(snap(tasks, [busy], {"worker-a": full})) == []
    short = consumer(idle=0, pending=1, in_flight=1, waiting=0)
    findings = detect(snap(tasks, [busy], {"worker-a": short}), TH).tasks
    assert [(f.task_id, f.reason, f.if_missing) for f in findings] == [
        ("t-1", "ghost_pending", True),
        ("t-2", "ghost_pending", True),
    ]
    assert "its queue holds 2 message(s) for 3 task(s)" in findings[0].detail


def test_a_busy_worker_gets_to_its_queue_in_turn() -> None:
    busy = worker("a", state="busy", current_task="t-0")
    assert found(snap([task(age=60)], [busy], {"worker-a": consumer(idle=60)})) == []


def test_a_queue_worked_on_recently_is_no_ghost() -> None:
    assert found(snap([task(age=60)], [worker("a")], {"worker-a": consumer(idle=5)})) == []


def test_a_task_submitted_long_ago_and_never_routed_is_a_ghost() -> None:
    finding = only(snap([task("unrouted", worker=None, age=11)], []))
    assert (finding.reason, finding.worker) == ("ghost_pending", None)
    assert "never routed" in finding.detail


def test_a_shared_task_no_live_cpu_worker_can_pull_is_a_ghost() -> None:
    shared = task("queued", worker="shared", age=11)
    gpu_only = worker("g", supports=["gpu_inference"])
    finding = only(snap([shared], [gpu_only], {SHARED_CPU.consumer: consumer()}))
    assert finding.detail.endswith("no live worker that could pull it")


def test_no_queue_is_called_a_ghost_while_the_registry_settles_after_a_reconnect() -> None:
    # The incident: heartbeats from before a nats-server restart, judged 2.8 s after it.
    shared = task("queued", worker="shared", age=11)
    own = task("queued", age=11, task_id="t-2")
    consumers = {SHARED_CPU.consumer: consumer(), "worker-a": consumer(idle=11, waiting=0)}
    stale = worker("a", beat_age=5)
    assert found(snap([shared, own], [stale], consumers, settling=True)) == []
    assert found(snap([shared, own], [worker("a")], consumers, settling=True)) == []


def test_a_shared_task_waits_while_the_cpu_workers_are_busy() -> None:
    shared = task("queued", worker="shared", age=60)
    busy = worker("c", state="busy", current_task="t-0")
    assert found(snap([shared], [busy], {SHARED_CPU.consumer: consumer(idle=60, waiting=0)})) == []


def test_a_web_task_with_web_workers_live_but_no_consumer_is_a_ghost() -> None:
    web = task("queued", worker="web", age=11, task_type="web_search")
    finding = only(snap([web], [worker("w", supports=["web_search"])], {WEB.consumer: MISSING}))
    assert "could pull it but none ever has" in finding.detail


# -- retryable failure


def test_a_retryable_failure_is_found_at_once_naming_the_worker_to_avoid() -> None:
    retry = task("retry", runner="a", failure_code="backend_unavailable", age=0)
    finding = only(snap([retry], [worker("a")]))
    assert (finding.reason, finding.worker) == ("backend_unavailable", "a")


def test_ended_tasks_are_never_found() -> None:
    assert found(snap([task("ended", age=9999)], [])) == []


# -- duplicates


def test_more_than_one_pull_waiting_on_a_workers_consumer_for_two_looks_is_a_duplicate() -> None:
    crowded = snap([], [worker("a")], {"worker-a": consumer(waiting=2, crowded=2)})
    (duplicate,) = detect(crowded, TH).duplicates
    assert (duplicate.worker_id, duplicate.num_waiting) == ("a", 2)
    assert "2 pulls wait on worker-a" in duplicate.detail
    once = snap([], [worker("a")], {"worker-a": consumer(waiting=2, crowded=1)})
    assert detect(once, TH).duplicates == []


def test_two_instances_heartbeating_within_a_ttl_are_a_duplicate() -> None:
    instances = {"a": {"i1": Instance("i1", "h1", NOW - 0.5), "i2": Instance("i2", "h2", NOW - 1)}}
    (duplicate,) = detect(snap([], [worker("a")], instances=instances), TH).duplicates
    assert (duplicate.instances, duplicate.hosts) == (("i1", "i2"), ("h1", "h2"))


def test_a_restart_after_the_old_instance_went_silent_is_no_duplicate() -> None:
    instances = {"a": {"old": Instance("old", "h", NOW - 3.2), "new": Instance("new", "h", NOW)}}
    assert detect(snap([], [worker("a")], instances=instances), TH).duplicates == []


def test_one_finding_per_task_dead_before_stuck() -> None:
    both = task("running", age=999)
    assert found(snap([both], [worker("a", beat_age=10)])) == [("dead_worker", "a")]
    assert dataclasses.replace(both, status="ended").open is False
