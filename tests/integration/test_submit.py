"""Queueing a task through an outage: tried until the stream holds its message, and failed,
explicitly, only when it never does within the window.

While a cluster elects a stream's leader, a publish can be stored and its acknowledgement
lost, and the tries after it answered by nobody. Given up on too soon, a stored message would
run while its client is told the task failed; taken as queued without knowing, a message
that was never stored would be lost. The message id settles it: a later try of a stored
message is acknowledged as a duplicate."""

from __future__ import annotations

from typing import Any

import nats.errors
import pytest
from nats.aio.client import Client
from nats.js.api import PubAck
from nats.js.errors import NotFoundError

from schemas.route import RouteRequest
from services.fleet.policy import Decision
from services.router import submit as submit_module
from services.router.decide import Plan, Submission, submission
from services.router.submit import submit
from services.runtime.bus import ensure_streams
from services.runtime.errors import Unavailable
from tests.harness import last_task_event

QUEUE = "tasks.cpu.cpu-1"


def task(task_id: str) -> Submission:
    return submission(
        task_id,
        RouteRequest(prompt="1+1", model="qwen2.5:0.5b", wait=True),
        Plan(Decision("cpu-1", "cpu", QUEUE, "test")),
        asked_model="qwen2.5:0.5b",
        now=0.0,
        default_timeout_s=60.0,
        reply_to="_INBOX.x",
    )


async def test_a_task_whose_acknowledgements_are_lost_is_queued_once_and_never_failed(
    nc: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    js = nc.jetstream()
    await ensure_streams(js, worker_ttl_s=3.0)
    publish = js.publish
    sent: list[PubAck] = []

    async def three_acks_lost(subject: str, payload: bytes = b"", **kw: Any) -> PubAck:
        ack = await publish(subject, payload, **kw)
        if subject.startswith("tasks."):
            sent.append(ack)
            if len(sent) <= 3:
                raise nats.errors.TimeoutError  # stored, but the client never hears so
        return ack

    monkeypatch.setattr(js, "publish", three_acks_lost)

    seq = await submit(js, task("t-lost-acks"))

    # Stored by the first try; the later ones were taken as duplicates of it.
    assert seq == sent[0].seq and len(sent) == 4
    assert [bool(ack.duplicate) for ack in sent] == [False, True, True, True]
    assert (await js.get_last_msg("TASKS", QUEUE)).seq == seq
    with pytest.raises(NotFoundError):
        await last_task_event(js, "t-lost-acks", "failed")


async def test_a_task_that_cannot_be_queued_within_the_window_fails_explicitly(
    nc: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    js = nc.jetstream()
    await ensure_streams(js, worker_ttl_s=3.0)
    monkeypatch.setattr(submit_module, "QUEUE_RETRY_S", 0.5)
    publish = js.publish

    async def no_stream_answers(subject: str, payload: bytes = b"", **kw: Any) -> PubAck:
        if subject.startswith("tasks."):
            raise nats.errors.NoRespondersError  # a stream without a leader: not stored
        return await publish(subject, payload, **kw)

    monkeypatch.setattr(js, "publish", no_stream_answers)

    with pytest.raises(Unavailable, match="could not queue the task"):
        await submit(js, task("t-never-queued"))
    failed = await last_task_event(js, "t-never-queued", "failed")
    assert b'"code":"unavailable"' in (failed.data or b"")
