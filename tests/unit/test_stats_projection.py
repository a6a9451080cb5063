"""The task projection's pure rules: evolve, attempt outcomes and the query view."""

from __future__ import annotations

from functools import reduce

import msgspec

from schemas.events import (
    Durations,
    TaskCompleted,
    TaskEvent,
    TaskFailed,
    TaskRouted,
    TaskStarted,
    TaskSubmitted,
    Tokens,
)
from schemas.work import Work
from services.stats.projection import Outcome, TaskState, evolve, outcome_of, to_view

TASK = "t1"


def submitted(at: float = 100.0, domain: str | None = "code") -> TaskSubmitted:
    return TaskSubmitted(
        at=at,
        task_id=TASK,
        model="qwen2.5:7b",
        work=Work(prompt="hello", domain=domain),
        timeout_s=60.0,
    )


def routed(attempt: int = 1, worker: str = "mac", at: float = 101.0) -> TaskRouted:
    return TaskRouted(
        at=at, task_id=TASK, attempt=attempt, worker=worker, queue=f"tasks.gpu.{worker}"
    )


def started(attempt: int = 1, worker: str = "mac", at: float = 102.0) -> TaskStarted:
    return TaskStarted(at=at, task_id=TASK, attempt=attempt, worker=worker, host=f"{worker}.lan")


def completed(attempt: int = 1, worker: str = "mac", at: float = 110.0) -> TaskCompleted:
    return TaskCompleted(
        at=at,
        task_id=TASK,
        attempt=attempt,
        worker=worker,
        model="qwen2.5:7b",
        response="hi",
        thinking="let me think",
        durations=Durations(total_ms=8000.0, load_ms=1500.0, prompt_eval_ms=200.0, eval_ms=6000.0),
        tokens=Tokens(prompt=12, eval=40),
    )


def failed(attempt: int = 1, worker: str | None = "mac", at: float = 110.0) -> TaskFailed:
    return TaskFailed(
        at=at, task_id=TASK, attempt=attempt, worker=worker, code="backend_error", reason="boom"
    )


def replay(*events: TaskEvent, state: TaskState | None = None) -> TaskState:
    """The state after applying ``events`` in order."""
    result = reduce(evolve, events, state)
    assert result is not None
    return result


# -- evolve: the ordinary life of a task -----------------------------------------------------


def test_submitted_creates_a_queued_task_with_what_was_asked() -> None:
    state = evolve(None, submitted())

    assert state == TaskState(
        task_id=TASK,
        status="queued",
        model="qwen2.5:7b",
        domain="code",
        task_type="inference",
        prompt="hello",
        created_at=100.0,
    )


def test_routed_names_worker_queue_and_attempt() -> None:
    state = replay(submitted(), routed())

    assert (state.status, state.worker, state.queue) == ("queued", "mac", "tasks.gpu.mac")
    assert (state.attempt, state.attempts) == (1, 1)


def test_started_marks_the_task_running_on_its_host() -> None:
    state = replay(submitted(), routed(), started())

    assert (state.status, state.host, state.started_at) == ("running", "mac.lan", 102.0)


def test_completed_keeps_response_thinking_durations_and_tokens() -> None:
    state = replay(submitted(), routed(), started(), completed())

    assert state.status == "done"
    assert (state.response, state.thinking) == ("hi", "let me think")
    assert (state.total_ms, state.load_ms, state.prompt_eval_ms, state.eval_ms) == (
        8000.0,
        1500.0,
        200.0,
        6000.0,
    )
    assert (state.prompt_tokens, state.eval_tokens) == (12, 40)
    assert state.ended_at == 110.0
    assert state.created_at == 100.0


def test_failed_keeps_the_error_code_and_reason() -> None:
    state = replay(submitted(), routed(), started(), failed())

    assert (state.status, state.error_code, state.error, state.ended_at) == (
        "failed",
        "backend_error",
        "boom",
        110.0,
    )


def test_failure_without_a_worker_keeps_the_routed_one() -> None:
    state = replay(submitted(), routed(worker="pc"), failed(worker=None))

    assert state.worker == "pc"


# -- evolve: fencing by attempt --------------------------------------------------------------


def test_outcome_of_an_older_attempt_is_stale_and_changes_nothing() -> None:
    before = replay(submitted(), routed(1, "mac"), started(1, "mac"), routed(2, "pc"))

    assert evolve(before, completed(1, "mac")) is before
    assert evolve(before, failed(1, "mac")) is before
    assert evolve(before, started(1, "mac")) is before
    assert evolve(before, routed(1, "mac")) is before


def test_a_new_attempt_reopens_a_failed_task_and_clears_the_old_outcome() -> None:
    state = replay(submitted(), routed(1, "mac"), failed(1, "mac"), routed(2, "pc"))

    assert (state.status, state.worker, state.queue) == ("queued", "pc", "tasks.gpu.pc")
    assert (state.attempt, state.attempts) == (2, 2)
    assert (state.error_code, state.error, state.ended_at) == (None, None, None)


def test_an_outcome_of_a_newer_attempt_is_taken_even_without_its_routed() -> None:
    state = replay(submitted(), routed(1, "mac"), completed(2, "pc"))

    assert (state.status, state.worker, state.attempt, state.attempts) == ("done", "pc", 2, 2)


def test_a_late_started_does_not_downgrade_a_finished_attempt() -> None:
    done = replay(submitted(), routed(), completed())

    assert evolve(done, started()) is done


def test_the_first_outcome_of_an_attempt_stands() -> None:
    done = replay(submitted(), routed(), started(), completed())

    assert evolve(done, completed(at=200.0)) is done
    assert evolve(done, failed()) is done


def test_a_repeated_started_keeps_the_first_start_time() -> None:
    running = replay(submitted(), routed(), started(at=102.0))

    assert evolve(running, started(at=150.0)) is running


def test_a_repeated_routed_of_a_started_attempt_changes_nothing() -> None:
    running = replay(submitted(), routed(), started())

    assert evolve(running, routed()) is running


def test_a_repeated_submitted_changes_nothing() -> None:
    state = replay(submitted(), routed())

    assert evolve(state, submitted()) is state


# -- evolve: events before submitted ---------------------------------------------------------


def test_routed_before_submitted_gives_a_placeholder_that_submitted_fills_in() -> None:
    placeholder = evolve(None, routed(at=101.0))
    assert (placeholder.status, placeholder.model, placeholder.worker) == ("queued", "", "mac")
    assert placeholder.created_at == 101.0

    state = evolve(placeholder, submitted(at=100.0))

    assert (state.model, state.domain, state.prompt, state.created_at) == (
        "qwen2.5:7b",
        "code",
        "hello",
        100.0,
    )
    assert (state.worker, state.attempt) == ("mac", 1)


def test_completed_before_submitted_is_done_with_the_model_it_names() -> None:
    state = evolve(None, completed())

    assert (state.status, state.model, state.response) == ("done", "qwen2.5:7b", "hi")


def test_submitted_after_the_outcome_does_not_reopen_the_task() -> None:
    state = replay(completed(), submitted())

    assert (state.status, state.domain, state.prompt) == ("done", "code", "hello")


# -- outcome_of ------------------------------------------------------------------------------


def test_a_task_becoming_done_records_a_done_outcome_with_its_durations_and_tokens() -> None:
    before = replay(submitted(), routed(), started())
    after = evolve(before, completed())

    outcome = outcome_of(before, after)

    assert outcome == Outcome(
        task_id=TASK,
        attempt=1,
        model="qwen2.5:7b",
        domain="code",
        worker="mac",
        ok=True,
        total_ms=8000.0,
        load_ms=1500.0,
        eval_ms=6000.0,
        eval_tokens=40,
        first_token_ms=None,
        ended_at=110.0,
    )


def test_a_task_becoming_failed_records_a_failed_outcome() -> None:
    before = replay(submitted(), routed())
    outcome = outcome_of(before, evolve(before, failed()))

    assert outcome is not None
    assert (outcome.ok, outcome.worker, outcome.total_ms) == (False, "mac", None)


def test_no_outcome_until_the_task_ends() -> None:
    before = replay(submitted(), routed())

    assert outcome_of(None, evolve(None, submitted())) is None
    assert outcome_of(before, evolve(before, started())) is None


def test_an_attempt_has_one_outcome() -> None:
    done = replay(submitted(), routed(), completed())

    assert outcome_of(done, evolve(done, completed())) is None
    assert outcome_of(done, evolve(done, submitted())) is None


def test_each_attempt_has_its_own_outcome_on_its_own_worker() -> None:
    failed_on_mac = replay(submitted(), routed(1, "mac"), failed(1, "mac"))
    requeued = evolve(failed_on_mac, routed(2, "pc"))

    outcome = outcome_of(requeued, evolve(requeued, completed(2, "pc")))

    assert outcome is not None
    assert (outcome.attempt, outcome.worker, outcome.ok) == (2, "pc", True)


def test_without_a_requested_domain_the_heuristic_names_it() -> None:
    before = evolve(None, submitted(domain=None))  # prompt "hello"
    outcome = outcome_of(before, evolve(before, failed(worker=None)))

    assert outcome is not None
    assert (outcome.domain, outcome.worker) == ("general", "")


def test_the_time_to_first_token_is_kept_when_the_backend_streamed() -> None:
    before = replay(submitted(), routed())
    streamed = msgspec.structs.replace(
        completed(),
        durations=Durations(total_ms=8000.0, first_token_ms=350.0),
    )

    outcome = outcome_of(before, evolve(before, streamed))

    assert outcome is not None
    assert outcome.first_token_ms == 350.0


def test_an_outcome_before_submitted_counts_when_the_model_is_known() -> None:
    assert outcome_of(None, evolve(None, completed())) is not None
    assert outcome_of(None, evolve(None, failed())) is None  # model unknown: no key


# -- to_view ---------------------------------------------------------------------------------


def test_view_of_a_done_task_has_durations_and_tokens() -> None:
    view = to_view(replay(submitted(), routed(), started(), completed()))

    assert (view.status, view.worker, view.queue, view.attempts) == (
        "done",
        "mac",
        "tasks.gpu.mac",
        1,
    )
    assert view.durations == Durations(
        total_ms=8000.0, load_ms=1500.0, prompt_eval_ms=200.0, eval_ms=6000.0
    )
    assert view.tokens == Tokens(prompt=12, eval=40)
    assert (view.created_at, view.ended_at, view.error) == (100.0, 110.0, None)


def test_view_of_a_queued_task_has_no_durations_or_tokens() -> None:
    view = to_view(replay(submitted()))

    assert (view.status, view.durations, view.tokens, view.ended_at) == (
        "queued",
        None,
        None,
        None,
    )


def test_view_of_a_failed_task_says_code_and_reason() -> None:
    view = to_view(replay(submitted(), routed(), failed()))

    assert view.error == "backend_error: boom"


def test_a_cancelled_task_fails_but_counts_in_no_figure() -> None:
    before = replay(submitted(), routed(), started())
    cancelled = TaskFailed(
        at=110.0, task_id=TASK, attempt=1, worker="mac", code="cancelled", reason="client left"
    )
    after = evolve(before, cancelled)

    assert after.status == "failed" and after.error_code == "cancelled"
    assert outcome_of(before, after) is None  # the client went away: nothing about the worker


def test_an_embedding_task_has_figures_of_its_own_domain() -> None:
    """The router names an embedding task's domain ``embedding``: its outcome is keyed apart
    from every generation's, and its vectors stay in the event log, not in the task row."""
    work = Work(prompt="a\nb", domain="embedding", task_type="embedding", input=["a", "b"])
    asked = msgspec.structs.replace(submitted(), work=work)
    before = replay(asked, routed(), started())
    vectors = msgspec.structs.replace(
        completed(),
        response="",
        thinking=None,
        embeddings=[b"\x00\x00\x80?", b"\x00\x00\x00@"],
        durations=Durations(total_ms=30.0, load_ms=5.0),
        tokens=Tokens(prompt=2),
    )
    after = evolve(before, vectors)
    outcome = outcome_of(before, after)

    assert outcome is not None
    assert (outcome.domain, outcome.ok, outcome.total_ms, outcome.eval_tokens) == (
        "embedding",
        True,
        30.0,
        None,
    )
    view = to_view(after)
    assert (view.task_type, view.status, view.response) == ("embedding", "done", "")


def test_a_move_that_raced_the_completion_does_not_reopen_the_task() -> None:
    done = replay(submitted(), routed(1, "mac"), started(1, "mac"), completed(1, "mac"))

    assert evolve(done, routed(2, "pc")) is done
