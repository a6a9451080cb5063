"""The router's pure steps: the task a request becomes, and the reply its outcome makes."""

from __future__ import annotations

import pytest

from schemas.events import Durations, TaskCompleted, TaskFailed
from schemas.route import ErrorDetail, RouteRequest
from services.errors import BadRequest
from services.fleet.policy import Decision
from services.router.decide import Plan, Submission, submission
from services.router.records import latest_outcome, outcome_reply, queued_reply, submitted_event

DECISION = Decision("mac", "gpu", "tasks.gpu.mac", "least expected completion")
REQUEST = RouteRequest(prompt="2+2", model="qwen3:8b", wait=True)


def task(
    request: RouteRequest = REQUEST, *, asked: str = "qwen3:8b", reply_to: str = "_INBOX.1"
) -> Submission:
    return submission(
        "t-1",
        request,
        Plan(DECISION),
        asked_model=asked,
        now=100.0,
        default_timeout_s=300.0,
        reply_to=reply_to,
    )


def failed(attempt: int, code: str = "backend_error") -> TaskFailed:
    return TaskFailed(at=1.0, task_id="t-1", attempt=attempt, worker="mac", code=code, reason="x")


def completed(attempt: int) -> TaskCompleted:
    return TaskCompleted(
        at=1.0,
        task_id="t-1",
        attempt=attempt,
        worker="pc",
        model="qwen3:8b",
        response="4",
        durations=Durations(total_ms=1.0),
    )


def test_a_submission_takes_the_default_timeout_and_names_the_model_asked_for() -> None:
    resolved = task(asked="qwen3")
    assert (resolved.timeout_s, resolved.waits, resolved.stream_subject) == (300.0, True, None)
    assert submitted_event(resolved).requested_model == "qwen3"
    assert submitted_event(task()).requested_model is None


def test_a_stream_needs_a_reply_subject() -> None:
    streamed = RouteRequest(prompt="2+2", model="m", stream=True)
    assert task(streamed).stream_subject == "_INBOX.1"
    with pytest.raises(BadRequest, match="stream=true needs a reply subject"):
        task(streamed, reply_to="")


def test_a_failed_outcome_replies_with_its_code_and_reason_apart() -> None:
    reply = outcome_reply(task(), failed(1, "backend_timeout"))
    assert reply.failure == ErrorDetail(code="backend_timeout", message="x")
    assert (reply.status, reply.error, reply.worker) == ("failed", "backend_timeout: x", "mac")


def test_a_done_outcome_replies_with_the_output_and_no_failure() -> None:
    reply = outcome_reply(task(), completed(1))
    assert (reply.status, reply.response, reply.worker, reply.queue) == (
        "done",
        "4",
        "pc",
        "tasks.gpu.mac",
    )
    assert (reply.failure, reply.error) == (None, None)
    assert queued_reply(task()).status == "queued"


def test_the_latest_attempt_answers_and_a_completion_beats_a_failure() -> None:
    assert latest_outcome([]) is None
    assert latest_outcome([failed(2), completed(1)]) == failed(2)
    assert latest_outcome([failed(2), completed(2)]) == completed(2)
