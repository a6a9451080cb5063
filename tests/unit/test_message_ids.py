"""The deduplication ids: two different writes never share one, the same write always has it."""

from __future__ import annotations

from schemas import message_ids


def every_id_of(task_id: str, attempt: int) -> list[str]:
    return [
        message_ids.submitted(task_id),
        message_ids.routed(task_id, attempt),
        message_ids.routed_again_as_failed(task_id, attempt),
        message_ids.task_message(task_id, attempt),
        message_ids.outcome(task_id, attempt),
        message_ids.outcome(task_id, attempt, "cpu1"),
        message_ids.outcome(task_id, attempt, "cpu2"),
        message_ids.failed_before_routing(task_id, "router"),
        message_ids.failed_before_routing(task_id, "wake"),
        message_ids.quality(task_id),
    ]


def test_no_two_writes_of_a_task_share_an_id() -> None:
    ids = [i for attempt in (1, 2, 10) for i in every_id_of("t-1", attempt)]
    # submitted, failed_before_routing and quality are per task: asked for each attempt alike.
    assert len(set(ids)) == len(every_id_of("t-1", 1)) + 2 * 6
    assert not set(every_id_of("t-1", 1)) & set(every_id_of("t-2", 1))


def test_a_write_asked_again_has_the_same_id() -> None:
    assert every_id_of("t-1", 2) == every_id_of("t-1", 2)
    assert message_ids.registered("i-1") == message_ids.registered("i-1")
    assert message_ids.registered("i-1") != message_ids.registered("i-2")
