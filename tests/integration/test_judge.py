"""The judge against the Ollama stand-in, a real nats-server and a real PostgreSQL."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import msgspec
import nats.errors
import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext

from devtools.fakes.ollama import FakeOllama
from devtools.servers import NatsServer, free_port
from schemas.events import QualityScored, TaskEvent, TaskSubmitted, any_event_decoder
from schemas.subjects import EVENTS_STREAM
from services.errors import JudgeUnavailable
from services.stats.judge import Judge, JudgeReport, JudgeSettings
from services.stats.store import Store
from tests.harness import request
from tests.integration.test_stats import (
    all_acked,
    bus,
    eventually,
    publish_all,
    running_stats,
    settings_for,
    store_at,
)
from tests.integration.test_stats_replay import task

T0 = 1_700_000_000.0
JUDGE_MODEL = "gemma3:1b"

# The stand-in answers a judge prompt by the task's answer it contains.
VERDICTS = {
    "answer-good": "SCORE: 0.9\nCorrect and clear.",
    "answer-fair": "Score: 6/10 - partly right.",
    "answer-odd": "I would rate it as decent overall.",
}


def done_task(task_id: str, answer: str, *, worker: str = "mac", at: float = T0) -> list[TaskEvent]:
    events = task(task_id, worker=worker, at=at, total_ms=1000)
    end = events[-1]
    return [*events[:-1], msgspec.structs.replace(end, response=answer)]


def judge_settings(
    nats_server: NatsServer, pg_dsn: str, host: str, **overrides: Any
) -> JudgeSettings:
    return JudgeSettings(
        nats_url=nats_server.url,
        pg_dsn=pg_dsn,
        judge_ollama_host=host,
        judge_model=JUDGE_MODEL,
        judge_connect_timeout_s=1.0,
        **overrides,
    )


def dead_host() -> str:
    """An address where nothing listens: a judge host that is asleep."""
    return f"http://127.0.0.1:{free_port()}"


@pytest.fixture
def judge_host() -> Any:
    with FakeOllama(replies=VERDICTS) as fake:
        yield fake


@asynccontextmanager
async def projected(
    nats_server: NatsServer, pg_dsn: str, tasks: list[list[TaskEvent]]
) -> AsyncIterator[tuple[Client, JetStreamContext, Store]]:
    """The stats service running with ``tasks`` projected."""
    async with (
        bus(nats_server.url) as (nc, js),
        store_at(pg_dsn) as store,
        running_stats(nc, settings_for(nats_server, pg_dsn)),
    ):
        last = await publish_all(js, [event for events in tasks for event in events])
        await eventually(lambda: all_acked(js, last), what="the tasks to be projected")
        yield nc, js, store


async def verdicts(js: JetStreamContext) -> list[QualityScored]:
    """Every verdict in the stream, in order."""
    sub = await js.subscribe("events.quality.>", stream=EVENTS_STREAM, ordered_consumer=True)
    found: list[QualityScored] = []
    try:
        while True:
            try:
                msg = await sub.next_msg(timeout=0.5)
            except nats.errors.TimeoutError:
                return found  # none at all
            event = any_event_decoder.decode(msg.data)
            assert isinstance(event, QualityScored)
            found.append(event)
            if msg.metadata.num_pending == 0:
                return found
    finally:
        await sub.unsubscribe()


async def run_judge(
    js: JetStreamContext, store: Store, settings: JudgeSettings
) -> tuple[JudgeReport, list[str]]:
    lines: list[str] = []
    report = await Judge(js, store, settings, say=lines.append).run()
    return report, lines


async def test_the_judge_scores_done_tasks_and_the_figures_show_their_quality(
    nats_server: NatsServer, pg_dsn: str, judge_host: FakeOllama
) -> None:
    failed = task("t-failed", worker="mac", at=T0, total_ms=100, ok=False)
    running = task("t-running", worker="mac", at=T0, total_ms=100)[:3]
    tasks = [
        done_task("t-good", "answer-good"),
        done_task("t-fair", "answer-fair", at=T0 + 1),
        done_task("t-odd", "answer-odd", at=T0 + 2),
        failed,
        running,
    ]
    async with projected(nats_server, pg_dsn, tasks) as (nc, js, store):
        settings = judge_settings(nats_server, pg_dsn, judge_host.url)
        report, lines = await run_judge(js, store, settings)

        async def quality_shown() -> dict[str, Any] | None:
            body, _ = await request(nc, "coordinator.stats", {"worker": "mac"})
            [figure] = body["figures"]
            return figure if figure.get("quality_count") == 2 else None

        figure = await eventually(quality_shown, what="the verdicts in the figures")
        stored = await verdicts(js)

    assert (report.scored, report.malformed, report.errors, report.host) == (
        2,
        1,
        [],
        judge_host.url,
    )
    by_task = {v.task_id: v for v in stored}
    assert set(by_task) == {"t-good", "t-fair", "t-odd"}
    assert (by_task["t-good"].verdict, by_task["t-good"].score) == ("scored", 0.9)
    assert by_task["t-fair"].score == 0.6
    odd = by_task["t-odd"]
    assert (odd.verdict, odd.score, odd.text) == ("malformed", None, VERDICTS["answer-odd"])
    assert odd.reason == "no score found in the judge's reply"
    assert {v.rubric for v in stored} == {"code"}
    assert {(v.judge_model, v.judge_host, v.attempt) for v in stored} == {
        (JUDGE_MODEL, judge_host.url, 1)
    }
    assert figure["quality_mean"] == pytest.approx(0.75)
    assert lines[0] == "scored 0.90 t-good qwen2.5:7b (mac) [code]"
    assert lines[2].startswith("malformed t-odd")


async def test_no_task_is_judged_twice_even_by_overlapping_runs(
    nats_server: NatsServer, pg_dsn: str, judge_host: FakeOllama
) -> None:
    tasks = [done_task(f"t-{i}", "answer-good", at=T0 + i) for i in range(3)]
    # Slow enough for both runs to be judging the same task at once.
    judge_host.configure(delay_s=0.3)
    async with projected(nats_server, pg_dsn, tasks) as (_, js, store):
        settings = judge_settings(nats_server, pg_dsn, judge_host.url)
        (first, first_lines), (second, second_lines) = await asyncio.gather(
            run_judge(js, store, settings), run_judge(js, store, settings)
        )
        judge_host.configure(delay_s=0)
        repeated, _ = await run_judge(js, store, settings)
        stored = await verdicts(js)

    assert sorted(v.task_id for v in stored) == ["t-0", "t-1", "t-2"]
    assert first.judged + second.judged == 3
    assert first.already_scored + second.already_scored >= 3
    # Both judged t-0 at once; the stream refused the second verdict.
    assert "already scored t-0 (by another run)" in first_lines + second_lines
    assert repeated.judged == 0


async def test_a_judge_host_that_does_not_answer_is_replaced_by_the_fallback(
    nats_server: NatsServer, pg_dsn: str, judge_host: FakeOllama
) -> None:
    async with projected(nats_server, pg_dsn, [done_task("t-1", "answer-good")]) as (_, js, store):
        settings = judge_settings(
            nats_server, pg_dsn, dead_host(), judge_fallback_host=judge_host.url
        )
        report, _ = await run_judge(js, store, settings)
        [verdict] = await verdicts(js)

    assert (report.scored, report.host) == (1, judge_host.url)
    assert verdict.judge_host == judge_host.url


async def test_a_host_without_the_judge_model_is_passed_over_too(
    nats_server: NatsServer, pg_dsn: str, judge_host: FakeOllama
) -> None:
    with FakeOllama(models=["qwen2.5:0.5b"]) as other:
        async with projected(nats_server, pg_dsn, [done_task("t-1", "answer-good")]) as (
            _,
            js,
            store,
        ):
            settings = judge_settings(
                nats_server, pg_dsn, other.url, judge_fallback_host=judge_host.url
            )
            report, _ = await run_judge(js, store, settings)

    assert (report.scored, report.host) == (1, judge_host.url)
    assert other.stats()["generate_calls"] == 0


async def test_when_neither_host_answers_nothing_is_judged(
    nats_server: NatsServer, pg_dsn: str
) -> None:
    async with projected(nats_server, pg_dsn, [done_task("t-1", "answer-good")]) as (_, js, store):
        settings = judge_settings(nats_server, pg_dsn, dead_host(), judge_fallback_host=dead_host())
        with pytest.raises(JudgeUnavailable) as raised:
            await run_judge(js, store, settings)
        stored = await verdicts(js)

    assert raised.value.code == "judge_unavailable"
    assert "no judge host answers" in raised.value.message
    assert stored == []


async def test_a_primary_timing_out_mid_run_hands_the_rest_to_the_fallback(
    nats_server: NatsServer, pg_dsn: str, judge_host: FakeOllama
) -> None:
    tasks = [done_task(f"t-{i}", "answer-good", at=T0 + i) for i in range(2)]
    with FakeOllama(replies=VERDICTS, delay_s=3.0) as sleepy:
        async with projected(nats_server, pg_dsn, tasks) as (_, js, store):
            settings = judge_settings(
                nats_server,
                pg_dsn,
                sleepy.url,
                judge_fallback_host=judge_host.url,
                judge_timeout_s=0.5,
            )
            report, lines = await run_judge(js, store, settings)
            stored = await verdicts(js)

    assert (report.scored, report.host, report.ok) == (2, judge_host.url, True)
    assert {v.judge_host for v in stored} == {judge_host.url}
    assert lines[0].startswith(f"judge host {sleepy.url} stopped answering")


async def test_without_a_fallback_a_primary_that_stops_answering_ends_the_run(
    nats_server: NatsServer, pg_dsn: str
) -> None:
    with FakeOllama(replies=VERDICTS, delay_s=3.0) as sleepy:
        async with projected(nats_server, pg_dsn, [done_task("t-1", "answer-good")]) as (
            _,
            js,
            store,
        ):
            settings = judge_settings(nats_server, pg_dsn, sleepy.url, judge_timeout_s=0.5)
            report, _ = await run_judge(js, store, settings)

    assert (report.judged, report.ok) == (0, False)
    assert report.stopped is not None and "JUDGE_FALLBACK_HOST" in report.stopped


async def test_the_batch_limit_caps_each_run(
    nats_server: NatsServer, pg_dsn: str, judge_host: FakeOllama
) -> None:
    tasks = [done_task(f"t-{i}", "answer-good", at=T0 + i) for i in range(5)]
    async with projected(nats_server, pg_dsn, tasks) as (_, js, store):
        settings = judge_settings(nats_server, pg_dsn, judge_host.url, batch_limit=2)
        runs = [(await run_judge(js, store, settings))[0].judged for _ in range(3)]
        stored = await verdicts(js)

    assert runs == [2, 2, 1]
    assert [v.task_id for v in stored] == ["t-0", "t-1", "t-2", "t-3", "t-4"]  # oldest first


async def test_a_judge_error_leaves_the_task_for_the_next_run(
    nats_server: NatsServer, pg_dsn: str, judge_host: FakeOllama
) -> None:
    judge_host.configure(fail_status=500)
    async with projected(nats_server, pg_dsn, [done_task("t-1", "answer-good")]) as (_, js, store):
        settings = judge_settings(nats_server, pg_dsn, judge_host.url)
        failed, _ = await run_judge(js, store, settings)
        judge_host.configure(fail_status=None)
        retried, _ = await run_judge(js, store, settings)

    assert (failed.judged, failed.ok) == (0, False)
    assert "HTTP 500" in failed.errors[0]
    assert (retried.scored, retried.ok) == (1, True)


async def test_embedding_tasks_are_never_judged(
    nats_server: NatsServer, pg_dsn: str, judge_host: FakeOllama
) -> None:
    vectors = done_task("t-vectors", "")
    assert isinstance(vectors[0], TaskSubmitted)
    work = msgspec.structs.replace(vectors[0].work, task_type="embedding", input=["a"])
    asked = msgspec.structs.replace(vectors[0], work=work)
    tasks = [[asked, *vectors[1:]], done_task("t-text", "answer-good", at=T0 + 1)]
    async with projected(nats_server, pg_dsn, tasks) as (_, js, store):
        report, _ = await run_judge(js, store, judge_settings(nats_server, pg_dsn, judge_host.url))
        stored = await verdicts(js)

    assert report.judged == 1
    assert [v.task_id for v in stored] == ["t-text"]
