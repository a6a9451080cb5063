"""Queueing a task whose acknowledgement is lost: the task is taken as queued, never failed.

While a cluster elects a stream's leader, a publish can be stored and its acknowledgement
lost. Recording the task failed would tell its client "failed" for a task that then runs."""

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
from services.router.decide import Plan, submission
from services.router.submit import submit
from services.runtime.bus import ensure_streams
from tests.harness import last_task_event


async def test_a_task_whose_queueing_is_not_acknowledged_is_taken_as_queued(
    nc: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    js = nc.jetstream()
    await ensure_streams(js, worker_ttl_s=3.0)
    monkeypatch.setattr(submit_module, "OUTAGE_RETRY_S", 0.5)
    publish = js.publish
    sent: list[PubAck] = []

    async def acknowledgement_lost(subject: str, payload: bytes = b"", **kw: Any) -> PubAck:
        ack = await publish(subject, payload, **kw)
        if subject.startswith("tasks."):
            sent.append(ack)
            raise nats.errors.TimeoutError  # stored, but the client never hears so
        return ack

    monkeypatch.setattr(js, "publish", acknowledgement_lost)
    task = submission(
        "t-lost-ack",
        RouteRequest(prompt="1+1", model="qwen2.5:0.5b", wait=True),
        Plan(Decision("cpu-1", "cpu", "tasks.cpu.cpu-1", "test")),
        asked_model="qwen2.5:0.5b",
        now=0.0,
        default_timeout_s=60.0,
        reply_to="_INBOX.x",
    )

    assert await submit(js, task) == 0
    # Sent again through the outage, stored once (its message id), and not failed.
    assert len(sent) >= 2 and all(ack.seq == sent[0].seq for ack in sent[1:])
    assert sum(not ack.duplicate for ack in sent) == 1
    stored = await js.get_last_msg("TASKS", "tasks.cpu.cpu-1")
    assert stored.seq == sent[0].seq
    with pytest.raises(NotFoundError):
        await last_task_event(js, "t-lost-ack", "failed")
