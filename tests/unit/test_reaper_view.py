"""The reaper's view: a task's track from its events (fenced by attempt), queue histories."""

from __future__ import annotations

from collections import Counter
from functools import reduce

from schemas.events import (
    Durations,
    TaskCompleted,
    TaskEvent,
    TaskFailed,
    TaskRouted,
    TaskStarted,
    TaskSubmitted,
)
from schemas.work import Work
from services.reaper.view import (
    ConsumerHistory,
    ConsumerSample,
    ReaperView,
    TaskTrack,
    observe,
    track,
)

T = "t-1"


def submitted(at: float = 0.0, task_type: str = "inference") -> TaskSubmitted:
    return TaskSubmitted(
        at=at,
        task_id=T,
        model="m",
        work=Work(prompt="p", task_type=task_type),  # type: ignore[arg-type]
        timeout_s=60,
    )


def routed(
    attempt: int, worker: str = "a", at: float = 1.0, domain: str | None = None
) -> TaskRouted:
    queue = f"tasks.cpu.{worker}"
    return TaskRouted(at=at, task_id=T, attempt=attempt, worker=worker, queue=queue, domain=domain)


def started(attempt: int, worker: str = "a", at: float = 2.0) -> TaskStarted:
    return TaskStarted(at=at, task_id=T, attempt=attempt, worker=worker, host="h")


def completed(attempt: int, worker: str = "a", at: float = 3.0) -> TaskCompleted:
    return TaskCompleted(
        at=at,
        task_id=T,
        attempt=attempt,
        worker=worker,
        model="m",
        response="r",
        durations=Durations(total_ms=1),
    )


def failed(attempt: int, worker: str | None = "a", retryable: bool = True) -> TaskFailed:
    return TaskFailed(
        at=3.0,
        task_id=T,
        attempt=attempt,
        worker=worker,
        code="backend_unavailable",
        reason="down",
        retryable=retryable,
    )


def fold(*events: TaskEvent) -> TaskTrack:
    state: TaskTrack | None = None
    return reduce(track, events, state)  # type: ignore[return-value]


def test_a_submitted_task_waits_unrouted_until_it_is_routed_then_queued_then_running() -> None:
    assert fold(submitted()).status == "unrouted"
    queued = fold(submitted(), routed(1))
    assert (queued.status, queued.worker, queued.queue, queued.since) == (
        "queued",
        "a",
        "tasks.cpu.a",
        1.0,
    )
    running = fold(submitted(), routed(1), started(1))
    assert (running.status, running.runner, running.holder, running.since) == (
        "running",
        "a",
        "a",
        2.0,
    )


def test_an_outcome_ends_the_task() -> None:
    assert fold(submitted(), routed(1), started(1), completed(1)).status == "ended"
    assert fold(submitted(), routed(1), failed(1, retryable=False)).status == "ended"


def test_events_of_an_older_attempt_change_nothing() -> None:
    moved = fold(submitted(), routed(1), started(1), routed(2, "b", at=5.0))
    assert (moved.attempt, moved.status, moved.worker, moved.runner) == (2, "queued", "b", None)
    assert fold(submitted(), routed(1), routed(2, "b"), completed(1)) == fold(
        submitted(), routed(1), routed(2, "b")
    )
    assert fold(submitted(), routed(2, "b"), started(1)).status == "queued"


def test_a_repeated_start_keeps_the_first_start_time() -> None:
    again = fold(submitted(), routed(1), started(1, at=2.0), started(1, at=9.0))
    assert again.since == 2.0


def test_a_retryable_failure_of_the_running_worker_waits_for_the_reaper() -> None:
    retry = fold(submitted(), routed(1), started(1), failed(1))
    assert (retry.status, retry.failure_code, retry.open) == ("retry", "backend_unavailable", True)
    # Then attempt 2 is routed, or attempt 2 fails for good.
    assert fold(submitted(), routed(1), started(1), failed(1), routed(2, "b")).status == "queued"
    assert fold(submitted(), routed(1), started(1), failed(1), failed(2, None, False)).status == (
        "ended"
    )


def test_a_retryable_failure_is_final_for_a_web_search_or_when_nobody_ran_the_attempt() -> None:
    web = fold(
        submitted(task_type="web_search"), routed(1, "web"), started(1, "w1"), failed(1, "w1")
    )
    assert web.status == "ended"
    unstarted = fold(submitted(), routed(1), failed(1, "a"))  # the router could not queue it
    assert unstarted.status == "ended"


def sample(
    *, delivered: int = 0, acked: int = 0, in_flight: int = 0, waiting: int = 1
) -> ConsumerSample:
    return ConsumerSample(
        num_pending=0,
        num_ack_pending=in_flight,
        num_waiting=waiting,
        delivered_seq=delivered,
        ack_floor_seq=acked,
    )


def history(*looks: tuple[float, ConsumerSample | None]) -> ConsumerHistory:
    state: ConsumerHistory | None = None
    for now, seen in looks:
        state = observe(state, seen, now)
    assert state is not None
    return state


def test_a_consumer_progresses_when_it_delivers_or_a_task_is_acknowledged() -> None:
    assert history((0, sample()), (5, sample())).last_progress == 0
    assert history((0, sample()), (5, sample(delivered=1))).last_progress == 5
    assert history((0, sample()), (5, sample(acked=1))).last_progress == 5
    assert history((0, sample()), (5, sample(in_flight=1))).last_progress == 0  # held, no more
    assert history((0, None), (5, None)).last_progress == 0  # missing since the first look


def test_crowded_counts_looks_in_a_row_with_more_than_one_pull_waiting_and_none_in_flight() -> None:
    assert history((0, sample(waiting=2)), (1, sample(waiting=3))).crowded == 2
    assert history((0, sample(waiting=2)), (1, sample(waiting=1))).crowded == 0
    # At its one task in flight, requests pile up until they expire: not a second process.
    assert (
        history((0, sample(waiting=4, in_flight=1)), (1, sample(waiting=4, in_flight=1))).crowded
        == 0
    )


def test_the_view_forgets_ended_tasks_and_counts_open_ones_per_worker() -> None:
    view = ReaperView()
    for event in (submitted(), routed(1, domain="code"), started(1)):
        view.apply(event)
    # By model and domain: what the routing policy weighs a move by.
    assert view.queued() == {"a": Counter({("m", "code"): 1})}
    view.apply(completed(1, at=10.0))
    assert view.queued() == {}
    view.prune(now=10.0 + 3599)
    assert T in view.tasks
    view.prune(now=10.0 + 3601)
    assert T not in view.tasks


def test_a_released_lease_or_a_stop_forgets_the_instance() -> None:
    view = ReaperView()
    view.seen("w", "i1", "h", 1.0)
    view.stopped("w", "i1")
    assert view.instances["w"] == {}
    view.seen("w", "i2", "h", 2.0)
    view.remove_worker("w")
    assert "w" not in view.instances


def test_a_workers_event_for_an_attempt_routed_elsewhere_changes_nothing() -> None:
    view = ReaperView()
    for event in (submitted(), routed(1, worker="a")):
        view.apply(event)
    # b forges a's outcome: the reaper keeps watching the task, so it is still rescued.
    problem = view.apply(completed(1, worker="b"), "b")
    assert problem is not None and "routed to 'a'" in problem
    assert view.tasks[T].status == "queued"
    assert view.apply(started(1, worker="a"), "a") is None
    assert view.tasks[T].status == "running"
    assert view.apply(completed(1, worker="a"), "a") is None
    assert view.tasks[T].status == "ended"


def test_a_move_that_raced_the_tasks_end_does_not_reopen_it() -> None:
    # The reaper routed attempt 2 just as attempt 1 completed, and queued nothing for it.
    assert fold(submitted(), routed(1), started(1), completed(1), routed(2, "b")).status == (
        "ended"
    )
    assert fold(submitted(), routed(1), failed(1, retryable=False), routed(2, "b")).status == (
        "ended"
    )
