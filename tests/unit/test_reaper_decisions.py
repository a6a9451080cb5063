"""What the reaper does with a finding: move the task to another worker, or fail it, saying why."""

from __future__ import annotations

from collections import Counter
from typing import Any

from schemas.workers import WorkerRecord
from services.fleet.figures import Figure, Figures
from services.reaper.decisions import Fail, Move, Wait, decide
from services.reaper.detectors import TaskFinding
from services.reaper.view import TaskTrack

NOW = 1_000.0


def worker(
    worker_id: str, *, supports: tuple[str, ...] = ("cpu_inference",), **fields: Any
) -> WorkerRecord:
    values: dict[str, Any] = {
        "worker_id": worker_id,
        "host": "h",
        "instance_id": "i",
        "pid": 1,
        "version": "t",
        "supports": list(supports),
        "models": ["qwen2.5:7b"],
        "started_at": NOW - 100,
        "heartbeat_at": NOW - 0.5,
        **fields,
    }
    return WorkerRecord(**values)


def task(**fields: Any) -> TaskTrack:
    values: dict[str, Any] = {
        "task_id": "t-1",
        "model": "qwen2.5:7b",
        "attempt": 1,
        "status": "running",
        "since": NOW - 10,
        "worker": "a",
        "queue": "tasks.cpu.a",
        "runner": "a",
        **fields,
    }
    return TaskTrack(**values)


DEAD = TaskFinding("t-1", 1, "dead_worker", "a", "worker 'a' last heartbeat 9.0 s ago (over 3 s)")


def decide_for(
    finding: TaskFinding, track: TaskTrack, workers: list[WorkerRecord], **options: Any
) -> Move | Fail | Wait:
    settings: dict[str, Any] = {"now": NOW, "ttl_s": 3.0, "max_attempts": 5, **options}
    return decide(finding, track, workers, **settings)


def test_a_dead_workers_task_moves_to_another_live_worker_with_the_model_as_the_next_attempt() -> (
    None
):
    plan = decide_for(DEAD, task(), [worker("a", heartbeat_at=NOW - 9), worker("b")])
    assert isinstance(plan, Move)
    assert (plan.attempt, plan.decision.worker_id, plan.decision.queue) == (2, "b", "tasks.cpu.b")
    assert plan.reason.startswith("moved by the reaper (dead_worker: worker 'a' last heartbeat")


def test_any_tier_will_do_and_the_routing_policy_picks_as_the_router_would() -> None:
    gpu = worker("mac", supports=("gpu_inference",))
    plan = decide_for(DEAD, task(), [worker("a"), worker("b"), gpu])
    assert isinstance(plan, Move)
    assert plan.decision.worker_id == "mac"
    queued = {"b": Counter({("qwen2.5:7b", "code"): 3})}
    busy = decide_for(DEAD, task(), [worker("b"), worker("c")], queued=queued)
    assert isinstance(busy, Move)
    assert busy.decision.worker_id == "c"


def test_the_move_weighs_queued_work_by_the_stats_figures_as_the_router_does() -> None:
    figures = Figures()
    # b has one long task of another model queued, c two short ones: c finishes first.
    figures.put("gemma3:12b", "general", "b", Figure(typical_ms=20_000.0, recent_failure_rate=0))
    figures.put("gemma3:1b", "general", "c", Figure(typical_ms=500.0, recent_failure_rate=0))
    queued = {
        "b": Counter({("gemma3:12b", "general"): 1}),
        "c": Counter({("gemma3:1b", "general"): 2}),
    }
    other = worker("d", models=["gemma3:1b"])  # so the shared queue is no option
    fleet = [worker("b"), worker("c"), other]
    plan = decide_for(DEAD, task(domain="code"), fleet, figures=figures, queued=queued)
    assert isinstance(plan, Move)
    assert (plan.decision.worker_id, plan.domain) == ("c", "code")
    # The model in memory on b only, and loading it on c costs more than b's queue.
    cold = Figure(typical_ms=1_000.0, recent_failure_rate=0, cold_load_ms=30_000.0)
    figures.put("qwen2.5:7b", "code", "c", cold)
    fleet = [worker("b", resident=["gemma3:12b", "qwen2.5:7b"]), worker("c", resident=[]), other]
    plan = decide_for(DEAD, task(domain="code"), fleet, figures=figures, queued=queued)
    assert isinstance(plan, Move)
    assert plan.decision.worker_id == "b"


def test_the_move_keeps_the_gpu_preference_factor() -> None:
    gpu = worker("mac", supports=("gpu_inference",))
    queued = {"mac": Counter({("qwen2.5:7b", None): 3})}  # 4 s to finish there, 1 s on b
    plan = decide_for(DEAD, task(), [gpu, worker("b")], queued=queued, gpu_preference=5.0)
    assert isinstance(plan, Move)
    assert plan.decision.worker_id == "mac"
    plan = decide_for(DEAD, task(), [gpu, worker("b")], queued=queued, gpu_preference=3.0)
    assert isinstance(plan, Move)
    assert plan.decision.worker_id == "b"


def test_without_another_worker_it_fails_as_a_single_point_of_failure() -> None:
    plan = decide_for(DEAD, task(), [worker("a"), worker("b", models=["gemma3:1b"])])
    assert plan == Fail(
        "t-1",
        1,
        "a",
        "no_alternative_worker",
        "no alternative worker can serve model 'qwen2.5:7b' (reason=dead_worker); "
        "single point of failure",
    )


def test_a_dead_workers_heartbeat_alone_does_not_make_it_an_alternative() -> None:
    stale = worker("b", heartbeat_at=NOW - 10)
    assert isinstance(decide_for(DEAD, task(), [stale]), Fail)


def test_a_web_search_is_never_re_dispatched_it_fails_with_the_reason() -> None:
    plan = decide_for(DEAD, task(task_type="web_search"), [worker("b")])
    assert isinstance(plan, Fail)
    assert plan.code == "worker_lost"
    assert plan.reason == (
        "web_search tasks are not re-dispatched (reason=dead_worker): "
        "worker 'a' last heartbeat 9.0 s ago (over 3 s)"
    )
    ghost = TaskFinding("t-1", 1, "ghost_pending", None, "queued on tasks.web for 12 s")
    assert decide_for(ghost, task(task_type="web_search"), []).code == "ghost_pending"  # type: ignore[union-attr]


def test_a_task_for_a_named_worker_is_never_moved_to_another() -> None:
    plan = decide_for(DEAD, task(designated="a"), [worker("b")])
    assert isinstance(plan, Fail)
    assert plan.code == "worker_unavailable"
    assert "worker 'a' was asked for by name" in plan.reason


def test_after_the_last_allowed_attempt_it_fails_instead_of_moving_again() -> None:
    plan = decide_for(DEAD, task(attempt=3), [worker("b")], max_attempts=3)
    assert isinstance(plan, Fail)
    assert (plan.attempt, plan.code) == (3, "too_many_attempts")
    assert plan.reason.startswith("gave up after 3 attempts (reason=dead_worker)")


def test_a_retryable_failures_verdict_is_the_next_attempt_the_failed_one_has_its_outcome() -> None:
    retry = task(status="retry", failure_code="backend_unavailable")
    finding = TaskFinding("t-1", 1, "backend_unavailable", "a", "worker 'a' failed attempt 1")
    failed = decide_for(finding, retry, [worker("a")])
    assert isinstance(failed, Fail)
    assert failed.attempt == 2
    assert "(reason=backend_unavailable); single point of failure" in failed.reason
    moved = decide_for(finding, retry, [worker("a"), worker("b")])
    assert isinstance(moved, Move)
    assert (moved.attempt, moved.decision.worker_id) == (2, "b")


def test_a_task_never_routed_is_routed_as_its_first_attempt() -> None:
    finding = TaskFinding("t-1", 0, "ghost_pending", None, "never routed")
    plan = decide_for(finding, task(attempt=0, status="unrouted", worker=None), [worker("a")])
    assert isinstance(plan, Move)
    assert (plan.attempt, plan.decision.worker_id) == (1, "a")


def test_a_task_for_a_named_worker_never_routed_is_routed_there_or_fails_naming_it() -> None:
    finding = TaskFinding("t-1", 0, "ghost_pending", None, "never routed")
    unrouted = task(attempt=0, status="unrouted", worker=None, designated="b")
    plan = decide_for(finding, unrouted, [worker("a"), worker("b")])
    assert isinstance(plan, Move)
    assert (plan.attempt, plan.decision.worker_id) == (1, "b")
    gone = decide_for(finding, unrouted, [worker("a")])
    assert isinstance(gone, Fail)
    assert gone.code == "worker_unavailable"
    assert gone.reason.startswith("worker 'b' is not live")


def test_a_named_workers_task_whose_message_is_missing_is_queued_there_again() -> None:
    """The worker is live (busy): only the message was lost, so the task goes back to it as
    its next attempt, within the attempts allowed."""
    lost = TaskFinding("t-1", 1, "ghost_pending", None, "its message is missing", if_missing=True)
    queued = task(status="queued", runner=None, designated="a")
    plan = decide_for(lost, queued, [worker("a", state="busy"), worker("b")])
    assert isinstance(plan, Move)
    assert (plan.attempt, plan.decision.worker_id) == (2, "a")
    assert "its message is missing" in plan.reason
    spent = decide_for(lost, task(status="queued", attempt=5, designated="a"), [worker("a")])
    assert isinstance(spent, Fail) and spent.code == "too_many_attempts"


def test_while_the_registry_settles_no_task_is_failed_for_want_of_a_live_worker() -> None:
    # Heartbeats from before an outage: the other worker may be live, not yet heard again.
    stale = worker("b", heartbeat_at=NOW - 10)
    plan = decide_for(DEAD, task(), [stale], settling=True)
    assert isinstance(plan, Wait)
    assert (plan.task_id, plan.attempt) == ("t-1", 1)
    finding = TaskFinding("t-1", 0, "ghost_pending", None, "never routed")
    unrouted = task(attempt=0, status="unrouted", worker=None, designated="b")
    assert isinstance(decide_for(finding, unrouted, [stale], settling=True), Wait)


def test_while_the_registry_settles_a_move_to_a_live_worker_is_still_made() -> None:
    plan = decide_for(DEAD, task(), [worker("b")], settling=True)
    assert isinstance(plan, Move)
    assert plan.decision.worker_id == "b"
