"""Web search end to end: router and web workers in-process, a real nats-server, and the
SearXNG and Ollama stand-ins over real sockets."""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import msgspec
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError
from structlog.testing import capture_logs

from devtools.fakes.ollama import FakeOllama
from devtools.fakes.searxng import FakeSearxng
from devtools.servers import NatsServer, free_port
from schemas.events import (
    TaskCompleted,
    TaskFailed,
    TaskRouted,
    TaskStarted,
    kind_of,
    task_event_decoder,
)
from schemas.subjects import TASKS_STREAM, WEB
from schemas.tasks import TaskMessage
from schemas.work import Work
from schemas.workers import Capability, WorkerRecord
from services import __version__
from services.errors import DuplicateWorker
from services.runtime import outcomes, redelivery
from services.runtime.bus import ensure_streams, publish_event
from services.runtime.consumers import WEB_POOL, ensure_consumer
from services.runtime.outcomes import Sourced
from services.runtime.settings import WebSearchSettings
from services.web_search.service import run as run_web_search
from tests.harness import (
    COORDINATOR,
    Processes,
    ServiceRunner,
    clean_env,
    eventually,
    last_task_event,
    request,
    run_cli,
    workers_live,
)
from tests.reaper_harness import TaskEvents

MODEL = "qwen2.5:0.5b"
QUESTION = "what is nats jetstream"

FAST: dict[str, Any] = {
    "heartbeat_interval_s": 0.5,
    "worker_ttl_s": 3.0,
    "ack_wait_s": 6.0,
    "stop_grace_s": 5.0,
    "search_timeout_s": 5.0,
    "summary_timeout_s": 5.0,
}


@pytest.fixture
def searxng() -> Iterator[FakeSearxng]:
    with FakeSearxng() as fake:
        yield fake


@dataclass
class Stack:
    """The servers and stand-ins of one test, and how to start web workers on them."""

    nats: NatsServer
    nc: Client
    searxng: FakeSearxng
    ollama: FakeOllama
    runner: ServiceRunner

    def settings(self, worker_id: str = "web-1", **overrides: Any) -> WebSearchSettings:
        options: dict[str, Any] = {
            "searxng_url": self.searxng.url,
            "ollama_host": self.ollama.url,
            "ollama_model": MODEL,
            "worker_host": f"host-{worker_id}",
            "searxng_results": 3,
            **FAST,
            **overrides,
        }
        return WebSearchSettings(nats_url=self.nats.url, worker_id=worker_id, **options)

    def web_worker(self, worker_id: str = "web-1", **overrides: Any) -> asyncio.Task[None]:
        return self.runner.start(run_web_search, self.settings(worker_id, **overrides))

    async def start(self, **overrides: Any) -> asyncio.Task[None]:
        """The router and one live web worker ("web-1"); returns the worker's task."""
        self.runner.router(self.nats.url)
        worker = self.web_worker(**overrides)
        await workers_live(self.nc, 1)
        return worker

    async def ask(self, prompt: str = QUESTION, **fields: Any) -> dict[str, Any]:
        body = {"prompt": prompt, "model": "default", "task_type": "web_search", "wait": True}
        reply, headers = await request(self.nc, "coordinator.route", {**body, **fields})
        assert "Nats-Service-Error-Code" not in headers, reply
        return reply

    async def event(self, task_id: str, kind: str) -> Any:
        msg = await last_task_event(self.nc.jetstream(), task_id, kind)
        return task_event_decoder.decode(msg.data or b"")

    async def tasks_queued(self) -> int:
        return int((await self.nc.jetstream().stream_info(TASKS_STREAM)).state.messages)

    async def all_acknowledged(self) -> None:
        """Every task message acknowledged (the ack follows the stored outcome, which the
        client may see first)."""

        async def empty() -> bool:
            return await self.tasks_queued() == 0

        await eventually(empty, timeout_s=5)


@pytest.fixture
def web(
    nats_server: NatsServer,
    nc: Client,
    searxng: FakeSearxng,
    ollama: FakeOllama,
    runner: ServiceRunner,
) -> Stack:
    return Stack(nats_server, nc, searxng, ollama, runner)


# -- the happy path ----------------------------------------------------------------------------


async def test_a_web_search_is_answered_from_the_top_results_which_it_lists(web: Stack) -> None:
    await web.start(searxng_categories=["news", "it"], searxng_language="en")

    reply = await web.ask()

    assert reply["status"] == "done"
    assert (reply["queue"], reply["worker"], reply["host"]) == ("tasks.web", "web-1", "host-web-1")
    assert reply["model"] == MODEL
    # The stand-in echoes the prompt's start: the summary model was asked to cite the results.
    assert reply["response"].startswith(f"Echo from {MODEL}: Answer the question below")
    assert "note" not in reply
    assert reply["sources"] == [
        {
            "title": f"{QUESTION} - result {i}",
            "url": f"https://example.org/what-is-nats-jetstream/{i}",
            "snippet": f"Snippet {i} about {QUESTION}: what this page says, in a sentence.",
        }
        for i in (1, 2, 3)
    ]
    assert web.searxng.stats()["last_params"] == {
        "q": QUESTION, "format": "json", "categories": "news,it", "language": "en",
    }  # fmt: skip
    completed = await web.event(reply["task_id"], "completed")
    assert isinstance(completed, TaskCompleted)
    assert [s.url for s in completed.sources or []] == [s["url"] for s in reply["sources"]]
    assert completed.durations.total_ms > 0 and completed.tokens.eval
    started = await web.event(reply["task_id"], "started")
    assert isinstance(started, TaskStarted) and started.host == "host-web-1"
    await web.all_acknowledged()

    # A request naming a model the backend serves is summarised by that model.
    other = await web.ask(model="gemma3:1b")
    assert other["model"] == "gemma3:1b"
    assert other["response"].startswith("Echo from gemma3:1b:")


async def test_the_summary_can_come_from_an_openai_compatible_server(web: Stack) -> None:
    with capture_logs() as logs:
        await web.start(summary_backend="openai", openai_base_url=f"{web.ollama.url}/v1")
        reply = await web.ask()

    assert reply["status"] == "done" and "note" not in reply
    assert reply["response"].startswith(f"Echo from {MODEL}: Answer the question below")
    assert len(reply["sources"]) == 3
    backend = next(e for e in logs if e["event"] == "backend OK")
    assert (backend["backend"], backend["url"]) == ("openai", f"{web.ollama.url}/v1")


# -- the summary fails: done, with the plain results and a note --------------------------------


@pytest.mark.parametrize(
    ("setup", "fields", "says"),
    [
        pytest.param(
            {"fail_status": 500}, {}, ["backend_server_error", "500"], id="backend answers 500"
        ),
        pytest.param(
            {"delay_s": 3.0, "summary_timeout_s": 0.5}, {}, ["backend_timeout", "0.5 s"],
            id="backend too slow",
        ),
        pytest.param(
            {}, {"model": "nope:1b"}, ["backend_error", "'nope:1b' not found"],
            id="model not served",
        ),
        pytest.param(
            {"replies": {QUESTION: ""}}, {}, ["returned an empty answer"], id="empty answer"
        ),
        pytest.param(
            {"searxng_delay_s": 0.6}, {"timeout_s": 1.5}, ["no time left"], id="no time left"
        ),
    ],
)  # fmt: skip
async def test_a_failed_summary_still_ends_done_with_the_results_and_a_note(
    setup: dict[str, Any], fields: dict[str, Any], says: list[str], web: Stack
) -> None:
    setup = dict(setup)
    web.searxng.delay_s = setup.pop("searxng_delay_s", 0.0)
    settings = (
        {"summary_timeout_s": setup.pop("summary_timeout_s")}
        if "summary_timeout_s" in setup
        else {}
    )
    await web.start(**settings)
    web.ollama.configure(**setup)

    reply = await web.ask(**fields)

    assert reply["status"] == "done", reply
    assert reply["note"].startswith("the summary failed (")
    for text in says:
        assert text in reply["note"]
    assert len(reply["sources"]) == 3
    assert reply["response"].startswith(f"1. {QUESTION} - result 1\n   https://example.org/")
    for source in reply["sources"]:
        assert source["url"] in reply["response"]
    completed = await web.event(reply["task_id"], "completed")
    assert isinstance(completed, TaskCompleted) and completed.note == reply["note"]


async def test_an_unreachable_summary_backend_falls_back_and_the_banner_says_so(
    web: Stack,
) -> None:
    nowhere = f"http://127.0.0.1:{free_port()}"
    with capture_logs() as logs:
        await web.start(ollama_host=nowhere)
        reply = await web.ask()

    assert reply["status"] == "done"
    assert "backend_unavailable" in reply["note"] and nowhere in reply["note"]
    warning = next(e for e in logs if e["event"].startswith("backend NOT OK"))
    assert warning["log_level"] == "warning"
    assert "backend_unavailable" in warning["error"]


# -- SearXNG fails: the task fails with the reason ---------------------------------------------


@pytest.mark.parametrize(
    ("knobs", "code", "says"),
    [
        pytest.param({"fail_status": 429}, "search_rate_limited", "HTTP 429", id="429"),
        pytest.param({"fail_status": 500}, "search_error", "HTTP 500: search error", id="500"),
        pytest.param({"fail_status": 502}, "search_unavailable", "HTTP 502", id="502"),
        pytest.param({"fail_status": 503}, "search_unavailable", "HTTP 503", id="503"),
        pytest.param({"mode": "not_json"}, "search_error", "not JSON (text/html", id="not json"),
        pytest.param({"json_enabled": False}, "search_error", "search.formats", id="no json api"),
        pytest.param({"mode": "empty"}, "no_results", "brave (too many requests)", id="empty"),
        pytest.param({"delay_s": 3.0}, "search_timeout", "within 0.5 s", id="too slow"),
    ],
)
async def test_a_failed_search_fails_the_task_with_the_reason(
    knobs: dict[str, Any], code: str, says: str, web: Stack
) -> None:
    await web.start(search_timeout_s=0.5)
    web.searxng.configure(**knobs)

    reply = await web.ask()

    assert reply["status"] == "failed", reply
    assert reply["error"].startswith(f"{code}: ")
    assert says in reply["error"]
    failed = await web.event(reply["task_id"], "failed")
    assert isinstance(failed, TaskFailed)
    assert (failed.worker, failed.code, failed.retryable) == ("web-1", code, False)
    assert web.ollama.stats()["generate_calls"] == 0  # nothing to summarise
    await web.all_acknowledged()


async def test_searxng_refusing_connections_fails_the_task_and_the_banner_says_so(
    web: Stack,
) -> None:
    nowhere = f"http://127.0.0.1:{free_port()}"
    with capture_logs() as logs:
        await web.start(searxng_url=nowhere)
        reply = await web.ask()

    assert reply["status"] == "failed"
    assert reply["error"].startswith(f"search_unavailable: SearXNG at {nowhere} cannot be reached")
    warning = next(e for e in logs if e["event"].startswith("SearXNG NOT OK"))
    assert warning["log_level"] == "warning" and warning["url"] == nowhere


# -- start -------------------------------------------------------------------------------------


async def test_the_start_banner_logs_the_version_and_checks_each_dependency(web: Stack) -> None:
    with capture_logs() as logs:
        await web.start()

    by_event = {e["event"]: e for e in logs}
    assert by_event["coordinator web-search starting"]["version"] == __version__
    assert by_event["NATS OK"]["url"] == web.nats.url
    assert by_event["SearXNG OK"]["url"] == web.searxng.url
    backend = by_event["backend OK"]
    assert (backend["backend"], backend["url"], backend["model"]) == (
        "ollama", web.ollama.url, MODEL,
    )  # fmt: skip
    assert web.searxng.stats()["search_calls"] == 0  # the check costs no upstream search
    workers, _ = await request(web.nc, "coordinator.workers", {})
    [entry] = workers["workers"]
    assert (entry["worker_id"], entry["tier"], entry["models"]) == ("web-1", "web", [MODEL])


async def test_a_second_web_worker_with_the_same_id_is_refused(web: Stack) -> None:
    await web.start()

    second = web.settings("web-1", worker_host="other-box")
    with pytest.raises(DuplicateWorker, match="'web-1' is already running: host host-web-1"):
        await run_web_search(second, asyncio.Event())


# -- several web workers -----------------------------------------------------------------------


async def test_web_workers_share_the_queue_one_task_each_at_a_time_never_the_same_twice(
    web: Stack,
) -> None:
    web.runner.router(web.nats.url)
    web.web_worker("web-1")
    web.web_worker("web-2")
    await workers_live(web.nc, 2)
    web.searxng.delay_s = 0.3
    started_sub = await web.nc.subscribe("events.task.*.*.started")
    ended_sub = await web.nc.subscribe("events.task.*.*.completed")

    task_ids = []
    for i in range(6):
        body = {"prompt": f"question {i}", "model": "default", "task_type": "web_search"}
        reply, _ = await request(web.nc, "coordinator.route", body)
        assert (reply["status"], reply["queue"]) == ("queued", "tasks.web")
        task_ids.append(reply["task_id"])
    ended = [
        task_event_decoder.decode((await ended_sub.next_msg(timeout=20)).data) for _ in task_ids
    ]
    starts = []
    while True:
        try:
            start = task_event_decoder.decode((await started_sub.next_msg(timeout=0.5)).data)
        except TimeoutError:
            break
        assert isinstance(start, TaskStarted)
        starts.append(start)

    assert sorted(e.task_id for e in ended) == sorted(task_ids)
    assert sorted(s.task_id for s in starts) == sorted(task_ids)  # each started exactly once
    assert web.searxng.stats()["search_calls"] == 6
    assert web.ollama.stats()["generate_calls"] == 6
    assert {s.worker for s in starts} == {"web-1", "web-2"}
    assert web.searxng.stats()["concurrent_max"] == 2
    # Each worker ran its tasks one after the other.
    end_of = {e.task_id: e.at for e in ended}
    for worker in ("web-1", "web-2"):
        spans = sorted((s.at, end_of[s.task_id]) for s in starts if s.worker == worker)
        for (_, end), (begin, _) in itertools.pairwise(spans):
            assert begin >= end
    await web.all_acknowledged()


# -- stopping and dying ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("delays", "grace_s", "status", "says"),
    [
        pytest.param((0.5, 0.0), 5.0, "done", None, id="within grace"),
        pytest.param((0.0, 10.0), 0.5, "done", "summary", id="grace over during the summary"),
        pytest.param((10.0, 0.0), 0.5, "failed", "search", id="grace over during the search"),
    ],
)
async def test_a_stopping_web_worker_finishes_or_wraps_up_its_task(
    delays: tuple[float, float], grace_s: float, status: str, says: str | None, web: Stack
) -> None:
    worker = await web.start(stop_grace_s=grace_s, search_timeout_s=20.0, summary_timeout_s=20.0)
    web.searxng.delay_s, web.ollama.delay_s = delays
    started = await web.nc.subscribe("events.task.*.*.started")
    answer = asyncio.create_task(web.ask())
    await started.next_msg(timeout=10)

    await web.runner.stop(worker)

    reply = await answer
    assert reply["status"] == status
    text = reply.get("note") or reply.get("error") or ""
    if says is None:
        assert not text
    else:
        assert "worker_stopped: web worker 'web-1' on host host-web-1 was stopped" in text
        assert f"ran out during the {says}" in text
    assert worker.done()
    await web.all_acknowledged()


async def test_a_dead_web_workers_task_fails_naming_it_and_is_not_run_again(
    web: Stack, processes: Processes
) -> None:
    web.runner.router(web.nats.url)
    env = clean_env(
        NATS_URL=web.nats.url,
        SEARXNG_URL=web.searxng.url,
        OLLAMA_HOST=web.ollama.url,
        OLLAMA_MODEL=MODEL,
        WORKER_ID="web-a",
        WORKER_HOST="box-a",
        HEARTBEAT_INTERVAL_S="0.5",
        WORKER_TTL_S="2",
        ACK_WAIT_S="1.5",
    )
    doomed = processes.start([COORDINATOR, "web-search"], env)
    await workers_live(web.nc, 1)
    web.ollama.delay_s = 30.0  # web-a is summarising when it dies
    started = await web.nc.subscribe("events.task.*.*.started")
    body = {"prompt": QUESTION, "model": "default", "task_type": "web_search"}
    reply, _ = await request(web.nc, "coordinator.route", body)
    start = task_event_decoder.decode((await started.next_msg(timeout=10)).data)
    assert isinstance(start, TaskStarted) and start.worker == "web-a"

    async def summarising() -> bool:
        return bool(web.ollama.stats()["in_flight"])

    await eventually(summarising, timeout_s=5)
    os.kill(doomed.pid, signal.SIGKILL)
    web.web_worker("web-b", worker_ttl_s=2.0, ack_wait_s=1.5)

    async def failed() -> TaskFailed | None:
        try:
            event = await web.event(reply["task_id"], "failed")
        except NotFoundError:
            return None
        return event if isinstance(event, TaskFailed) else None

    outcome: TaskFailed = await eventually(failed, timeout_s=15)
    assert (outcome.code, outcome.worker, outcome.retryable) == ("worker_lost", "web-a", False)
    assert "web worker 'web-a' on host box-a started this task" in outcome.reason
    assert web.searxng.stats()["search_calls"] == 1  # not run a second time
    assert web.ollama.stats()["generate_calls"] == 1

    async def acknowledged() -> bool:
        return await web.tasks_queued() == 0

    await eventually(acknowledged, timeout_s=5)


# -- cancelled and stale: the shared task loop's claim and cancel notices ----------------------


async def test_a_running_web_search_that_is_cancelled_stops_and_fails_cancelled(
    web: Stack,
) -> None:
    await web.start()
    web.ollama.delay_s = 30.0  # the summary is running when the cancel comes
    body = {"prompt": QUESTION, "model": "default", "task_type": "web_search"}
    routed, _ = await request(web.nc, "coordinator.route", body)

    async def summarising() -> bool:
        return bool(web.ollama.stats()["in_flight"])

    await eventually(summarising, timeout_s=5)
    cancel, headers = await request(
        web.nc, "coordinator.cancel", {"task_id": routed["task_id"], "reason": "asked elsewhere"}
    )
    assert "Nats-Service-Error-Code" not in headers, cancel

    async def failed() -> TaskFailed | None:
        try:
            event = await web.event(routed["task_id"], "failed")
        except NotFoundError:
            return None
        return event if isinstance(event, TaskFailed) else None

    outcome: TaskFailed = await eventually(failed, timeout_s=10)
    assert (outcome.code, outcome.reason, outcome.retryable) == (
        "cancelled",
        "asked elsewhere",
        False,
    )

    async def hung_up() -> bool:
        return web.ollama.stats()["cancelled"] == 1 and await web.tasks_queued() == 0

    await eventually(hung_up, timeout_s=5)  # the summary call was stopped, the message acked


async def test_a_web_worker_drops_a_copy_of_an_attempt_that_was_moved_on(web: Stack) -> None:
    """A web task's copy whose attempt is no longer the task's last ``routed`` leaves no
    event and never reaches SearXNG: the fenced claim of the shared task loop."""
    await web.start()
    js = web.nc.jetstream()
    now = time.time()
    routed_seq = {}
    for attempt in (1, 2):
        ack = await publish_event(
            js,
            TaskRouted(at=now, task_id="t-web", attempt=attempt, worker="web", queue="tasks.web"),
        )
        routed_seq[attempt] = ack.seq
    async with TaskEvents(web.nc) as events:
        for attempt in (1, 2):
            message = TaskMessage(
                task_id="t-web",
                attempt=attempt,
                model="default",
                timeout_s=10,
                submitted_at=now,
                routed_seq=routed_seq[attempt],
                work=Work(prompt=QUESTION, task_type="web_search"),
            )
            await js.publish("tasks.web", msgspec.json.encode(message))
        done = await events.first("completed")

    assert isinstance(done, TaskCompleted) and done.attempt == 2
    assert [(kind_of(e), getattr(e, "attempt", None)) for e in events.events] == [
        ("started", 2),
        ("completed", 2),
    ]
    assert web.searxng.stats()["search_calls"] == 1  # the stale copy never searched

    async def settled() -> bool:
        return await web.tasks_queued() == 0

    await eventually(settled, timeout_s=5)


async def _begun_by(web: Stack, task_id: str, starter: str, supports: list[Capability]) -> Msg:
    """A web task that ``starter`` (registered as live, busy with it, supporting
    ``supports``) took from the queue and stored its start of: returns its message, unsettled."""
    js = web.nc.jetstream()
    registry = await ensure_streams(js, worker_ttl_s=FAST["worker_ttl_s"])
    await ensure_consumer(js, WEB_POOL, FAST["ack_wait_s"])
    now = time.time()
    routed = await publish_event(
        js, TaskRouted(at=now, task_id=task_id, attempt=1, worker=WEB.name, queue=WEB.queue)
    )
    message = TaskMessage(
        task_id=task_id,
        attempt=1,
        model="default",
        timeout_s=30,
        submitted_at=now,
        routed_seq=routed.seq,
        work=Work(prompt=QUESTION, task_type="web_search"),
    )
    await js.publish(WEB.queue, msgspec.json.encode(message))
    pulled = await js.pull_subscribe_bind(durable=WEB.consumer, stream=TASKS_STREAM)
    [taken] = await pulled.fetch(1, timeout=5)
    started = TaskStarted(at=now, task_id=task_id, attempt=1, worker=starter, host="box-2")
    await publish_event(js, started, by=starter)
    record = WorkerRecord(
        worker_id=starter,
        host="box-2",
        instance_id="i-2",
        pid=1,
        version=__version__,
        supports=supports,
        models=[],
        started_at=now,
        heartbeat_at=now,
        state="busy",
        current_task=task_id,
    )
    await registry.put(starter, msgspec.json.encode(record))
    return taken


async def test_a_web_task_whose_start_a_lagging_read_missed_is_not_run_again(
    web: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """web-2 took a web task, stored its start and is alive with it; the task's message is
    redelivered to web-1, whose read of the log comes from a copy that has not heard of that
    start (any copy of the log answers such a read). web-1's claim is stored only while
    nothing of the task is newer than what it judged, so it is refused: the message goes
    back, is judged again on a read that has caught up, waits for web-2, and when web-2 goes
    silent fails naming it. SearXNG is never asked."""
    taken = await _begun_by(web, "t-lag", "web-2", ["web_search"])
    read = outcomes.last_started
    reads: list[bool] = []

    async def lagging_once(js: JetStreamContext, task_id: str, attempt: int) -> Sourced | None:
        reads.append(True)
        return None if len(reads) == 1 else await read(js, task_id, attempt)

    monkeypatch.setattr(redelivery, "last_started", lagging_once)
    async with TaskEvents(web.nc) as events:
        await taken.nak()  # web-2's copy, back in the queue: redelivered to web-1
        web.web_worker("web-1")
        outcome = await events.first("failed", "t-lag")

    assert isinstance(outcome, TaskFailed)
    assert (outcome.code, outcome.worker) == ("worker_lost", "web-2"), outcome
    assert len(reads) >= 2  # judged again after the refused claim
    assert [e.worker for e in events.of("t-lag") if isinstance(e, TaskStarted)] == []
    assert web.searxng.stats()["search_calls"] == 0
    await web.all_acknowledged()


async def test_a_start_forged_by_a_worker_outside_the_pool_does_not_hold_a_web_task_back(
    web: Stack,
) -> None:
    """A CPU worker stored a start of a web task on its own subject (it may publish there, but
    may not record a web task). The redelivered task's judge ignores that start, and the
    claim is fenced after what was judged, so the forged start does not refuse it: web-1 runs
    the task once."""
    taken = await _begun_by(web, "t-forged", "cpu-x", ["cpu_inference"])
    async with TaskEvents(web.nc) as events:
        await taken.nak()
        web.web_worker("web-1")
        outcome = await events.first("completed", "t-forged")

    assert isinstance(outcome, TaskCompleted) and outcome.worker == "web-1"
    assert [e.worker for e in events.of("t-forged") if isinstance(e, TaskStarted)] == ["web-1"]
    assert web.searxng.stats()["search_calls"] == 1
    await web.all_acknowledged()


# -- the command line --------------------------------------------------------------------------


async def test_coordinator_ask_type_web_search_prints_the_answer_and_its_sources(
    web: Stack,
) -> None:
    await web.start()
    env = clean_env(NATS_URL=web.nats.url)

    async def ask(*args: str) -> subprocess.CompletedProcess[str]:
        return await asyncio.to_thread(
            run_cli, "ask", QUESTION, "--type", "web_search", *args, env=env
        )

    answered = await ask()
    assert answered.returncode == 0, answered.stderr
    answer, sources = answered.stdout.split("\nSources:\n")
    assert answer.startswith(f"Echo from {MODEL}: ")
    assert sources.splitlines()[:2] == [
        f"[1] {QUESTION} - result 1",
        "    https://example.org/what-is-nats-jetstream/1",
    ]
    assert sources.count("https://example.org/") == 3
    assert answered.stderr.startswith("task ") and "done on web-1" in answered.stderr

    as_json = await ask("--json")
    body = msgspec.json.decode(as_json.stdout)
    assert body["status"] == "done" and len(body["sources"]) == 3 and body["host"] == "host-web-1"

    web.ollama.fail_status = 500
    fallback = await ask()
    assert fallback.returncode == 0
    assert fallback.stdout.startswith(f"1. {QUESTION} - result 1\n")
    assert "Sources:" not in fallback.stdout  # the answer already is the list
    assert "note: the summary failed (backend_server_error" in fallback.stderr

    web.searxng.fail_status = 503
    failed = await ask()
    assert failed.returncode == 1
    assert "error task_failed:" in failed.stderr and "search_unavailable" in failed.stderr

    no_model = await asyncio.to_thread(run_cli, "ask", "1+1", env=env)
    assert no_model.returncode == 2
    assert "--model is required unless --type web_search" in no_model.stderr
