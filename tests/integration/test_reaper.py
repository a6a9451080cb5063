"""The reaper against a real nats-server: each detector, each action, and the fencing."""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import nats.errors
import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError
from structlog.testing import capture_logs

from devtools.fakes.ollama import FakeOllama
from devtools.servers import NatsServer
from schemas import message_ids
from schemas.events import (
    Durations,
    TaskCompleted,
    TaskEvent,
    TaskFailed,
    TaskRouted,
    TaskStarted,
    TaskSubmitted,
    WorkerDuplicate,
    kind_of,
)
from schemas.models import ModelFacts
from schemas.tasks import TaskMessage
from schemas.work import ModelChange, Work
from schemas.workers import WorkerRecord
from services.backends import Embedding, Generation, OnModelProgress
from services.fleet.dispatch import routed_event
from services.fleet.policy import Decision
from services.reaper.actions import Actions
from services.reaper.decisions import Fail, Move
from services.reaper.detectors import TaskFinding
from services.reaper.handling import FindingHandler
from services.reaper.settings import ReaperSettings
from services.reaper.view import ReaperView, TaskTrack
from services.runtime import outcomes
from services.runtime.bus import ensure_streams, publish_event
from services.runtime.settings import WorkerSettings
from services.worker.service import serve as serve_worker
from tests.harness import (
    COORDINATOR,
    FAST_WORKER,
    Processes,
    ServiceRunner,
    clean_env,
    eventually,
    request,
    workers_live,
)
from tests.reaper_harness import (
    MODEL,
    Registration,
    TaskEvents,
    queued_copies,
    queued_messages,
)

SPOF = "no alternative worker can serve model '{model}' (reason={reason}); single point of failure"


async def route(nc: Client, **fields: Any) -> dict[str, Any]:
    body, _ = await request(nc, "coordinator.route", {"prompt": "1+1", "model": MODEL, **fields})
    return body


def worker_env(nats_server: NatsServer, ollama: FakeOllama, worker_id: str) -> dict[str, str]:
    return clean_env(
        NATS_URL=nats_server.url,
        OLLAMA_HOST=ollama.url,
        WORKER_ID=worker_id,
        WORKER_HOST=f"host-{worker_id}",
        HEARTBEAT_INTERVAL_S="0.5",
        WORKER_TTL_S="3",
        WORKER_MODELS=MODEL,  # one sanity run at start
    )


def reaper_answers(nc: Client) -> Callable[[], Awaitable[bool]]:
    async def ping() -> bool:
        try:
            await nc.request("$SRV.PING.coordinator-reaper", b"", timeout=1)
        except Exception:
            return False
        return True

    return ping


# -- dead worker --------------------------------------------------------------------------------


async def test_a_killed_workers_running_and_queued_tasks_run_elsewhere_and_never_on_its_return(
    nats_server: NatsServer,
    nc: Client,
    ollama: FakeOllama,
    runner: ServiceRunner,
    processes: Processes,
) -> None:
    runner.router(nats_server.url)
    # Its queued tasks would be ghosts too if this took longer than the dead worker's TTL.
    runner.reaper(nats_server.url, ghost_after_s=30.0)
    with FakeOllama() as slow:
        env = worker_env(nats_server, slow, "cpu-a")
        doomed = processes.start([COORDINATOR, "worker"], env)
        await workers_live(nc, 1)
        slow.delay_s = 30.0
        async with TaskEvents(nc) as events:
            ids = [(await route(nc, prompt=f"{i}+1"))["task_id"] for i in range(3)]
            await events.wait_for(lambda e: isinstance(e, TaskStarted) and e.task_id == ids[0])
            runner.worker(nats_server.url, ollama.url, "cpu-b")
            await workers_live(nc, 2)

            doomed.send_signal(signal.SIGKILL)
            await asyncio.to_thread(doomed.wait)
            for task_id in ids:
                done = await events.first("completed", task_id)
                assert isinstance(done, TaskCompleted)
                assert (done.worker, done.attempt) == ("cpu-b", 2)
                moved = events.of(task_id, "routed")[-1]
                assert isinstance(moved, TaskRouted)
                assert moved.attempt == 2
                assert "dead_worker" in moved.reason
            # The old queue's copies (the running one included) are gone ...
            assert await queued_copies(nc, "tasks.cpu.cpu-a") == []

            # ... so the worker, back again, runs none of them.
            slow.delay_s = 0.0
            calls = slow.stats()["generate_calls"]
            processes.start([COORDINATOR, "worker"], env)

            async def back() -> bool:
                return slow.stats()["generate_calls"] > calls  # its sanity run

            await eventually(back, timeout_s=15)
            await asyncio.sleep(1.5)
            assert slow.stats()["generate_calls"] == calls + 1
            assert all(len(events.of(t, "completed")) == 1 for t in ids)


async def test_a_dead_workers_task_fails_naming_the_model_when_no_other_worker_serves_it(
    nats_server: NatsServer, nc: Client, runner: ServiceRunner
) -> None:
    runner.router(nats_server.url)
    runner.reaper(nats_server.url, ghost_after_s=30.0)  # not pulling is not what kills it here
    async with Registration(nc, "cpu-a") as lone, TaskEvents(nc) as events:
        await workers_live(nc, 1)
        asked = asyncio.create_task(route(nc, wait=True))
        routed = await events.wait_for(lambda e: isinstance(e, TaskRouted))
        lone.silence()  # it dies before taking the task

        reply = await asyncio.wait_for(asked, timeout=15)
        await events.ended(routed.task_id, "failed")  # the reply may come before the feed has it

    assert reply["status"] == "failed"
    assert reply["error"] == "no_alternative_worker: " + SPOF.format(
        model=MODEL, reason="dead_worker"
    )
    failed = events.of(routed.task_id, "failed")
    assert [(e.attempt, e.worker) for e in failed if isinstance(e, TaskFailed)] == [(1, "cpu-a")]
    assert await queued_copies(nc, "tasks.cpu.cpu-a") == []


# -- stuck task ---------------------------------------------------------------------------------


class WedgedBackend:
    """A model server whose generation never ends, whatever the timeout (a wedged GPU driver)."""

    address = "wedged://test"

    async def list_models(self) -> list[str]:
        return [MODEL]

    async def generate(self, model: str, work: Work, **_: Any) -> Generation:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async def embed(self, model: str, work: Work, **_: Any) -> Embedding:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async def model_facts(self, served: list[str]) -> dict[str, ModelFacts]:
        return {}

    async def resident_models(self) -> None:
        return None

    async def change_model(
        self, model: str, change: ModelChange, *, timeout_s: float, on_progress: OnModelProgress
    ) -> None:
        raise AssertionError("no model is changed here")

    async def aclose(self) -> None:
        pass


async def run_wedged(settings: WorkerSettings, stop: asyncio.Event) -> None:
    from services.runtime.bus import connect

    nc = await connect(settings.nats_url, "wedged")
    try:
        await serve_worker(nc, settings, WedgedBackend(), stop)
    finally:
        await nc.drain()


async def test_a_task_running_past_its_timeout_is_moved_to_another_worker(
    nats_server: NatsServer, nc: Client, ollama: FakeOllama, runner: ServiceRunner
) -> None:
    runner.router(nats_server.url)
    runner.reaper(nats_server.url)
    runner.start(
        run_wedged,
        WorkerSettings(
            nats_url=nats_server.url,
            worker_id="cpu-a",
            sanity_check=False,
            heartbeat_interval_s=FAST_WORKER["heartbeat_interval_s"],
            worker_ttl_s=FAST_WORKER["worker_ttl_s"],
            stop_grace_s=0.2,
        ),
    )
    runner.worker(nats_server.url, ollama.url, "cpu-b")
    await workers_live(nc, 2)
    async with TaskEvents(nc) as events:
        reply = await route(nc, wait=True, timeout_s=1.0)
        await events.ended(reply["task_id"], "completed")

        assert (reply["status"], reply["worker"], reply["response"]) == ("done", "cpu-b", "2")
        started = events.of(reply["task_id"], "started")
        assert [(e.attempt, e.worker) for e in started if isinstance(e, TaskStarted)] == [
            (1, "cpu-a"),
            (2, "cpu-b"),
        ]
        moved = events.of(reply["task_id"], "routed")[-1]
        assert isinstance(moved, TaskRouted)
        assert "stuck_task" in moved.reason
        assert "past its timeout of 1 s" in moved.reason


# -- ghost queue --------------------------------------------------------------------------------


async def test_a_task_queued_for_a_worker_that_does_not_pull_is_moved_or_failed_as_a_ghost(
    nats_server: NatsServer, nc: Client, ollama: FakeOllama, runner: ServiceRunner
) -> None:
    runner.router(nats_server.url)
    runner.reaper(nats_server.url)
    async with Registration(nc, "aaa-ghost"), TaskEvents(nc) as events:
        await workers_live(nc, 1)
        # Registered, heartbeating, pulling nothing, and the only one with the model.
        alone = await route(nc, wait=True)
        assert alone["status"] == "failed"
        assert alone["error"] == "no_alternative_worker: " + SPOF.format(
            model=MODEL, reason="ghost_pending"
        )
        assert await queued_copies(nc, "tasks.cpu.aaa-ghost") == []

        runner.worker(nats_server.url, ollama.url, "cpu-b")
        await workers_live(nc, 2)
        moved = await route(nc, wait=True)  # to aaa-ghost first (same depth, first by name)
        await events.ended(moved["task_id"], "completed")

        assert (moved["status"], moved["worker"]) == ("done", "cpu-b")
        first, second = events.of(moved["task_id"], "routed")
        assert isinstance(first, TaskRouted)
        assert isinstance(second, TaskRouted)
        assert (first.worker, second.worker, second.attempt) == ("aaa-ghost", "cpu-b", 2)
        assert "ghost_pending" in second.reason
        assert "consumer worker-aaa-ghost does not exist" in second.reason


async def test_a_task_whose_message_went_missing_behind_a_busy_worker_is_queued_again_at_once(
    nats_server: NatsServer, nc: Client, ollama: FakeOllama, runner: ServiceRunner
) -> None:
    """The worker is busy with a long task; the message of the task queued behind it is lost.
    Its queue then holds fewer messages than the tasks waiting on it: the task is queued again
    for the worker it was asked of, while that worker is still busy, not found only once the
    worker is idle (nor failed as a named worker's ghost)."""
    runner.router(nats_server.url)
    runner.reaper(nats_server.url)
    runner.worker(nats_server.url, ollama.url, "cpu-a")
    await workers_live(nc, 1)
    ollama.configure(chunk_delay_s=0.25)
    long_prompt = " ".join(f"word{i}" for i in range(40))  # about 10 s
    js = nc.jetstream()
    async with TaskEvents(nc) as events:
        first = await route(nc, prompt=long_prompt, worker="cpu-a")
        second = await route(nc, worker="cpu-a")

        async def behind() -> int | None:
            found = [seq for _, seq in await queued_messages(nc, "tasks.cpu.cpu-a")]
            return found[-1] if len(found) == 2 else None

        lost = await eventually(behind)
        await js.delete_msg("TASKS", lost)

        body, _ = await request(
            nc,
            "coordinator.route",
            {"prompt": "1+1", "model": MODEL, "task_id": second["task_id"], "wait": True},
            timeout_s=60,
        )
        assert (body["status"], body["worker"]) == ("done", "cpu-a"), body
        await events.ended(second["task_id"], "completed")
        await events.ended(first["task_id"], "completed")
        # Queued again (the same worker, the next attempt) while the first task still ran.
        routed = [e for e in events.of(second["task_id"], "routed") if isinstance(e, TaskRouted)]
        assert [(r.attempt, r.worker) for r in routed] == [(1, "cpu-a"), (2, "cpu-a")]
        assert "its message is missing from the queue" in routed[-1].reason
        [first_end] = events.of(first["task_id"], "completed")
        assert events.events.index(routed[-1]) < events.events.index(first_end)


async def test_a_web_search_task_is_never_re_dispatched_it_fails_with_the_reason(
    nats_server: NatsServer, nc: Client, ollama: FakeOllama, runner: ServiceRunner
) -> None:
    runner.router(nats_server.url)
    runner.reaper(nats_server.url)
    runner.worker(nats_server.url, ollama.url, "cpu-b")  # could run a prompt, not a search
    async with Registration(nc, "web-1", supports=("web_search",)), TaskEvents(nc) as events:
        await workers_live(nc, 2)
        reply = await route(nc, wait=True, task_type="web_search", model="default")
        await events.ended(reply["task_id"], "failed")

        assert reply["status"] == "failed"
        assert reply["error"].startswith(
            "ghost_pending: web_search tasks are not re-dispatched (reason=ghost_pending): "
            "queued on tasks.web"
        )
        routed = events.of(reply["task_id"], "routed")
        # Attempt 1 only: its `routed` is stored once more as the failure moves its fence.
        assert {e.attempt for e in routed if isinstance(e, TaskRouted)} == {1}
        assert events.of(reply["task_id"], "started") == []


# -- duplicate consumer -------------------------------------------------------------------------


async def test_two_processes_pulling_one_workers_queue_are_reported_and_shown(
    nats_server: NatsServer,
    nc: Client,
    ollama: FakeOllama,
    runner: ServiceRunner,
    processes: Processes,
) -> None:
    runner.router(nats_server.url)
    runner.worker(nats_server.url, ollama.url, "cpu-1")
    await workers_live(nc, 1)
    duplicates = await nc.subscribe("events.worker.*.duplicate")
    with capture_logs() as logs:
        runner.reaper(nats_server.url)
        puller = processes.start(
            [sys.executable, "-m", "tests.integration.second_puller"],
            worker_env(nats_server, ollama, "cpu-1"),
        )
        assert puller.stdout is not None
        assert (await asyncio.to_thread(puller.stdout.readline)).strip() == "bound"

        event = msgspec.json.decode(
            (await duplicates.next_msg(timeout=10)).data, type=WorkerDuplicate
        )

    assert event.worker_id == "cpu-1"
    assert event.num_waiting == 2
    assert "2 pulls wait on worker-cpu-1" in event.reason
    errors = [e for e in logs if e["log_level"] == "error" and e["event"] == "duplicate worker"]
    assert errors and errors[0]["worker_id"] == "cpu-1"

    body, _ = await request(nc, "coordinator.workers", {})
    (shown,) = body["workers"]
    assert shown["problems"] == [f"duplicate_consumer: {event.reason}"]


async def test_two_instances_heartbeating_as_one_worker_id_are_reported(
    nats_server: NatsServer, nc: Client, runner: ServiceRunner
) -> None:
    duplicates = await nc.subscribe("events.worker.*.duplicate")
    runner.reaper(nats_server.url)
    async with Registration(nc, "cpu-9") as one, Registration(nc, "cpu-9") as other:
        event = msgspec.json.decode(
            (await duplicates.next_msg(timeout=10)).data, type=WorkerDuplicate
        )

    assert event.worker_id == "cpu-9"
    assert sorted(event.instances) == sorted([one.record.instance_id, other.record.instance_id])
    assert event.hosts == ["host-cpu-9"]

    async def counted() -> bool:
        # The event is delivered before the reaper has its acknowledgement and counts it.
        status, _ = await request(nc, "coordinator.reaper.status", {})
        return bool(status["duplicates"] == 1)

    await eventually(counted, timeout_s=5)


# -- retryable failures -------------------------------------------------------------------------


async def test_a_task_whose_backend_is_down_fails_fast_and_is_moved_on(
    nats_server: NatsServer, nc: Client, ollama: FakeOllama, runner: ServiceRunner
) -> None:
    runner.router(nats_server.url)
    runner.reaper(nats_server.url)
    with FakeOllama() as gone:
        runner.worker(nats_server.url, gone.url, "gpu-a", worker_supports=["gpu_inference"])
        runner.worker(nats_server.url, ollama.url, "cpu-b")
        await workers_live(nc, 2)
        await eventually(reaper_answers(nc))
    # gpu-a's model server is down now; the router still prefers the gpu worker.
    async with TaskEvents(nc) as events:
        started = time.monotonic()
        reply = await route(nc, wait=True)
        await events.ended(reply["task_id"], "completed")

    assert (reply["status"], reply["worker"], reply["response"]) == ("done", "cpu-b", "2")
    assert time.monotonic() - started < 5
    failed = events.of(reply["task_id"], "failed")[0]
    assert isinstance(failed, TaskFailed)
    assert (failed.attempt, failed.worker, failed.code, failed.retryable) == (
        1,
        "gpu-a",
        "backend_unavailable",
        True,
    )
    moved = events.of(reply["task_id"], "routed")[-1]
    assert isinstance(moved, TaskRouted)
    assert (moved.attempt, moved.worker) == (2, "cpu-b")
    assert "backend_unavailable" in moved.reason


async def test_a_retryable_failure_no_other_worker_can_take_fails_as_a_single_point(
    nats_server: NatsServer, nc: Client, runner: ServiceRunner
) -> None:
    runner.router(nats_server.url)
    runner.reaper(nats_server.url)
    with FakeOllama() as gone:
        runner.worker(nats_server.url, gone.url, "cpu-a")
        await workers_live(nc, 1)
        await eventually(reaper_answers(nc))
    async with TaskEvents(nc) as events:
        reply = await route(nc, wait=True)
        await events.wait_for(
            lambda e: (
                e.task_id == reply["task_id"]
                and isinstance(e, TaskFailed)
                and e.code == "no_alternative_worker"
            )
        )

    assert reply["status"] == "failed"
    assert reply["error"] == "no_alternative_worker: " + SPOF.format(
        model=MODEL, reason="backend_unavailable"
    )
    failures = [e for e in events.of(reply["task_id"], "failed") if isinstance(e, TaskFailed)]
    assert [(e.attempt, e.code) for e in failures] == [
        (1, "backend_unavailable"),
        (2, "no_alternative_worker"),
    ]


# -- fencing ------------------------------------------------------------------------------------


@pytest.mark.parametrize("carries_routed_seq", [True, False], ids=["fenced-publish", "looked-up"])
async def test_a_worker_drops_a_copy_of_an_attempt_that_was_moved_on_and_stops_its_call(
    nats_server: NatsServer,
    nc: Client,
    ollama: FakeOllama,
    runner: ServiceRunner,
    carries_routed_seq: bool,
) -> None:
    """With ``routed_seq`` the worker's ``started`` is refused by the stream itself; without
    (a message from an older router) the worker looks the current attempt up. Either way the
    stale copy leaves no event, and its backend call, if it had begun, is stopped."""
    js = nc.jetstream()
    runner.router(nats_server.url)
    runner.worker(nats_server.url, ollama.url, "cpu-a")
    await workers_live(nc, 1)
    ollama.delay_s = 1.0  # a stale call that got out is still running when it is stopped
    before = ollama.stats()
    now = time.time()
    routed_seq = {}
    for attempt, worker in ((1, "cpu-a"), (2, "cpu-b")):
        ack = await publish_event(
            js,
            TaskRouted(at=now, task_id="t-1", attempt=attempt, worker=worker, queue="q"),
        )
        routed_seq[attempt] = ack.seq
    async with TaskEvents(nc) as events:
        for attempt in (1, 2):
            message = TaskMessage(
                task_id="t-1",
                attempt=attempt,
                model=MODEL,
                timeout_s=10,
                submitted_at=now,
                routed_seq=routed_seq[attempt] if carries_routed_seq else None,
                work=Work(prompt="1+1"),
            )
            await js.publish("tasks.cpu.cpu-a", msgspec.json.encode(message))
        done = await events.first("completed")

    assert isinstance(done, TaskCompleted)
    assert done.attempt == 2  # the stale copy came first and was dropped
    assert [(kind_of(e), getattr(e, "attempt", None)) for e in events.events] == [
        ("started", 2),
        ("completed", 2),
    ]

    async def settled() -> bool:
        now = ollama.stats()
        calls = now["generate_calls"] - before["generate_calls"]
        stopped = now["cancelled"] - before["cancelled"]
        # Attempt 2 ran; the stale copy either never reached the backend or was stopped.
        return calls - stopped == 1 and await queued_copies(nc, "tasks.cpu.cpu-a") == []

    await eventually(settled, timeout_s=5)


async def test_a_copy_whose_routed_seq_is_off_but_whose_attempt_is_current_runs(
    nats_server: NatsServer, nc: Client, ollama: FakeOllama, runner: ServiceRunner
) -> None:
    """A refused fence is checked against the task's last ``routed`` before the copy is
    dropped: when that still names this attempt (its sequence changed, say the log was cut and
    the event stored again), the copy runs."""
    js = nc.jetstream()
    runner.router(nats_server.url)
    runner.worker(nats_server.url, ollama.url, "cpu-a")
    await workers_live(nc, 1)
    now = time.time()
    ack = await publish_event(
        js, TaskRouted(at=now, task_id="t-2", attempt=1, worker="cpu-a", queue="q")
    )
    async with TaskEvents(nc) as events:
        message = TaskMessage(
            task_id="t-2",
            attempt=1,
            model=MODEL,
            timeout_s=10,
            submitted_at=now,
            routed_seq=ack.seq + 1000,
            work=Work(prompt="1+1"),
        )
        await js.publish("tasks.cpu.cpu-a", msgspec.json.encode(message))
        done = await events.first("completed")

    assert isinstance(done, TaskCompleted) and done.response == "2"
    assert [kind_of(e) for e in events.events] == ["started", "completed"]


async def test_the_route_reply_is_the_current_attempts_outcome_not_a_late_older_one(
    nats_server: NatsServer, nc: Client, runner: ServiceRunner
) -> None:
    js = nc.jetstream()
    runner.router(nats_server.url)
    runner.reaper(nats_server.url, ghost_after_s=60.0)  # it runs, so failures may move on
    async with Registration(nc, "cpu-a"), TaskEvents(nc) as events:
        await workers_live(nc, 1)
        await eventually(reaper_answers(nc))
        asked = asyncio.create_task(route(nc, wait=True))
        routed = await events.wait_for(lambda e: isinstance(e, TaskRouted))
        task_id = routed.task_id

        def outcome(attempt: int, response: str) -> TaskCompleted:
            return TaskCompleted(
                at=time.time(),
                task_id=task_id,
                attempt=attempt,
                worker=f"w{attempt}",
                model=MODEL,
                response=response,
                durations=Durations(total_ms=1.0),
            )

        # A retryable failure is not the answer while the task may be moved on ...
        await publish_event(
            js,
            TaskFailed(
                at=time.time(),
                task_id=task_id,
                attempt=1,
                worker="cpu-a",
                code="backend_unavailable",
                reason="down",
                retryable=True,
            ),
        )
        await asyncio.sleep(0.5)
        assert not asked.done()
        # ... it was, as attempt 2; attempt 1's worker then answers late: stale.
        await publish_event(
            js, TaskRouted(at=time.time(), task_id=task_id, attempt=2, worker="w2", queue="q")
        )
        await publish_event(js, outcome(1, "stale"))
        await asyncio.sleep(0.2)
        assert not asked.done()
        await publish_event(js, outcome(2, "current"))

        reply = await asyncio.wait_for(asked, timeout=5)

    assert (reply["status"], reply["response"], reply["worker"]) == ("done", "current", "w2")


async def test_the_stats_read_model_keeps_the_current_attempts_answer_over_a_late_older_one(
    nats_server: NatsServer, nc: Client, runner: ServiceRunner, pg_dsn: str
) -> None:
    js = nc.jetstream()
    await ensure_streams(js)
    runner.stats(nats_server.url, pg_dsn)
    now = time.time()
    events: list[Any] = [
        TaskSubmitted(at=now, task_id="t-1", model=MODEL, timeout_s=60, work=Work(prompt="1+1")),
        TaskRouted(at=now, task_id="t-1", attempt=1, worker="cpu-a", queue="tasks.cpu.cpu-a"),
        TaskStarted(at=now, task_id="t-1", attempt=1, worker="cpu-a", host="a"),
        TaskRouted(at=now + 1, task_id="t-1", attempt=2, worker="cpu-b", queue="tasks.cpu.cpu-b"),
        TaskStarted(at=now + 1, task_id="t-1", attempt=2, worker="cpu-b", host="b"),
    ]
    for attempt, worker, response, at in ((2, "cpu-b", "current", 2), (1, "cpu-a", "stale", 3)):
        events.append(
            TaskCompleted(
                at=now + at,
                task_id="t-1",
                attempt=attempt,
                worker=worker,
                model=MODEL,
                response=response,
                durations=Durations(total_ms=5.0),
            )
        )
    for event in events:
        await publish_event(js, event)

    async def projected() -> dict[str, Any] | None:
        try:
            body, _ = await request(nc, "coordinator.task", {"task_id": "t-1"}, timeout_s=2)
        except Exception:
            return None
        return body if body.get("status") == "done" else None

    view = await eventually(projected, timeout_s=15)
    await asyncio.sleep(0.5)  # the stale completion is projected by now too
    body, _ = await request(nc, "coordinator.task", {"task_id": "t-1"})
    assert view["response"] == "current"
    assert (body["response"], body["worker"], body["attempts"]) == ("current", "cpu-b", 2)


async def test_the_stats_projection_takes_the_reapers_and_sleepers_worker_events_in_its_stride(
    pg_dsn: str,
) -> None:
    from schemas.events import AnyEvent, WakeRequested, WorkerAsleep
    from services.stats.store import Store

    events: list[AnyEvent] = [
        WorkerDuplicate(at=1.0, worker_id="cpu-1", reason="two pulls", num_waiting=2),
        WorkerAsleep(at=2.0, worker_id="pc", instance_id="i", models=[MODEL], idle_s=600),
        WakeRequested(at=3.0, worker_id="pc", mac="aa:bb:cc:dd:ee:ff", task_id="t", model=MODEL),
    ]
    store = await Store.connect(pg_dsn)
    try:
        await store.apply_schema()
        for seq, event in enumerate(events, start=1):
            assert await store.apply(seq, event)  # recorded as seen, nothing else: no error
        assert await store.last_seq() == 3
    finally:
        await store.close()


async def test_an_outcome_of_an_attempt_moved_on_while_it_ran_is_refused(
    nats_server: NatsServer, nc: Client, ollama: FakeOllama, runner: ServiceRunner
) -> None:
    """The reaper moved the task while its worker generated (the cancel notice never reached
    the worker: it was cut off, or judged dead while its outcome waited out an election).
    The worker's completion of the old attempt is refused by the stream: the task ends once,
    by the attempt that stands."""
    js = nc.jetstream()
    runner.router(nats_server.url)
    runner.worker(nats_server.url, ollama.url, "cpu-a")
    await workers_live(nc, 1)
    ollama.delay_s = 1.5
    now = time.time()
    routed_seq = await route_to_cpu_a(js, "t-3", now)
    async with TaskEvents(nc) as events:
        await queue_fenced(js, "t-3", now, routed_seq)
        await events.first("started", "t-3")
        # The move, as the reaper stores it, without its cancel notice.
        await publish_event(
            js, TaskRouted(at=now, task_id="t-3", attempt=2, worker="cpu-b", queue="q")
        )

        await eventually(lambda: generation_over(ollama), timeout_s=10)

        # Dropped, not returned: nothing is left on the queue, and no outcome was stored.
        async def dropped() -> bool:
            return await queued_copies(nc, "tasks.cpu.cpu-a") == []

        await eventually(dropped, timeout_s=5, interval_s=0.1)
        await asyncio.sleep(0.5)  # an outcome stored would have come back by now
        assert [kind_of(e) for e in events.of("t-3")] == ["started", "routed"]


async def test_a_worker_back_from_a_cut_stores_nothing_of_its_moved_attempt_whatever_it_reads(
    nc: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker whose node was cut off finishes its attempt, and meanwhile the reaper moved the
    task. Back, its fenced outcome (and a late ``started``) is refused; the copy of the log
    its own node gives may not have the move yet. The refusal says which ``routed`` is the
    last now, so nothing is stored, whatever a read of the log would say. A ``routed`` that
    is gone (the log cut) still lets the held outcome be stored."""
    js = nc.jetstream()
    await ensure_streams(js, worker_ttl_s=3.0)
    now = time.time()
    first = await publish_event(
        js, TaskRouted(at=now, task_id="t-cut", attempt=1, worker="cpu-a", queue="q")
    )
    await publish_event(
        js, TaskRouted(at=now, task_id="t-cut", attempt=2, worker="cpu-b", queue="q")
    )

    async def lagging_copy(js: JetStreamContext, task: TaskMessage) -> bool:
        return False  # a copy of the log that has not heard of the move

    monkeypatch.setattr(outcomes, "superseded", lagging_copy)
    task = TaskMessage(
        task_id="t-cut",
        attempt=1,
        model=MODEL,
        timeout_s=60,
        submitted_at=now,
        work=Work(prompt="1+1"),
        routed_seq=int(first.seq),
    )
    started = TaskStarted(at=now, task_id="t-cut", attempt=1, worker="cpu-a", host="h")
    done = TaskCompleted(
        at=now,
        task_id="t-cut",
        attempt=1,
        worker="cpu-a",
        model=MODEL,
        response="2",
        durations=Durations(total_ms=1.0),
    )
    async with TaskEvents(nc) as events:
        assert not await outcomes.claim(nc, js, started, task)
        assert not await outcomes.store_attempt_outcome(nc, js, task, done, "cpu-a", retry_s=1)
        await asyncio.sleep(0.3)  # anything stored would have come back by now
        assert events.of("t-cut") == []

        gone = msgspec.structs.replace(task, task_id="t-gone", routed_seq=int(first.seq))
        kept = msgspec.structs.replace(done, task_id="t-gone")
        assert await outcomes.store_attempt_outcome(nc, js, gone, kept, "cpu-a", retry_s=1)
        await events.first("completed", "t-gone")


async def test_a_move_that_races_the_tasks_completion_queues_nothing(
    nc: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reaper judged the task's worker dead from a view that lagged, and its check before
    acting read a copy of the log that lagged too: the worker's completion was stored just
    before the move. Once the move is routed, the stream's leader is asked, finds the
    completion, and the new attempt is never queued: the task ends once."""
    js = nc.jetstream()
    await ensure_streams(js, worker_ttl_s=3.0)
    now = time.time()
    task_id = "t-raced"
    events: list[tuple[TaskEvent, str | None]] = [
        (
            TaskSubmitted(
                at=now, task_id=task_id, model=MODEL, timeout_s=60, work=Work(prompt="1+1")
            ),
            None,
        ),
        (
            TaskRouted(at=now, task_id=task_id, attempt=1, worker="cpu-a", queue="tasks.cpu.cpu-a"),
            None,
        ),
        (TaskStarted(at=now, task_id=task_id, attempt=1, worker="cpu-a", host="h"), "cpu-a"),
    ]
    view = ReaperView()
    for event, by in events:
        await publish_event(js, event, by=by)
        view.apply(event, by)  # the view heard this much, and not the completion
    done = TaskCompleted(
        at=now,
        task_id=task_id,
        attempt=1,
        worker="cpu-a",
        model=MODEL,
        response="2",
        durations=Durations(total_ms=1),
    )
    await publish_event(js, done, by="cpu-a")
    view.put_worker(_live_record("cpu-b"))
    handler = FindingHandler(nc, view, ReaperSettings())

    async def lagging_copy(task: TaskTrack) -> bool:
        return False  # the direct read was answered by a copy that had not the completion yet

    monkeypatch.setattr(handler, "_settled", lagging_copy)
    with capture_logs() as logs:
        finding = TaskFinding(task_id, 1, "dead_worker", "cpu-a", "judged dead")
        await handler.act([finding], now)

    assert await queued_copies(nc, "tasks.cpu.cpu-b") == []
    assert handler.moved == 0
    assert any(e["event"].startswith("task ended as it was being moved") for e in logs)
    # The view then hears the log in order: the completion, then the routing that raced it,
    # which changes nothing.
    view.apply(done, "cpu-a")
    view.apply(TaskRouted(at=now, task_id=task_id, attempt=2, worker="cpu-b", queue="q"))
    assert view.tasks[task_id].status == "ended"


def _live_record(worker_id: str) -> WorkerRecord:
    now = time.time()
    return WorkerRecord(
        worker_id=worker_id,
        host=f"host-{worker_id}",
        instance_id=f"i-{worker_id}",
        pid=1,
        version="t",
        supports=["cpu_inference"],
        models=[MODEL],
        started_at=now - 100,
        heartbeat_at=now,
    )


async def test_an_attempt_failed_by_the_reaper_while_it_ran_stores_no_outcome(
    nats_server: NatsServer, nc: Client, ollama: FakeOllama, runner: ServiceRunner
) -> None:
    """The reaper judged the worker dead (it was only cut off) and, with no other worker,
    failed the task. The worker's completion that follows is refused: the client told the
    task failed is never contradicted by the log."""
    js = nc.jetstream()
    runner.router(nats_server.url)
    runner.worker(nats_server.url, ollama.url, "cpu-a")
    await workers_live(nc, 1)
    ollama.delay_s = 1.5
    now = time.time()
    routed_seq = await route_to_cpu_a(js, "t-4", now)
    async with TaskEvents(nc) as events:
        await queue_fenced(js, "t-4", now, routed_seq)
        await events.first("started", "t-4")
        await Actions(nc, js).fail(
            Fail("t-4", 1, "cpu-a", "no_alternative_worker", "judged dead"), copies=[]
        )

        await eventually(lambda: generation_over(ollama), timeout_s=10)
        await asyncio.sleep(1.0)  # an outcome stored would have come back by now
        assert [kind_of(e) for e in events.of("t-4")] == ["started", "routed", "failed"]
        [failed] = events.of("t-4", "failed")
        assert isinstance(failed, TaskFailed) and failed.code == "no_alternative_worker"


async def route_to_cpu_a(js: JetStreamContext, task_id: str, now: float) -> int:
    """Attempt 1 of ``task_id`` routed to cpu-a; its ``routed``'s sequence (the fence)."""
    ack = await publish_event(
        js, TaskRouted(at=now, task_id=task_id, attempt=1, worker="cpu-a", queue="q")
    )
    return int(ack.seq)


async def queue_fenced(js: JetStreamContext, task_id: str, now: float, routed_seq: int) -> None:
    """Attempt 1 of ``task_id`` queued on cpu-a, its message carrying the fence."""
    message = TaskMessage(
        task_id=task_id,
        attempt=1,
        model=MODEL,
        timeout_s=10,
        submitted_at=now,
        routed_seq=routed_seq,
        work=Work(prompt="1+1"),
    )
    await js.publish("tasks.cpu.cpu-a", msgspec.json.encode(message))


async def generation_over(ollama: FakeOllama) -> bool:
    stats = ollama.stats()
    return stats["generate_calls"] >= 1 and stats["in_flight"] == 0


async def test_a_move_of_a_task_its_router_routed_meanwhile_queues_nothing(nc: Client) -> None:
    """The reaper took a task for never routed (its router's writes held up by an election)
    while the router stored its routing: the move's ``routed`` is a duplicate of the router's,
    which stands. A copy queued where the move wanted would run where no outcome of it is
    taken (the attempt is routed to another worker), and its client would wait for ever."""
    js = nc.jetstream()
    await ensure_streams(js, worker_ttl_s=3.0)
    now = time.time()
    submitted = TaskSubmitted(
        at=now, task_id="t-late", model=MODEL, timeout_s=60, work=Work(prompt="1+1")
    )
    await publish_event(js, submitted, msg_id=message_ids.submitted("t-late"))
    by_router = Decision("cpu-a", "cpu", "tasks.cpu.cpu-a", "least loaded")
    routing = routed_event(submitted, 1, by_router, reason="least loaded", domain=None, at=now)
    await publish_event(js, routing, msg_id=message_ids.routed("t-late", 1))

    async def not_ended() -> bool:
        return False

    shared = Decision("shared", "cpu", "tasks.cpu.shared", "ghost_pending")
    actions = Actions(nc, js)
    moved = await actions.move(Move("t-late", 1, shared, "ghost_pending"), [], not_ended)
    # The same move asked where the stored routing sends it (a reaper asking again): queued.
    again = await actions.move(Move("t-late", 1, by_router, "ghost_pending"), [], not_ended)

    assert moved is False
    with pytest.raises(NotFoundError):
        await js.get_last_msg("TASKS", "tasks.cpu.shared")
    assert again is True
    queued = (await js.get_last_msg("TASKS", "tasks.cpu.cpu-a")).data or b""
    assert msgspec.json.decode(queued, type=TaskMessage).attempt == 1


async def test_a_move_rides_out_a_bus_outage_as_a_submit_does(
    nc: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A move's writes go out as the router's (`services.runtime.dispatch`): a routing and a
    message the server could not take for a moment (no leader yet) are sent again, and the
    task is queued, not left for the next pass to find as a ghost."""
    js = nc.jetstream()
    await ensure_streams(js, worker_ttl_s=3.0)
    submitted = TaskSubmitted(
        at=time.time(), task_id="t-outage", model=MODEL, timeout_s=60, work=Work(prompt="1+1")
    )
    await publish_event(js, submitted, msg_id=message_ids.submitted("t-outage"))
    publish = js.publish
    refused: list[str] = []

    async def no_leader_twice(subject: str, payload: bytes = b"", **kw: Any) -> Any:
        if sum(s == subject for s in refused) < 2:
            refused.append(subject)
            raise nats.errors.NoRespondersError  # a stream electing its leader
        return await publish(subject, payload, **kw)

    monkeypatch.setattr(js, "publish", no_leader_twice)

    async def not_ended() -> bool:
        return False

    to = Decision("cpu-b", "cpu", "tasks.cpu.cpu-b", "least loaded")
    moved = await Actions(nc, js).move(Move("t-outage", 2, to, "dead_worker"), [], not_ended)

    assert moved is True
    assert sorted(set(refused)) == ["events.task.t-outage.routed", "tasks.cpu.cpu-b"]
    queued = (await js.get_last_msg("TASKS", "tasks.cpu.cpu-b")).data or b""
    assert msgspec.json.decode(queued, type=TaskMessage).attempt == 2
