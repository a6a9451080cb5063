"""Queueing a task through an outage: tried until the stream holds its message, and failed,
explicitly, only when it never does within the window.

While a cluster elects a stream's leader, a publish can be stored and its acknowledgement
lost, and the tries after it answered by nobody. Given up on too soon, a stored message would
run while its client is told the task failed; taken as queued without knowing, a message
that was never stored would be lost. The message id settles it: a later try of a stored
message is acknowledged as a duplicate.

And a task a router refused first (its request named the task, and no router said it held
it) is never stored after the refusal, nor the refusal after the task: one of the two wins."""

from __future__ import annotations

import asyncio
from typing import Any

import nats.errors
import pytest
from nats.aio.client import Client
from nats.js.api import PubAck
from nats.js.errors import APIError, NotFoundError

from schemas.events import TaskFailed, TaskRouted, task_event_decoder
from schemas.route import RouteRequest
from services.errors import NoWorker, Unavailable
from services.fleet.policy import Decision
from services.router.decide import Plan, Submission, submission
from services.router.submit import AlreadySubmitted, record_refusal, submit
from services.runtime import dispatch as dispatch_module
from services.runtime.bus import ensure_streams, publish_event
from tests.harness import last_task_event
from tests.integration.test_follow import count_events

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

    seq = await submit(js, task("t-lost-acks"), fences=True)

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
    monkeypatch.setattr(dispatch_module, "OUTAGE_RETRY_S", 0.5)
    publish = js.publish

    async def no_stream_answers(subject: str, payload: bytes = b"", **kw: Any) -> PubAck:
        if subject.startswith("tasks."):
            raise nats.errors.NoRespondersError  # a stream without a leader: not stored
        return await publish(subject, payload, **kw)

    monkeypatch.setattr(js, "publish", no_stream_answers)

    with pytest.raises(Unavailable, match="could not queue the task"):
        await submit(js, task("t-never-queued"), fences=True)
    failed = await last_task_event(js, "t-never-queued", "failed")
    assert b'"code":"unavailable"' in (failed.data or b"")


async def test_a_routing_whose_write_never_answers_is_not_failed_by_this_router(
    nc: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client asked twice, through two routers, during an election: the first router's
    routing was stored and its task queued; the second's ``routed`` went unanswered. That one
    must not record the task as failed: the task runs, and its client would be told it failed."""
    js = nc.jetstream()
    await ensure_streams(js, worker_ttl_s=3.0)
    first = task("t-two-routers")
    await submit(js, first, fences=True)
    monkeypatch.setattr(dispatch_module, "OUTAGE_RETRY_S", 0.5)
    publish = js.publish

    async def routed_unanswered(subject: str, payload: bytes = b"", **kw: Any) -> PubAck:
        if subject.endswith(".routed"):
            raise nats.errors.TimeoutError  # no leader yet: the write gets no answer
        return await publish(subject, payload, **kw)

    monkeypatch.setattr(js, "publish", routed_unanswered)

    with pytest.raises(Unavailable, match="could not record the task"):
        await submit(js, task("t-two-routers"), fences=True)
    with pytest.raises(NotFoundError):
        await last_task_event(js, "t-two-routers", "failed")
    assert (await js.get_last_msg("TASKS", QUEUE)).seq is not None


async def test_a_routing_moved_on_meanwhile_is_not_failed_by_its_router(
    nc: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """This router's routing was stored but its message could not be queued; meanwhile the
    reaper found the task unqueued and routed it again. The failure the router would record
    is refused: it belongs to an attempt that was moved on."""
    js = nc.jetstream()
    await ensure_streams(js, worker_ttl_s=3.0)
    monkeypatch.setattr(dispatch_module, "OUTAGE_RETRY_S", 0.5)
    publish = js.publish

    async def moved_while_queueing(subject: str, payload: bytes = b"", **kw: Any) -> PubAck:
        if subject.startswith("tasks."):
            moved = TaskRouted(
                at=1.0, task_id="t-moved", attempt=2, worker="cpu-2", queue="tasks.cpu.cpu-2"
            )
            await publish_event(js, moved, msg_id="t-moved:routed:2")
            raise nats.errors.NoRespondersError
        return await publish(subject, payload, **kw)

    monkeypatch.setattr(js, "publish", moved_while_queueing)

    with pytest.raises(Unavailable, match="could not queue the task"):
        await submit(js, task("t-moved"), fences=True)
    with pytest.raises(NotFoundError):
        await last_task_event(js, "t-moved", "failed")


async def test_a_write_whose_earlier_try_is_still_being_stored_is_sent_again(
    nc: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """During an election the stream answers a second try of a message id it is still storing
    with 409 ("duplicate message id is in process"): not a failure, a "not yet"."""
    js = nc.jetstream()
    await ensure_streams(js, worker_ttl_s=3.0)
    publish = js.publish
    busy = 0

    async def in_process_twice(subject: str, payload: bytes = b"", **kw: Any) -> PubAck:
        nonlocal busy
        if subject.endswith(".submitted") and busy < 2:
            busy += 1
            raise APIError(
                code=409, err_code=10158, description="duplicate message id is in process"
            )
        return await publish(subject, payload, **kw)

    monkeypatch.setattr(js, "publish", in_process_twice)

    await submit(js, task("t-in-process"), fences=True)

    assert busy == 2
    assert (await last_task_event(js, "t-in-process", "submitted")).data
    with pytest.raises(NotFoundError):
        await last_task_event(js, "t-in-process", "failed")


async def test_a_task_a_router_refused_first_is_not_stored_after_the_refusal(nc: Client) -> None:
    """The router that held the request (its connection moving to another server when the
    other router asked) stores it after the other refused it: its writes are refused, and it
    follows the refusal."""
    js = nc.jetstream()
    await ensure_streams(js, worker_ttl_s=3.0)

    assert await record_refusal(js, "t-refused", NoWorker("no worker is registered and alive"))
    with pytest.raises(AlreadySubmitted):
        await submit(js, task("t-refused"), fences=True)

    refusal = task_event_decoder.decode(
        (await last_task_event(js, "t-refused", "failed")).data or b""
    )
    assert isinstance(refusal, TaskFailed)
    assert (refusal.attempt, refusal.code) == (0, "no_worker")
    assert await count_events(nc, "t-refused", "routed") == 0  # a submitted runs nothing
    with pytest.raises(NotFoundError):
        await js.get_last_msg("TASKS", QUEUE)
    # A second router refusing the request asked again: the one refusal, stored once.
    assert await record_refusal(js, "t-refused", NoWorker("no worker is registered and alive"))
    assert await count_events(nc, "t-refused", "failed") == 1


async def test_a_refusal_is_not_stored_once_the_task_is(nc: Client) -> None:
    js = nc.jetstream()
    await ensure_streams(js, worker_ttl_s=3.0)
    await submit(js, task("t-stored"), fences=True)

    assert not await record_refusal(js, "t-stored", NoWorker("no worker is registered and alive"))
    assert await count_events(nc, "t-stored", "failed") == 0
    assert (await js.get_last_msg("TASKS", QUEUE)).data


async def test_a_refusal_stored_between_the_tasks_two_writes_wins(
    nc: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``submitted`` stored, ``routed`` not yet: the refusal is stored (a ``submitted`` runs
    nothing), and the routing refused: nothing is queued."""
    js = nc.jetstream()
    await ensure_streams(js, worker_ttl_s=3.0)
    publish = js.publish
    refused: list[bool] = []
    stored = asyncio.Event()

    async def refusal_between(subject: str, payload: bytes = b"", **kw: Any) -> PubAck:
        if subject.endswith(".routed"):
            await stored.wait()
            refused.append(
                await record_refusal(js, "t-between", NoWorker("no worker is registered"))
            )
        ack = await publish(subject, payload, **kw)
        if subject.endswith(".submitted"):
            stored.set()
        return ack

    monkeypatch.setattr(js, "publish", refusal_between)

    with pytest.raises(AlreadySubmitted):
        await submit(js, task("t-between"), fences=True)

    assert refused == [True]
    assert await count_events(nc, "t-between", "failed") == 1
    assert await count_events(nc, "t-between", "routed") == 0
    with pytest.raises(NotFoundError):
        await js.get_last_msg("TASKS", QUEUE)
