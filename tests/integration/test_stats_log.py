"""The read model when ``EVENTS`` changes under it, and events that cannot be projected,
against a real nats-server and a real PostgreSQL.

A position in ``EVENTS`` does not name an event: the stream recreated (a new cluster, a lost
volume) numbers its events from 1 again, one restored from an older backup numbers its new
events where the lost ones were, and one restored from a backup holds the same events under a
new ``created`` time. The projection tells them apart by the events themselves (a digest of
each), so nothing is skipped as applied and nothing is applied twice; ``coordinator doctor``
names a read model that holds events ``EVENTS`` no longer holds. An event that cannot be
projected (an exclusion from an old log whose time no table holds) is parked, and neither
wedges the projection nor fails a rebuild.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import asyncpg
import nats.js.errors
from nats.aio.client import Client
from nats.js import JetStreamContext
from structlog.testing import capture_logs

from devtools.servers import NatsServer
from schemas.events import AnyEvent, ExclusionAdded, QualityScored, TaskCompleted
from schemas.subjects import EVENTS_STREAM, STATS_CONSUMER, STATS_PARKED
from services.cli.doctor import run_doctor
from services.cli.doctor_line import Check
from services.runtime.bus import ensure_streams, publish_event
from services.stats.consumer import ProjectionConsumer, consumer_config
from services.stats.projector import Projected
from services.stats.store import Store
from services.stats.tracking import UNEXPLAINED_TRIES
from tests.harness import clean_env, request, run_cli
from tests.integration.test_stats import (
    all_acked,
    bus,
    eventually,
    rows,
    running_stats,
    settings_for,
    store_at,
)
from tests.integration.test_stats_replay import T0, publish_tasks, read_model, rebuild, task

# Waits across a stream's deletion: the projection notices at its next fetch and pauses (up to
# 5 s) before it makes its consumer again.
SWITCH_WAIT_S = 30.0


async def acked(js: JetStreamContext, last_seq: int) -> bool | None:
    """`all_acked`, or None while the stats consumer is not there (the stream was just made)."""
    try:
        return await all_acked(js, last_seq)
    except nats.js.errors.NotFoundError:
        return None


async def snapshot(nc: Client, stream: str) -> tuple[dict[str, Any], list[bytes]]:
    """A backup of ``stream`` as ``nats stream backup`` takes it (the JetStream API's
    snapshot): the stream's configuration and state, and the snapshot's chunks (its messages
    with their sequence numbers, and its consumers)."""
    inbox = nc.new_inbox()
    chunks: list[bytes] = []
    done = asyncio.Event()

    async def receive(msg: Any) -> None:
        if msg.reply:
            await nc.publish(msg.reply, b"")  # the flow control the server waits for
        if msg.data:
            chunks.append(msg.data)
        else:
            done.set()

    sub = await nc.subscribe(inbox, cb=receive)
    try:
        reply = await nc.request(
            f"$JS.API.STREAM.SNAPSHOT.{stream}",
            json.dumps({"deliver_subject": inbox, "chunk_size": 64 * 1024}).encode(),
            timeout=10,
        )
        meta = json.loads(reply.data)
        assert "error" not in meta, meta
        await asyncio.wait_for(done.wait(), timeout=30)
    finally:
        await sub.unsubscribe()
    return meta, chunks


async def restore(nc: Client, meta: dict[str, Any], chunks: list[bytes]) -> None:
    """Restore a `snapshot` (as ``nats stream restore`` does); the stream must not exist."""
    name = meta["config"]["name"]
    reply = await nc.request(
        f"$JS.API.STREAM.RESTORE.{name}",
        json.dumps({"config": meta["config"], "state": meta["state"]}).encode(),
        timeout=10,
    )
    started = json.loads(reply.data)
    assert "error" not in started, started
    for chunk in chunks:
        await nc.request(started["deliver_subject"], chunk, timeout=10)
    finished = json.loads((await nc.request(started["deliver_subject"], b"", timeout=30)).data)
    assert "error" not in finished, finished


async def doctor_says(nats_server: NatsServer, pg_dsn: str) -> dict[str, Check]:
    checks = await run_doctor(nats_server.url, pg_dsn=pg_dsn)
    return {check.name: check for check in checks}


async def task_statuses(pg_dsn: str) -> dict[str, str]:
    return {row["task_id"]: row["status"] for row in await rows(pg_dsn, "tasks")}


def tasks_of(prefix: str, count: int, *, worker: str = "mac", at: float = T0) -> list[Any]:
    return [
        task(f"{prefix}-{i}", worker=worker, at=at + i, total_ms=1000.0 + i) for i in range(count)
    ]


async def test_a_recreated_event_log_is_projected_and_the_doctor_says_what_it_still_counts(
    nats_server: NatsServer, pg_dsn: str
) -> None:
    async with bus(nats_server.url) as (nc, js):
        first = await publish_tasks(js, tasks_of("old", 3))
        async with running_stats(nc, settings_for(nats_server, pg_dsn)):
            await eventually(lambda: acked(js, first), what="the first log to be projected")
            # The log is lost (a new cluster, a lost volume): the next service to start makes
            # EVENTS again, and its events are numbered from 1.
            await js.delete_stream(EVENTS_STREAM)
            await ensure_streams(js)
            last = await publish_tasks(js, tasks_of("new", 6, worker="pc", at=T0 + 100))
            await eventually(
                lambda: acked(js, last), timeout_s=SWITCH_WAIT_S, what="the new log projected"
            )
            projected = await task_statuses(pg_dsn)
            model = await read_model(pg_dsn)
            switched = await doctor_says(nats_server, pg_dsn)
            rebuilt = await rebuild(nc)
            after = await doctor_says(nats_server, pg_dsn)
            statuses = await task_statuses(pg_dsn)
            rebuilt_model = await read_model(pg_dsn)

    assert first == 12 and last == 24
    # Every task of the new log reached PostgreSQL; the old log's stay, until a rebuild.
    assert projected == {f"old-{i}": "done" for i in range(3)} | {
        f"new-{i}": "done" for i in range(6)
    }
    assert [r["stream_seq"] for r in model["projection_tracking"]] == list(range(1, 25))
    assert [(r["stream_seq"], r["replaced_from"]) for r in model["replaced_tracking"]] == [
        (seq, 1) for seq in range(1, 13)
    ]
    check = switched["read model"]
    assert check.status == "problem"
    assert "still counts 12 event(s) of an event log EVENTS no longer holds" in check.detail
    assert "held others from #1 on" in check.detail
    assert "run `coordinator stats rebuild`" in check.detail

    assert rebuilt["events"] == 24
    assert statuses == {f"new-{i}": "done" for i in range(6)}
    assert rebuilt_model["replaced_tracking"] == []
    assert after["read model"].status == "ok"
    assert after["read model"].detail == "24 events of EVENTS handled, up to #24 of #24"


async def test_a_log_restored_from_a_backup_is_the_same_log_and_nothing_is_applied_twice(
    nats_server: NatsServer, pg_dsn: str
) -> None:
    async with bus(nats_server.url) as (nc, js):
        last = await publish_tasks(js, tasks_of("t", 4))
        async with running_stats(nc, settings_for(nats_server, pg_dsn)):
            await eventually(lambda: acked(js, last), what="the log to be projected")
            before = await read_model(pg_dsn)
            created = (await js.stream_info(EVENTS_STREAM)).created
            meta, chunks = await snapshot(nc, EVENTS_STREAM)
            await js.delete_stream(EVENTS_STREAM)
            await restore(nc, meta, chunks)
            restored = await js.stream_info(EVENTS_STREAM)
            # Every event comes again: the consumer made anew delivers the log from its start.
            await js.delete_consumer(EVENTS_STREAM, STATS_CONSUMER)
            more = await publish_tasks(js, tasks_of("after", 1, at=T0 + 50))
            await eventually(
                lambda: acked(js, more), timeout_s=SWITCH_WAIT_S, what="the log projected again"
            )
            info = await js.consumer_info(EVENTS_STREAM, STATS_CONSUMER)
            await request(nc, "coordinator.stats", {})  # the figures brought up to date
            after = await read_model(pg_dsn)
            says = await doctor_says(nats_server, pg_dsn)

    # The same events at the same positions, under another `created`: why the stream's
    # creation time is no name for the log.
    assert restored.state.last_seq == last
    assert restored.created != created
    assert info.delivered.stream_seq == more  # the whole log was delivered again
    assert after["replaced_tracking"] == []
    assert [r["stream_seq"] for r in after["projection_tracking"]] == list(range(1, more + 1))
    assert after["projection_tracking"][:last] == before["projection_tracking"]
    assert [(f["worker"], f["count"]) for f in after["figures"]] == [("mac", 5)]
    assert len(after["outcomes"]) == 5
    assert says["read model"].status == "ok"


async def test_a_log_restored_from_an_older_copy_has_its_new_events_projected(
    nats_server: NatsServer, pg_dsn: str
) -> None:
    async with bus(nats_server.url) as (nc, js):
        older = await publish_tasks(js, tasks_of("a", 2))
        async with running_stats(nc, settings_for(nats_server, pg_dsn)):
            await eventually(lambda: acked(js, older), what="the first tasks to be projected")
            meta, chunks = await snapshot(nc, EVENTS_STREAM)
            lost = await publish_tasks(js, tasks_of("b", 2, at=T0 + 10))
            await eventually(lambda: acked(js, lost), what="the tasks the backup lacks")
            # The server's store is lost; the backup is restored, without the b tasks.
            await js.delete_stream(EVENTS_STREAM)
            await restore(nc, meta, chunks)
            behind = await doctor_says(nats_server, pg_dsn)
            # New tasks: their events take the positions the lost ones had.
            last = await publish_tasks(js, tasks_of("c", 2, at=T0 + 20))
            await eventually(
                lambda: acked(js, last), timeout_s=SWITCH_WAIT_S, what="the new tasks projected"
            )
            projected = await task_statuses(pg_dsn)
            model = await read_model(pg_dsn)
            replaced = await doctor_says(nats_server, pg_dsn)
            await rebuild(nc)
            statuses = await task_statuses(pg_dsn)
            rebuilt_model = await read_model(pg_dsn)
            after = await doctor_says(nats_server, pg_dsn)

    assert (older, lost, last) == (8, 16, 16)
    assert behind["read model"].status == "problem"
    assert (
        "it has applied EVENTS up to #16, but EVENTS ends at #8: EVENTS was recreated or "
        "restored from an older copy, and the events it applied at #9–#16 are no longer in it"
    ) in behind["read model"].detail
    assert projected == {f"{p}-{i}": "done" for p in "abc" for i in range(2)}
    assert [(r["stream_seq"], r["replaced_from"]) for r in model["replaced_tracking"]] == [
        (seq, 9) for seq in range(9, 17)
    ]
    assert replaced["read model"].status == "problem"
    assert "still counts 8 event(s)" in replaced["read model"].detail
    assert statuses == {f"{p}-{i}": "done" for p in "ac" for i in range(2)}
    assert rebuilt_model["replaced_tracking"] == []
    assert after["read model"].status == "ok"


# Exclusions as an old log holds them (recorded before their times were checked), and a
# verdict whose score the quality table refuses.
UNPROJECTABLE: list[AnyEvent] = [
    *(
        ExclusionAdded(
            at=T0, exclusion_id=f"x-bad-{i}", worker="mac", since=since, reason="old log"
        )
        for i, since in enumerate([1e308, 2.0**63, -1e18, 1.7e12])  # the last: milliseconds
    ),
    QualityScored(
        at=T0,
        task_id="ok-0",
        attempt=1,
        verdict="scored",
        score=7.0,
        rubric="code",
        judge_model="judge:1b",
        judge_host="http://judge:11434",
    ),
]


PARKED_LINE = "event parked: it cannot be projected"


async def test_events_that_cannot_be_projected_are_parked_and_the_rest_projected(
    nats_server: NatsServer, pg_dsn: str, tmp_path: Path
) -> None:
    env = clean_env(NATS_URL=nats_server.url, COORDINATOR_HOME=str(tmp_path))
    async with bus(nats_server.url) as (nc, js):
        await publish_tasks(js, tasks_of("ok", 1))
        for event in UNPROJECTABLE:
            await publish_event(js, event)
        last = await publish_tasks(js, tasks_of("later", 2, at=T0 + 10))
        with capture_logs() as logs:
            async with running_stats(nc, settings_for(nats_server, pg_dsn)):
                await eventually(lambda: acked(js, last), what="every event handled")
                statuses = await task_statuses(pg_dsn)
                exclusions = await rows(pg_dsn, "exclusions")
                parked, headers = await request(nc, STATS_PARKED, {})
                says = await doctor_says(nats_server, pg_dsn)
                listed = await asyncio.to_thread(run_cli, "stats", "parked", env=env)
                said = [e["stream_seq"] for e in logs if e["event"] == PARKED_LINE]
                rebuilt = await rebuild(nc)
                again, _ = await request(nc, STATS_PARKED, {})

    assert statuses == {"ok-0": "done", "later-0": "done", "later-1": "done"}
    assert exclusions == []
    assert "Nats-Service-Error-Code" not in headers, parked
    assert parked["total"] == 5
    by_seq = {p["stream_seq"]: p for p in parked["parked"]}
    assert sorted(by_seq) == list(range(5, 10))
    kinds = [by_seq[seq]["kind"] for seq in range(5, 10)]
    assert kinds == ["exclusion_added"] * 4 + ["quality_scored"]
    assert by_seq[5]["error"] == "time 1e+308 is out of range (epoch seconds within years 1-9999)"
    assert "out of range" in by_seq[8]["error"]  # milliseconds: year 55,000
    assert "quality_score_check" in by_seq[9]["error"]  # a check PostgreSQL holds
    assert {p["subject"] for p in parked["parked"]} >= {"events.stats.exclusion.added"}
    assert sorted(said) == list(range(5, 10))  # one error line each

    assert says["read model"].status == "ok"
    warning = says["parked events"]
    assert warning.status == "warning"
    assert warning.detail.startswith("5 event(s) cannot be projected and count in no figure")

    assert listed.returncode == 0, listed.stderr
    assert "EVENTS #5  exclusion_added  events.stats.exclusion.added" in listed.stdout

    # A rebuild replays them: parked again, never a failure.
    assert rebuilt["parked"] == 5
    assert rebuilt["events"] == last - 5
    assert again["total"] == 5


class FailsOn(Store):
    """The read model, but applying any batch that holds ``task_id``'s completion raises what
    no rule explains (as a bug in the projection would)."""

    failing_task = ""

    async def apply_batch(self, items: Any) -> Projected:
        if any(
            isinstance(i.event, TaskCompleted) and i.event.task_id == self.failing_task
            for i in items
        ):
            raise RuntimeError("a bug in the projection")
        return await super().apply_batch(items)


async def test_an_event_whose_failure_nothing_explains_is_tried_then_parked(
    nats_server: NatsServer, pg_dsn: str
) -> None:
    async with bus(nats_server.url) as (_, js), store_at(pg_dsn):
        last = await publish_tasks(js, tasks_of("t", 3))
        store = await FailsOn.connect(pg_dsn)
        store.failing_task = "t-1"
        await js.add_consumer(EVENTS_STREAM, consumer_config())
        sub = await js.pull_subscribe_bind(durable=STATS_CONSUMER, stream=EVENTS_STREAM)
        stopping = asyncio.Event()
        consumer = ProjectionConsumer(
            js,
            store,
            batch_size=16,
            stopping=stopping,
            touched=lambda keys: None,
            retry_delay_s=0.2,
        )
        running = asyncio.create_task(consumer.run(sub))
        try:
            with capture_logs() as logs:
                await eventually(lambda: all_acked(js, last), what="every event handled")
        finally:
            stopping.set()
            await running
            await store.close()
        parked = await rows(pg_dsn, "parked_events")
        statuses = await task_statuses(pg_dsn)

    [record] = parked
    assert (record["kind"], record["error"]) == (
        "completed",
        "RuntimeError: a bug in the projection",
    )
    assert record["subject"] == "events.task.t-1.mac.completed"
    assert statuses == {"t-0": "done", "t-1": "running", "t-2": "done"}
    assert consumer.counters.parked == 1
    assert consumer.counters.retried == UNEXPLAINED_TRIES - 1
    tries = [e["tries"] for e in logs if e["event"] == "projecting an event failed; it comes again"]
    assert tries == list(range(1, UNEXPLAINED_TRIES))


async def test_tables_from_before_digests_keep_their_rows_and_get_digests_at_start(
    nats_server: NatsServer, pg_dsn: str
) -> None:
    settings = settings_for(nats_server, pg_dsn)
    async with bus(nats_server.url) as (nc, js):
        first = await publish_tasks(js, tasks_of("old", 2))
        async with running_stats(nc, settings):
            await eventually(lambda: acked(js, first), what="the log to be projected")
        before = await read_model(pg_dsn)
        conn = await asyncpg.connect(pg_dsn)
        try:
            # The tables as the release before this one left them.
            await conn.execute(
                "ALTER TABLE projection_tracking DROP COLUMN digest; "
                "DROP TABLE replaced_tracking; DROP TABLE parked_events; DROP TABLE schema_applied"
            )
        finally:
            await conn.close()

        async with running_stats(nc, settings):

            async def filled() -> dict[str, list[dict[str, Any]]] | None:
                model = await read_model(pg_dsn)
                tracked = model["projection_tracking"]
                return model if all(r["digest"] is not None for r in tracked) else None

            migrated = await eventually(filled, what="the digests to be filled in")
            # The digests filled in are the log's: a new log is told from it.
            await js.delete_stream(EVENTS_STREAM)
            await ensure_streams(js)
            last = await publish_tasks(js, tasks_of("new", 1, at=T0 + 10))
            await eventually(
                lambda: acked(js, last), timeout_s=SWITCH_WAIT_S, what="the new log projected"
            )
            statuses = await task_statuses(pg_dsn)

    assert [r["stream_seq"] for r in migrated["projection_tracking"]] == list(range(1, 9))
    # The very digests the projection had written: the events' own.
    assert migrated["projection_tracking"] == before["projection_tracking"]
    assert migrated["tasks"] == before["tasks"]
    assert statuses == {"old-0": "done", "old-1": "done", "new-0": "done"}


async def test_a_digest_tells_a_redelivery_from_another_event_at_the_same_position(
    pg_dsn: str,
) -> None:
    [one, other] = [tasks_of(p, 1)[0][0] for p in ("one", "other")]
    async with store_at(pg_dsn) as store:
        assert await store.apply(1, one)
        again = await store.apply(1, one)
        replaced = await store.apply(1, other)
        tracked = await rows(pg_dsn, "projection_tracking")
        set_aside = await rows(pg_dsn, "replaced_tracking")
        applied_one = await store.applied(1, tracked[0]["digest"])

    assert (again, replaced) == (False, True)
    assert [r["stream_seq"] for r in tracked] == [1]
    assert [(r["stream_seq"], r["replaced_from"]) for r in set_aside] == [(1, 1)]
    assert set_aside[0]["digest"] != tracked[0]["digest"]
    assert applied_one


async def test_a_stats_service_starting_beside_a_busy_one_takes_no_lock_on_its_tables(
    pg_dsn: str,
) -> None:
    """A standby starts while the active instance writes: the schema it would apply is the one
    applied already, so it applies nothing and waits for no lock (an ALTER TABLE takes its
    table's strongest lock even when it changes nothing: the two deadlocked). A schema that
    must be brought up to date meanwhile waits for the writer's transaction to end."""
    first = await Store.connect(pg_dsn)
    try:
        await first.apply_schema()
        writer = await asyncpg.connect(pg_dsn)
        try:
            busy = writer.transaction()
            await busy.start()  # a batch in hand: its locks held until it commits
            await writer.execute(
                "INSERT INTO projection_tracking (projection, stream_seq, digest) "
                "VALUES ('tasks', 999999, '\\x00')"
            )
            second = await Store.connect(pg_dsn)
            try:
                await asyncio.wait_for(second.apply_schema(), 5)  # would wait for the writer
                other = await asyncpg.connect(pg_dsn)
                try:
                    await other.execute("DELETE FROM schema_applied")  # as an older release left
                finally:
                    await other.close()
                bring_up = asyncio.create_task(second.apply_schema())
                await asyncio.sleep(0.5)
                assert not bring_up.done()  # it waits for the writer's lock, unharmed
                await busy.rollback()
                await asyncio.wait_for(bring_up, 30)
            finally:
                await second.close()
        finally:
            await writer.close()
    finally:
        await first.close()
