"""The cancel notices a worker remembers: a client's stops every attempt, a move's only the
attempts it replaced, so the moved task can still run here."""

from __future__ import annotations

import msgspec

from schemas.route import CancelNotice
from services.runtime.attempts import CancelMemory


def test_a_clients_cancel_stops_every_attempt() -> None:
    memory = CancelMemory()
    memory.remember(CancelNotice(task_id="t", reason="client went away"))
    for attempt in (1, 2, 7):
        notice = memory.stopping("t", attempt)
        assert notice is not None and notice.reason == "client went away"
    assert memory.stopping("other", 1) is None


def test_a_moves_cancel_stops_only_the_attempts_it_replaced() -> None:
    memory = CancelMemory()
    memory.remember(CancelNotice(task_id="t", reason="moved", up_to_attempt=1))
    assert memory.stopping("t", 1) is not None
    assert memory.stopping("t", 2) is None  # the new attempt runs, even on this worker


def test_of_two_notices_for_a_task_the_wider_is_kept() -> None:
    memory = CancelMemory()
    memory.remember(CancelNotice(task_id="t", reason="client", up_to_attempt=None))
    kept = memory.remember(CancelNotice(task_id="t", reason="moved", up_to_attempt=2))
    assert kept.up_to_attempt is None and memory.stopping("t", 3) is not None
    memory.remember(CancelNotice(task_id="u", up_to_attempt=3))
    memory.remember(CancelNotice(task_id="u", up_to_attempt=1))
    assert memory.stopping("u", 3) is not None and memory.stopping("u", 4) is None


def test_the_oldest_notices_are_forgotten_first() -> None:
    memory = CancelMemory(capacity=2)
    for task_id in ("a", "b", "c"):
        memory.remember(CancelNotice(task_id=task_id))
    assert memory.stopping("a", 1) is None
    assert memory.stopping("b", 1) is not None and memory.stopping("c", 1) is not None


def test_an_old_router_notice_without_attempts_decodes_as_a_cancel_of_every_attempt() -> None:
    notice = msgspec.json.decode(
        b'{"task_id": "t", "reason": "r", "reply_to": null}', type=CancelNotice
    )
    assert notice.stops(1) and notice.stops(9)
