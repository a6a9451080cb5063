"""Who may record an attempt's start and outcome (`services.fleet.binding`)."""

from __future__ import annotations

from schemas.events import Durations, TaskCompleted, TaskFailed, TaskStarted
from services.fleet.binding import refusal, routed_to_of_queue

SUPPORTS = {
    "cpu1": ["cpu_inference"],
    "cpu2": ["cpu_inference"],
    "gpu1": ["gpu_inference"],
    "web1": ["web_search"],
    "web2": ["web_search"],
}


def completed(worker: str, attempt: int = 1) -> TaskCompleted:
    return TaskCompleted(
        at=1.0,
        task_id="t",
        attempt=attempt,
        worker=worker,
        model="m",
        response="r",
        durations=Durations(total_ms=1.0),
    )


def lost(named: str) -> TaskFailed:
    return TaskFailed(at=1.0, task_id="t", attempt=1, worker=named, code="worker_lost", reason="r")


def test_the_routed_worker_records_its_attempt() -> None:
    assert refusal(completed("cpu1"), "cpu1", (1, "cpu1"), SUPPORTS.get) is None
    started = TaskStarted(at=1.0, task_id="t", attempt=1, worker="cpu1", host="h")
    assert refusal(started, "cpu1", (1, "cpu1"), SUPPORTS.get) is None


def test_another_worker_may_not_record_it_under_either_name() -> None:
    problem = refusal(completed("cpu2"), "cpu2", (1, "cpu1"), SUPPORTS.get)
    assert problem == "worker 'cpu2' recorded attempt 1 of task t, which was routed to 'cpu1'"
    problem = refusal(completed("cpu1"), "cpu2", (1, "cpu1"), SUPPORTS.get)
    assert problem == "worker 'cpu2' recorded attempt 1 of task t as worker 'cpu1'"


def test_a_pool_task_is_recorded_by_any_member_and_no_one_else() -> None:
    assert refusal(completed("cpu2"), "cpu2", (1, "shared"), SUPPORTS.get) is None
    assert refusal(completed("web2"), "web2", (1, "web"), SUPPORTS.get) is None
    for outsider in ("gpu1", "web1", "unknown"):
        problem = refusal(completed(outsider), outsider, (1, "shared"), SUPPORTS.get)
        assert problem is not None and "not one of its members" in problem


def test_only_a_pool_members_worker_lost_failure_may_name_another_worker() -> None:
    # web2 took over web1's redelivered task and found web1 gone.
    assert refusal(lost("web1"), "web2", (1, "web"), SUPPORTS.get) is None
    assert refusal(lost("cpu1"), "cpu2", (1, "cpu1"), SUPPORTS.get) is not None
    other = TaskFailed(at=1.0, task_id="t", attempt=1, worker="web1", code="backend", reason="r")
    assert refusal(other, "web2", (1, "web"), SUPPORTS.get) is not None


def test_an_attempt_never_routed_is_refused_and_an_older_ones_left_to_staleness() -> None:
    problem = refusal(completed("cpu2", attempt=3), "cpu2", (2, "cpu1"), SUPPORTS.get)
    assert problem == "worker 'cpu2' recorded attempt 3 of task t, which was never routed"
    assert refusal(completed("cpu2", attempt=1), "cpu2", (2, "cpu1"), SUPPORTS.get) is None


def test_a_task_the_reader_never_saw_routed_takes_a_worker_that_names_itself() -> None:
    assert refusal(completed("cpu2"), "cpu2", None, SUPPORTS.get) is None
    assert refusal(completed("cpu1"), "cpu2", None, SUPPORTS.get) is not None
    assert refusal(completed("cpu2"), "cpu2", (1, None), SUPPORTS.get) is None


def test_the_routers_and_reapers_events_are_taken_as_they_are() -> None:
    failed = TaskFailed(at=1.0, task_id="t", attempt=1, worker="cpu1", code="x", reason="r")
    assert refusal(failed, None, (1, "cpu1"), SUPPORTS.get) is None


def test_where_an_attempt_was_routed_follows_from_its_queue() -> None:
    assert routed_to_of_queue("tasks.cpu.cpu1") == "cpu1"
    assert routed_to_of_queue("tasks.gpu.gpu1") == "gpu1"
    assert routed_to_of_queue("tasks.cpu.shared") == "shared"
    assert routed_to_of_queue("tasks.web") == "web"
