"""The stats service against a real nats-server and a real PostgreSQL: projection, exactly-once
application under redelivery, the ``coordinator.task`` endpoint and poison messages."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import asyncpg
import msgspec
import nats
import nats.errors
from nats.aio.client import Client
from nats.js import JetStreamContext
from structlog.contextvars import merge_contextvars
from structlog.testing import capture_logs

from devtools.servers import NatsServer
from schemas.events import (
    Durations,
    TaskCompleted,
    TaskEvent,
    TaskFailed,
    TaskRouted,
    TaskStarted,
    TaskSubmitted,
    Tokens,
    WorkerRegistered,
)
from schemas.queries import TaskView
from schemas.subjects import EVENTS_STREAM, STATS_CONSUMER, TASK
from schemas.work import Work
from services.errors import Unavailable
from services.runtime.bus import ensure_streams, publish_event
from services.stats.figures import routing_figure
from services.stats.projection import TaskState
from services.stats.rows import TASK_LOCK_SPACE
from services.stats.service import run
from services.stats.settings import StatsSettings
from services.stats.store import Store

T = TypeVar("T")

# Exactly representable in microseconds, so timestamps survive timestamptz unchanged.
T0 = 1_700_000_000.25
DURATIONS = Durations(total_ms=9000.0, load_ms=1200.0, prompt_eval_ms=300.0, eval_ms=7000.0)


def life_of(
    task_id: str,
    *,
    worker: str = "mac",
    domain: str | None = "code",
    ok: bool = True,
    load_ms: float = 1200.0,
) -> list[TaskEvent]:
    """The events of one task from submission to its end, as router and worker publish them."""
    end: TaskEvent
    if ok:
        end = TaskCompleted(
            at=T0 + 9.5,
            task_id=task_id,
            attempt=1,
            worker=worker,
            model="qwen2.5:7b",
            response="four",
            thinking="2 + 2",
            durations=Durations(
                total_ms=9000.0, load_ms=load_ms, prompt_eval_ms=300.0, eval_ms=7000.0
            ),
            tokens=Tokens(prompt=11, eval=42),
        )
    else:
        end = TaskFailed(
            at=T0 + 9.5,
            task_id=task_id,
            attempt=1,
            worker=worker,
            code="backend_error",
            reason="model crashed",
        )
    return [
        TaskSubmitted(
            at=T0,
            task_id=task_id,
            model="qwen2.5:7b",
            timeout_s=60.0,
            work=Work(prompt="what is 2 + 2?", domain=domain),
        ),
        TaskRouted(
            at=T0 + 0.25, task_id=task_id, attempt=1, worker=worker, queue=f"tasks.gpu.{worker}"
        ),
        TaskStarted(at=T0 + 0.5, task_id=task_id, attempt=1, worker=worker, host=f"{worker}.lan"),
        end,
    ]


async def eventually(
    probe: Callable[[], Awaitable[T | None]], *, timeout_s: float = 8.0, what: str = "condition"
) -> T:
    """Poll ``probe`` until it returns something other than None."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = await probe()
        if result is not None:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(0.05)


@asynccontextmanager
async def bus(url: str) -> AsyncIterator[tuple[Client, JetStreamContext]]:
    """A client connection with the streams in place."""
    nc = await nats.connect(url)
    js = nc.jetstream()
    await ensure_streams(js)
    try:
        yield nc, js
    finally:
        await nc.close()


@asynccontextmanager
async def store_at(dsn: str) -> AsyncIterator[Store]:
    """A store on the test database, schema applied."""
    store = await Store.connect(dsn)
    try:
        await store.apply_schema()
        yield store
    finally:
        await store.close()


@asynccontextmanager
async def running_stats(nc: Client, settings: StatsSettings) -> AsyncIterator[None]:
    """The stats service in this event loop, ready to answer; stopped (and checked) at exit."""
    stop = asyncio.Event()
    service = asyncio.create_task(run(settings, stop))

    async def answers() -> bool | None:
        if service.done():
            service.result()  # raises what made the service fail
        try:
            await nc.request(TASK, b'{"task_id": "readiness-probe"}', timeout=1)
        except nats.errors.NoRespondersError:
            return None
        return True

    try:
        await eventually(answers, what="the stats service to answer")
        yield
    finally:
        stop.set()
        await asyncio.wait_for(service, timeout=10)


async def publish_all(js: JetStreamContext, events: list[TaskEvent]) -> int:
    """Publish ``events`` in order; the stream sequence of the last one."""
    seq = 0
    for event in events:
        ack = await publish_event(js, event)
        seq = int(ack.seq)
    return seq


async def rows(dsn: str, table: str) -> list[dict[str, Any]]:
    """Every row of ``table``, in a stable order."""
    conn = await asyncpg.connect(dsn)
    try:
        records = await conn.fetch(f"SELECT * FROM {table} ORDER BY 1, 2")
    finally:
        await conn.close()
    return [dict(r) for r in records]


async def all_acked(js: JetStreamContext, last_seq: int) -> bool | None:
    """True once the stats consumer has acked (or terminated) everything up to ``last_seq``."""
    info = await js.consumer_info(EVENTS_STREAM, STATS_CONSUMER)
    floor = info.ack_floor.stream_seq if info.ack_floor is not None else 0
    return True if (floor or 0) >= last_seq and not info.num_ack_pending else None


def settings_for(nats_server: NatsServer, pg_dsn: str) -> StatsSettings:
    return StatsSettings(nats_url=nats_server.url, pg_dsn=pg_dsn, batch_size=16)


async def test_a_task_is_projected_and_served_on_coordinator_task(
    nats_server: NatsServer, pg_dsn: str
) -> None:
    async with bus(nats_server.url) as (nc, js), store_at(pg_dsn) as store:
        await publish_all(js, life_of("t-done"))

        async with running_stats(nc, settings_for(nats_server, pg_dsn)):

            async def done() -> TaskState | None:
                state = await store.task_state("t-done")
                return state if state is not None and state.status == "done" else None

            state = await eventually(done, what="the task to be done")
            reply = await nc.request(TASK, b'{"task_id": "t-done"}', timeout=5)

        figures = await store.figures()

    assert (state.worker, state.host, state.attempt) == ("mac", "mac.lan", 1)
    assert (state.total_ms, state.load_ms, state.eval_tokens) == (9000.0, 1200.0, 42)
    assert state.started_at == T0 + 0.5

    assert reply.headers is None or "Nats-Service-Error-Code" not in reply.headers
    assert msgspec.json.decode(reply.data, type=TaskView) == TaskView(
        task_id="t-done",
        status="done",
        model="qwen2.5:7b",
        domain="code",
        task_type="inference",
        worker="mac",
        queue="tasks.gpu.mac",
        attempts=1,
        response="four",
        thinking="2 + 2",
        durations=DURATIONS,
        tokens=Tokens(prompt=11, eval=42),
        created_at=T0,
        ended_at=T0 + 9.5,
    )

    assert [(f.model, f.domain, f.worker, f.count, f.failures) for f in figures] == [
        ("qwen2.5:7b", "code", "mac", 1, 0)
    ]
    assert (figures[0].p50_ms, figures[0].load_ms_p50, figures[0].warm_p50_ms) == (
        9000.0,
        1200.0,
        7800.0,
    )
    assert figures[0].tokens_per_s == 42 / 7.0
    assert figures[0].cold_load_ms_p50 == 1200.0


async def test_the_cold_load_figure_counts_only_the_tasks_that_loaded_the_model(
    pg_dsn: str,
) -> None:
    # Loaded (1.2 s), already in memory (5 ms: Ollama's warm report), loaded (3 s).
    loads = {"t-cold": 1200.0, "t-warm": 5.0, "t-colder": 3000.0}
    events = [e for task, load in loads.items() for e in life_of(task, load_ms=load)]
    async with store_at(pg_dsn) as store:
        for seq, event in enumerate(events, start=1):
            assert await store.apply(seq, event)
        await store.refresh_figures()
        [figure] = await store.figures()

    assert (figure.load_ms_p50, figure.cold_load_ms_p50) == (1200.0, 2100.0)
    routing = routing_figure(figure, now=0.0)
    assert (routing.cold_load_ms, routing.warm_ms) == (2100.0, 9000.0 - 1200.0)


async def test_applying_the_same_stream_position_twice_changes_nothing(pg_dsn: str) -> None:
    events = life_of("t-once")
    async with store_at(pg_dsn) as store:
        for seq, event in enumerate(events, start=1):
            assert await store.apply(seq, event)
        tasks, figures = await rows(pg_dsn, "tasks"), await rows(pg_dsn, "figures")

        redelivered = await store.apply(4, events[3])

        assert redelivered is False
        assert await rows(pg_dsn, "tasks") == tasks
        assert await rows(pg_dsn, "figures") == figures

        # The same fact stored twice in the stream (a publish retried past the duplicate
        # window) is a new position, but the first outcome of the attempt stands.
        assert await store.apply(5, events[3])
        assert await rows(pg_dsn, "tasks") == tasks
        assert await rows(pg_dsn, "figures") == figures
        assert await store.last_seq() == 5


async def test_a_lost_database_connection_loses_no_event(
    pg_dsn: str,
) -> None:
    events = life_of("t-lost")
    async with store_at(pg_dsn) as store:
        assert await store.apply(1, events[0])
        admin = await asyncpg.connect(pg_dsn)
        try:
            await admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
        finally:
            await admin.close()

        # Whether asyncpg notices the loss before or during the next use is a race; either
        # way the event is stored exactly once, at the latest on the retry.
        try:
            applied = await store.apply(2, events[1])
        except Unavailable:
            applied = await store.apply(2, events[1])
        assert applied
        assert not await store.apply(2, events[1])

        view = await store.task_state("t-lost")
    assert view is not None
    assert (view.status, view.worker) == ("queued", "mac")


async def test_worker_events_are_tracked_and_recorded(pg_dsn: str) -> None:
    registered = WorkerRegistered(
        at=T0,
        worker_id="mac",
        host="mac.lan",
        instance_id="i-1",
        models=["qwen2.5:7b"],
        supports=["gpu_inference"],
        version="0.1.0",
    )
    async with store_at(pg_dsn) as store:
        assert await store.apply(1, registered)
        assert not await store.apply(1, registered)

    [seen] = await rows(pg_dsn, "workers_seen")
    assert (seen["worker_id"], seen["host"], seen["models"]) == ("mac", "mac.lan", ["qwen2.5:7b"])
    assert await rows(pg_dsn, "tasks") == []


async def test_replaying_every_event_after_a_consumer_reset_leaves_figures_unchanged(
    nats_server: NatsServer, pg_dsn: str
) -> None:
    settings = settings_for(nats_server, pg_dsn)
    async with bus(nats_server.url) as (nc, js):
        last = await publish_all(
            js, life_of("t-ok") + life_of("t-bad", worker="pc", domain=None, ok=False)
        )
        async with running_stats(nc, settings):
            await eventually(lambda: all_acked(js, last), what="every event to be acked")
        figures = await rows(pg_dsn, "figures")
        tasks = await rows(pg_dsn, "tasks")
        tracking = await rows(pg_dsn, "projection_tracking")

        # A deleted consumer comes back with deliver policy "all": everything is redelivered.
        await js.delete_consumer(EVENTS_STREAM, STATS_CONSUMER)
        async with running_stats(nc, settings):
            await eventually(lambda: all_acked(js, last), what="the replay to be acked")
            info = await js.consumer_info(EVENTS_STREAM, STATS_CONSUMER)

    assert info.delivered.stream_seq == last
    assert [(f["worker"], f["domain"], f["count"], f["failures"]) for f in figures] == [
        ("mac", "code", 1, 0),
        # No domain asked for: the heuristic's ("what is 2 + 2?" is math).
        ("pc", "math", 1, 1),
    ]
    assert await rows(pg_dsn, "figures") == figures
    assert await rows(pg_dsn, "tasks") == tasks
    assert await rows(pg_dsn, "projection_tracking") == tracking


async def test_query_errors_carry_a_code(nats_server: NatsServer, pg_dsn: str) -> None:
    async with (
        bus(nats_server.url) as (nc, _),
        running_stats(nc, settings_for(nats_server, pg_dsn)),
    ):
        unknown = await nc.request(TASK, b'{"task_id": "no-such-task"}', timeout=5)
        not_json = await nc.request(TASK, b"task please", timeout=5)
        missing = await nc.request(TASK, b"{}", timeout=5)

    assert unknown.headers is not None
    assert unknown.headers["Nats-Service-Error-Code"] == "not_found"
    assert json.loads(unknown.data) == {
        "error": {
            "code": "not_found",
            "message": "no task 'no-such-task' (it may not be projected yet)",
        }
    }
    for reply in (not_json, missing):
        assert reply.headers is not None
        assert reply.headers["Nats-Service-Error-Code"] == "bad_request"
        assert json.loads(reply.data)["error"]["code"] == "bad_request"
    assert "task_id" in json.loads(missing.data)["error"]["message"]


async def test_an_undecodable_event_is_terminated_and_does_not_block_the_stream(
    nats_server: NatsServer, pg_dsn: str
) -> None:
    async with bus(nats_server.url) as (nc, js), store_at(pg_dsn) as store:
        poison = await js.publish("events.task.x.completed", b"{this is not an event")
        last = await publish_all(js, life_of("t-after"))

        with capture_logs(processors=[merge_contextvars]) as logs:
            async with running_stats(nc, settings_for(nats_server, pg_dsn)):
                await eventually(lambda: all_acked(js, last), what="every event to be acked")
        view = await store.task_state("t-after")
        tracked = [r["stream_seq"] for r in await rows(pg_dsn, "projection_tracking")]

    assert view is not None
    assert view.status == "done"
    assert poison.seq not in tracked
    assert tracked == list(range(poison.seq + 1, last + 1))
    [terminated] = [e for e in logs if e["event"] == "undecodable event; terminated"]
    assert (terminated["log_level"], terminated["stream_seq"]) == ("error", poison.seq)


async def test_events_wait_unacked_while_the_database_fails_and_are_applied_after(
    nats_server: NatsServer, pg_dsn: str
) -> None:
    async with bus(nats_server.url) as (nc, js), store_at(pg_dsn) as store:
        admin = await asyncpg.connect(pg_dsn)
        try:
            with capture_logs() as logs:
                async with running_stats(nc, settings_for(nats_server, pg_dsn)):
                    # A real server error on every write: the table the projection needs is
                    # gone (after the start, which would create it again).
                    await admin.execute("ALTER TABLE tasks RENAME TO tasks_away")
                    last = await publish_all(js, life_of("t-outage"))

                    async def refused() -> bool | None:
                        return True if any("unavailable" in e["event"] for e in logs) else None

                    await eventually(refused, what="the database failure to be logged")
                    info = await js.consumer_info(EVENTS_STREAM, STATS_CONSUMER)
                    tracked_during = await rows(pg_dsn, "projection_tracking")

                    await admin.execute("ALTER TABLE tasks_away RENAME TO tasks")
                    await eventually(lambda: all_acked(js, last), what="the retry to be acked")
        finally:
            await admin.close()
        view = await store.task_state("t-outage")
        figures = await store.figures()

    assert info.ack_floor is not None
    assert (info.ack_floor.stream_seq or 0) < last  # nothing acked that was not stored
    assert tracked_during == []  # the failed transactions left no tracking row behind
    assert view is not None
    assert view.status == "done"
    assert [(f.count, f.failures) for f in figures] == [(1, 0)]


async def test_a_task_query_waits_for_an_end_the_stream_holds_but_the_projection_has_not_applied(
    nats_server: NatsServer, pg_dsn: str
) -> None:
    """Read-your-writes: a client told its task ended asks ``coordinator.task`` at once; the
    projection is behind (here: held on the task's lock), so the answer waits for it."""
    async with (
        bus(nats_server.url) as (nc, js),
        running_stats(nc, settings_for(nats_server, pg_dsn)),
    ):
        holder = await asyncpg.connect(pg_dsn)
        try:
            held = holder.transaction()
            await held.start()
            await holder.execute(
                "SELECT pg_advisory_xact_lock($1, hashtext($2))", TASK_LOCK_SPACE, "t-ryw"
            )
            await publish_all(js, life_of("t-ryw"))
            asked = asyncio.create_task(nc.request(TASK, b'{"task_id": "t-ryw"}', timeout=10))
            await asyncio.sleep(0.5)
            assert not asked.done()  # the projection cannot apply the task yet: the answer waits
            await held.rollback()
        finally:
            await holder.close()
        reply = msgspec.json.decode((await asked).data, type=TaskView)
    assert (reply.status, reply.response) == ("done", "four")


async def test_the_projection_takes_no_workers_event_for_an_attempt_routed_elsewhere(
    nats_server: NatsServer, pg_dsn: str
) -> None:
    forged = TaskCompleted(
        at=T0 + 5.0,
        task_id="t-forged",
        attempt=1,
        worker="eve",
        model="qwen2.5:7b",
        response="FORGED",
        durations=Durations(total_ms=1.0),
    )
    life = life_of("t-forged")
    async with bus(nats_server.url) as (nc, js), store_at(pg_dsn) as store:
        # Routed to mac; eve's outcome (on eve's own subject) comes before mac's.
        await publish_all(js, [*life[:3], forged, life[3]])
        with capture_logs() as logs:
            async with running_stats(nc, settings_for(nats_server, pg_dsn)):

                async def done() -> TaskState | None:
                    state = await store.task_state("t-forged")
                    return state if state is not None and state.status == "done" else None

                state = await eventually(done, what="the task to be done")
        outcomes = await rows(pg_dsn, "outcomes")
    assert (state.worker, state.response) == ("mac", "four")
    assert [(o["task_id"], o["worker"]) for o in outcomes] == [("t-forged", "mac")]
    [refused] = [e for e in logs if e["event"] == "task event refused"]
    assert "'eve'" in refused["problem"] and "routed to 'mac'" in refused["problem"]
