"""Exclusions, aliases and the rebuild, against a real nats-server and a real PostgreSQL.

The story these tests retell (lesson 2 and 3): a worker was started twice, every task on it
took twice as long for a while, the figures were polluted. The window is excluded, the
projections are rebuilt from the event log, and the figures are the clean ones again, while
the raw events stay in the stream.
"""

from __future__ import annotations

import asyncio
import math
import statistics
from typing import Any

import asyncpg
import msgspec
import nats.js.errors
import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext

from devtools.servers import NatsServer, free_port
from schemas.events import (
    Durations,
    QualityScored,
    TaskCompleted,
    TaskEvent,
    TaskFailed,
    TaskRouted,
    TaskStarted,
    TaskSubmitted,
    Tokens,
)
from schemas.stats import RoutingFigure, StatsReply
from schemas.subjects import EVENTS_STREAM, STATS_BUCKET
from schemas.work import Work
from services.runtime.bus import publish_event
from services.stats.figures import kv_key
from services.stats.rebuild import REBUILD_LOCK
from services.stats.rows import PROJECTION_TABLES
from tests.harness import request
from tests.integration.test_stats import (
    all_acked,
    bus,
    eventually,
    publish_all,
    rows,
    running_stats,
    settings_for,
)

T0 = 1_700_000_000.0
HOUR = 3600.0
MODEL = "qwen2.5:7b"


def task(
    task_id: str,
    *,
    worker: str,
    at: float,
    total_ms: float,
    model: str = MODEL,
    domain: str | None = "code",
    ok: bool = True,
) -> list[TaskEvent]:
    """One task's events from submission to its end, ending ``total_ms`` after ``at``."""
    ended = at + total_ms / 1000
    end: TaskEvent = (
        TaskCompleted(
            at=ended,
            task_id=task_id,
            attempt=1,
            worker=worker,
            model=model,
            response="ok",
            durations=Durations(total_ms=total_ms, load_ms=100.0, eval_ms=total_ms - 200.0),
            tokens=Tokens(prompt=10, eval=50),
        )
        if ok
        else TaskFailed(
            at=ended, task_id=task_id, attempt=1, worker=worker, code="backend_error", reason="x"
        )
    )
    return [
        TaskSubmitted(
            at=at,
            task_id=task_id,
            model=model,
            timeout_s=60,
            work=Work(prompt="write a sort", domain=domain),
        ),
        TaskRouted(at=at, task_id=task_id, attempt=1, worker=worker, queue=f"tasks.cpu.{worker}"),
        TaskStarted(at=at, task_id=task_id, attempt=1, worker=worker, host=f"{worker}.lan"),
        end,
    ]


def percentile_cont(values: list[float], fraction: float) -> float:
    """PostgreSQL's percentile_cont: linear interpolation between the closest ranks."""
    ordered = sorted(values)
    position = fraction * (len(ordered) - 1)
    low, high = math.floor(position), math.ceil(position)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


async def figures(nc: Client, **query: Any) -> dict[tuple[str, str, str], dict[str, Any]]:
    body, headers = await request(nc, "coordinator.stats", query)
    assert "Nats-Service-Error-Code" not in headers, body
    reply = msgspec.convert(body, StatsReply)
    return {(f.model, f.domain, f.worker): msgspec.to_builtins(f) for f in reply.figures}


async def rebuild(nc: Client) -> dict[str, Any]:
    body, headers = await request(nc, "coordinator.stats.rebuild", {}, timeout_s=60)
    assert "Nats-Service-Error-Code" not in headers, body
    return body


async def read_model(dsn: str) -> dict[str, list[dict[str, Any]]]:
    """Every projection table's rows, in a stable order."""
    return {table: await rows(dsn, table) for table in PROJECTION_TABLES}


async def publish_tasks(js: JetStreamContext, tasks: list[list[TaskEvent]]) -> int:
    return await publish_all(js, [event for events in tasks for event in events])


CLEAN_MS = [1000.0 + 10 * i for i in range(10)]
POLLUTED_MS = [2 * ms for ms in CLEAN_MS]


async def test_a_duplicate_worker_window_is_excluded_rebuilt_and_the_figures_are_clean_again(
    nats_server: NatsServer, pg_dsn: str
) -> None:
    clean = [
        task(f"clean-{i}", worker="mac", at=T0 + i * 60, total_ms=ms)
        for i, ms in enumerate(CLEAN_MS)
    ]
    # Two instances of `mac` from T0 + 1 h: every task takes twice as long.
    polluted = [
        task(f"dup-{i}", worker="mac", at=T0 + HOUR + i * 60, total_ms=ms)
        for i, ms in enumerate(POLLUTED_MS)
    ]
    bystander = [
        task(f"pc-{i}", worker="pc", at=T0 + HOUR + i * 60, total_ms=500.0) for i in range(3)
    ]
    key = (MODEL, "code", "mac")
    async with bus(nats_server.url) as (nc, js):
        last = await publish_tasks(js, clean + polluted + bystander)
        async with running_stats(nc, settings_for(nats_server, pg_dsn)):
            await eventually(lambda: all_acked(js, last), what="the log to be projected")
            before = await figures(nc)

            body, headers = await request(
                nc,
                "coordinator.stats.exclude",
                {
                    "worker": "mac",
                    "since": T0 + HOUR - 1,
                    "until": T0 + 2 * HOUR,
                    "reason": "two instances of mac (duplicate worker)",
                },
            )
            assert "Nats-Service-Error-Code" not in headers, body
            rebuilt = await rebuild(nc)
            after = await figures(nc)
            kv = await js.key_value(STATS_BUCKET)

            async def published() -> RoutingFigure | None:
                try:
                    entry = await kv.get(kv_key(*key))
                except nats.js.errors.KeyNotFoundError:
                    return None  # not put yet: the figures go to KV at most once a second
                figure = msgspec.json.decode(entry.value or b"", type=RoutingFigure)
                return figure if figure.count == len(CLEAN_MS) else None

            routing = await eventually(published, what="the clean figure in KV")
        stream = await js.stream_info(EVENTS_STREAM)

    assert before[key]["count"] == 20
    assert before[key]["p50_ms"] == statistics.median(CLEAN_MS + POLLUTED_MS)

    assert body["worker"] == "mac"
    assert body["exclusion_id"]
    assert rebuilt["events"] == last + 1  # every task event, and the exclusion
    assert rebuilt["last_seq"] == last + 1

    assert after[key]["count"] == len(CLEAN_MS)
    assert after[key]["failures"] == 0
    assert after[key]["p50_ms"] == statistics.median(CLEAN_MS)
    assert after[key]["mean_ms"] == statistics.mean(CLEAN_MS)
    assert after[key]["p95_ms"] == percentile_cont(CLEAN_MS, 0.95)
    assert after[key]["load_ms_p50"] == 100.0
    assert after[key]["warm_p50_ms"] == statistics.median(CLEAN_MS) - 100.0
    assert after[(MODEL, "code", "pc")] == before[(MODEL, "code", "pc")]
    assert (routing.typical_ms, routing.recent_failure_rate) == (statistics.median(CLEAN_MS), 0.0)

    # Nothing was deleted: every raw event is still in the log, every task in the tasks table.
    assert stream.state.messages == last + 1
    assert len(await rows(pg_dsn, "tasks")) == 23
    assert len(await rows(pg_dsn, "outcomes")) == 23


async def test_a_rebuild_gives_the_tables_the_live_projection_built(
    nats_server: NatsServer, pg_dsn: str
) -> None:
    tasks = [
        task(f"t-{i}", worker=("mac", "pc")[i % 2], at=T0 + i, total_ms=900 + i, ok=i % 5 != 0)
        for i in range(30)
    ]
    async with bus(nats_server.url) as (nc, js):
        await js.publish("events.task.x.completed", b"{not an event")  # skipped by both
        await publish_tasks(js, tasks[:20])
        await publish_event(
            js,
            QualityScored(**quality("t-1", 0.75)),  # judged before the alias and exclusion
        )
        async with running_stats(nc, settings_for(nats_server, pg_dsn)):
            for body in (
                {"alias": MODEL, "canonical": "qwen-7b"},
                {"alias": "qwen-7b", "canonical": "qwen:7b"},
            ):
                await request(nc, "coordinator.stats.alias.add", body)
            await request(
                nc,
                "coordinator.stats.exclude",
                {"worker": "pc", "since": T0 + 5, "until": T0 + 9, "reason": "test"},
            )
            last = await publish_tasks(js, tasks[20:])
            await eventually(lambda: all_acked(js, last), what="the log to be projected")
            await figures(nc)  # a stats query brings the figures up to what is projected
            live = await read_model(pg_dsn)
            await rebuild(nc)
            rebuilt = await read_model(pg_dsn)

    assert rebuilt == live
    keys = {(f["model"], f["worker"]) for f in live["figures"]}
    assert keys == {("qwen:7b", "mac"), ("qwen:7b", "pc")}  # chain followed, history re-keyed
    [judged] = [f for f in live["figures"] if f["quality_count"]]
    assert (judged["worker"], judged["quality_mean"]) == ("pc", 0.75)


def quality(task_id: str, score: float | None) -> dict[str, Any]:
    return {
        "at": T0 + 100,
        "task_id": task_id,
        "attempt": 1,
        "verdict": "scored" if score is not None else "malformed",
        "score": score,
        "rubric": "code",
        "judge_model": "judge:1b",
        "judge_host": "http://judge:11434",
    }


async def test_events_arriving_during_a_rebuild_are_applied_exactly_once(
    nats_server: NatsServer, pg_dsn: str
) -> None:
    async with bus(nats_server.url) as (nc, js):
        await publish_tasks(
            js, [task(f"early-{i}", worker="mac", at=T0 + i, total_ms=1000) for i in range(300)]
        )
        async with running_stats(nc, settings_for(nats_server, pg_dsn)):
            answered: list[int] = []

            async def keep_publishing_and_asking() -> int:
                last = 0
                for i in range(40):
                    last = await publish_tasks(
                        js, [task(f"late-{i}", worker="pc", at=T0 + 500 + i, total_ms=700)]
                    )
                    # Queries keep answering while the rebuild runs.
                    answered.append(len(await figures(nc)))
                    await asyncio.sleep(0.01)
                return last

            rebuilt, last = await asyncio.gather(rebuild(nc), keep_publishing_and_asking())
            await eventually(lambda: all_acked(js, last), what="the late events to be projected")
            await figures(nc)  # a stats query brings the figures up to what is projected
            live = await read_model(pg_dsn)
            await rebuild(nc)
            again = await read_model(pg_dsn)

    tracked = [r["stream_seq"] for r in live["projection_tracking"]]
    assert tracked == list(range(1, last + 1))  # every position once, none lost, none twice
    assert len(live["tasks"]) == 340
    assert {f["worker"]: f["count"] for f in live["figures"]} == {"mac": 300, "pc": 40}
    assert again == live
    assert rebuilt["last_seq"] <= last
    assert len(answered) == 40


async def test_withdrawing_an_exclusion_brings_the_outcomes_back(
    nats_server: NatsServer, pg_dsn: str
) -> None:
    async with bus(nats_server.url) as (nc, js):
        last = await publish_tasks(
            js, [task(f"t-{i}", worker="mac", at=T0 + i, total_ms=1000) for i in range(4)]
        )
        async with running_stats(nc, settings_for(nats_server, pg_dsn)):
            await eventually(lambda: all_acked(js, last), what="the log to be projected")
            excluded, _ = await request(
                nc,
                "coordinator.stats.exclude",
                {"worker": "mac", "model": MODEL, "since": T0 + 2.5, "reason": "noisy"},
            )
            during = await figures(nc)
            listed, _ = await request(nc, "coordinator.stats.exclusions", {})
            withdrawn, _ = await request(
                nc, "coordinator.stats.include", {"exclusion_id": excluded["exclusion_id"]}
            )
            after = await figures(nc)
            again, headers = await request(
                nc, "coordinator.stats.include", {"exclusion_id": excluded["exclusion_id"]}
            )
            _, unknown_headers = await request(
                nc, "coordinator.stats.include", {"exclusion_id": "x-nope"}
            )
            history, _ = await request(nc, "coordinator.stats.exclusions", {"withdrawn": True})
            active, _ = await request(nc, "coordinator.stats.exclusions", {})

    key = (MODEL, "code", "mac")
    assert during[key]["count"] == 2
    assert [e["exclusion_id"] for e in listed["exclusions"]] == [excluded["exclusion_id"]]
    assert withdrawn["withdrawn_at"] is not None
    assert after[key]["count"] == 4
    assert headers["Nats-Service-Error-Code"] == "conflict"
    assert "already withdrawn" in again["error"]["message"]
    assert unknown_headers["Nats-Service-Error-Code"] == "not_found"
    assert len(history["exclusions"]) == 1
    assert active["exclusions"] == []


# What the operator sent, and what the refusal must say (the field, and what it takes).
BAD_EXCLUSIONS: list[tuple[str, dict[str, Any] | bytes, str]] = [
    ("no reason", {"worker": "mac", "since": T0, "reason": "  "}, "give a reason"),
    (
        "until before since",
        {"worker": "mac", "since": T0, "until": T0 - 1, "reason": "r"},
        "until must be later than since",
    ),
    ("worker with a dot", {"worker": "m.c", "since": T0, "reason": "r"}, "worker"),
    ("no since", {"worker": "mac", "reason": "r"}, "since"),
    ("unknown field", {"worker": "mac", "since": T0, "reason": "r", "modle": "x"}, "modle"),
    ("empty model", {"worker": "mac", "model": "", "since": T0, "reason": "r"}, "model"),
    *(
        (
            f"since {label}",
            {"worker": "mac", "since": since, "reason": "r"},
            "since must be a time from 1970-01-01 to 9999-12-31 (epoch seconds 0 to "
            f"253402300799), not {text}",
        )
        for label, since, text in [
            ("1e308", 1e308, "1e+308"),
            ("2**63", 2**63, "9.22337203685478e+18 (that looks like nanoseconds"),
            ("-1e18", -1e18, "-1e+18"),
            ("before 1970", -1, "-1"),
        ]
    ),
    (
        "since in milliseconds",
        {"worker": "mac", "since": T0 * 1000, "reason": "r"},
        "not 1700000000000 (that looks like milliseconds: times are epoch seconds, divide by 1000)",
    ),
    (
        "until in milliseconds",
        {"worker": "mac", "since": T0, "until": (T0 + 60) * 1000, "reason": "r"},
        "until must be a time from 1970-01-01",
    ),
    (
        "until 1e308",
        {"worker": "mac", "since": T0, "until": 1e308, "reason": "r"},
        "until must be a time from 1970-01-01",
    ),
    # Beyond what a float holds: msgspec refuses it as it decodes, naming the field.
    (
        "since beyond a float",
        b'{"worker": "mac", "since": 1e400, "reason": "r"}',
        "Number out of range - at `$.since`",
    ),
]


async def test_operator_requests_are_checked_and_refused_with_a_code(
    nats_server: NatsServer, pg_dsn: str
) -> None:
    async with (
        bus(nats_server.url) as (nc, js),
        running_stats(nc, settings_for(nats_server, pg_dsn)),
    ):
        before = (await js.stream_info(EVENTS_STREAM)).state.messages
        refusals = []
        for label, body, says in BAD_EXCLUSIONS:
            reply, headers = await request(nc, "coordinator.stats.exclude", body)
            refusals.append((label, headers.get("Nats-Service-Error-Code"), reply, says))
        await request(nc, "coordinator.stats.alias.add", {"alias": "a", "canonical": "b"})
        cycle, cycle_headers = await request(
            nc, "coordinator.stats.alias.add", {"alias": "b", "canonical": "a"}
        )
        _, itself_headers = await request(
            nc, "coordinator.stats.alias.add", {"alias": "c", "canonical": "c"}
        )
        _, missing_headers = await request(nc, "coordinator.stats.alias.remove", {"alias": "zzz"})
        after = (await js.stream_info(EVENTS_STREAM)).state.messages

    for label, code, reply, says in refusals:
        assert (label, code) == (label, "bad_request"), reply
        assert says in reply["error"]["message"], label
    assert cycle_headers["Nats-Service-Error-Code"] == "bad_request"
    assert "cycle" in cycle["error"]["message"]
    assert itself_headers["Nats-Service-Error-Code"] == "bad_request"
    assert missing_headers["Nats-Service-Error-Code"] == "not_found"
    assert after == before + 1  # only the one good alias was recorded


async def test_a_second_rebuild_while_one_runs_is_refused_as_busy(
    nats_server: NatsServer, pg_dsn: str
) -> None:
    async with (
        bus(nats_server.url) as (nc, _),
        running_stats(nc, settings_for(nats_server, pg_dsn)),
    ):
        # Another stats instance's rebuild holds the lock.
        other = await asyncpg.connect(pg_dsn)
        try:
            await other.execute("SELECT pg_advisory_lock($1)", REBUILD_LOCK)
            body, headers = await request(nc, "coordinator.stats.rebuild", {})
        finally:
            await other.close()
        rebuilt, _ = await request(nc, "coordinator.stats.rebuild", {})

    assert headers["Nats-Service-Error-Code"] == "busy"
    assert "already running" in body["error"]["message"]
    assert rebuilt["events"] == 0


async def test_aliases_key_history_under_one_name_and_removing_one_splits_it_again(
    nats_server: NatsServer, pg_dsn: str
) -> None:
    long_name = "hf.co/elyza/Llama-3-ELYZA-JP-8B-GGUF:Q4_K_M"
    async with bus(nats_server.url) as (nc, js):
        last = await publish_tasks(
            js,
            [
                task("old-1", worker="mac", at=T0, total_ms=1000, model=long_name),
                task("old-2", worker="mac", at=T0 + 1, total_ms=1200, model=long_name),
                task("new-1", worker="mac", at=T0 + 2, total_ms=1100, model="elyza-jp-8b"),
            ],
        )
        async with running_stats(nc, settings_for(nats_server, pg_dsn)):
            await eventually(lambda: all_acked(js, last), what="the log to be projected")
            split = await figures(nc)
            added, _ = await request(
                nc, "coordinator.stats.alias.add", {"alias": long_name, "canonical": "elyza-jp-8b"}
            )
            joined = await figures(nc)
            listed, _ = await request(nc, "coordinator.stats.aliases", {})
            kv = await js.key_value(STATS_BUCKET)

            async def moved() -> bool | None:
                try:
                    keys = set(await kv.keys())
                except nats.js.errors.NoKeysError:
                    return None
                old, new = kv_key(long_name, "code", "mac"), kv_key("elyza-jp-8b", "code", "mac")
                return True if new in keys and old not in keys else None

            await eventually(moved, what="the old key to leave the KV bucket")
            await request(nc, "coordinator.stats.alias.remove", {"alias": long_name})
            again = await figures(nc)

    assert {k[0]: f["count"] for k, f in split.items()} == {long_name: 2, "elyza-jp-8b": 1}
    assert added == {"alias": long_name, "canonical": "elyza-jp-8b", "set_at": added["set_at"]}
    assert {k[0]: f["count"] for k, f in joined.items()} == {"elyza-jp-8b": 3}
    assert joined[("elyza-jp-8b", "code", "mac")]["p50_ms"] == 1100.0
    assert [a["alias"] for a in listed["aliases"]] == [long_name]
    assert again == split


async def test_a_rebuild_without_its_database_fails_with_a_code_and_changes_nothing(
    nats_server: NatsServer,
) -> None:
    from services.errors import Unavailable
    from services.stats.rebuild import rebuild as rebuild_tables

    async with bus(nats_server.url) as (_, js):
        with pytest.raises(Unavailable) as failed:
            await rebuild_tables(js, f"postgresql://postgres@127.0.0.1:{free_port()}/none")

    assert failed.value.code == "unavailable"
    assert "cannot reach PostgreSQL" in failed.value.message


async def test_a_rebuild_swaps_every_table_the_schema_creates(pg_dsn: str) -> None:
    from tests.integration.test_stats import store_at

    async with store_at(pg_dsn):
        conn = await asyncpg.connect(pg_dsn)
        try:
            tables = await conn.fetch(
                "SELECT tablename FROM pg_tables WHERE schemaname = current_schema()"
            )
        finally:
            await conn.close()

    # All but the record of the schema file applied, which stays with the live schema.
    assert {t["tablename"] for t in tables} == {*PROJECTION_TABLES, "schema_applied"}


async def test_figures_left_behind_their_facts_are_brought_in_line_at_start(
    nats_server: NatsServer, pg_dsn: str
) -> None:
    """Figures are recomputed apart from the batches; a stop in between must not leave them
    stale for good."""
    tasks = [task(f"t-{i}", worker="mac", at=T0 + i, total_ms=900 + i) for i in range(5)]
    async with bus(nats_server.url) as (nc, js):
        last = await publish_tasks(js, tasks)
        async with running_stats(nc, settings_for(nats_server, pg_dsn)):
            await eventually(lambda: all_acked(js, last), what="the log to be projected")
            shown = await figures(nc)
        conn = await asyncpg.connect(pg_dsn)
        try:
            await conn.execute("DELETE FROM figures")  # as if stopped before a refresh
        finally:
            await conn.close()
        async with running_stats(nc, settings_for(nats_server, pg_dsn)):
            restored = (await read_model(pg_dsn))["figures"]

    assert [(f["model"], f["worker"], f["count"]) for f in restored] == [
        (model, worker, figure["count"]) for (model, _, worker), figure in shown.items()
    ]
    assert restored[0]["count"] == 5
