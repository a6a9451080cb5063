"""Reaper and stats run active/standby: any number of instances, one acting at a time (the
lease in the ``leaders`` bucket); a standby takes over within a TTL of the active one's end
and acts, and the statistics project every event once, in order, across a takeover."""

from __future__ import annotations

import asyncio
import signal
import time
from functools import partial
from typing import Any

import asyncpg
import msgspec
from nats.aio.client import Client
from nats.js.errors import KeyNotFoundError
from structlog.testing import capture_logs

from benchmarks.replay import generate, publish
from devtools.fakes.ollama import FakeOllama
from devtools.servers import NatsServer
from schemas.events import TaskRouted, TaskStarted
from schemas.leaders import LeaderRecord
from schemas.subjects import EVENTS_STREAM, LEADERS_BUCKET, STATS_CONSUMER
from services.runtime.bus import connect, ensure_bucket, ensure_streams
from services.runtime.leadership import Leadership
from services.stats.consumer import consumer_config
from services.stats.rebuild import rebuild
from tests.harness import (
    COORDINATOR,
    Processes,
    ServiceRunner,
    clean_env,
    eventually,
    request,
    workers_live,
)
from tests.process_logs import ProcessLog
from tests.reaper_harness import MODEL, TaskEvents

TTL_S = 3.0


def state_of(leadership: Leadership) -> str:
    """``leadership.state`` now (a call, so that a check after an await reads it again)."""
    return leadership.state


async def in_state(leadership: Leadership, state: str) -> bool:
    """Whether ``leadership`` is in ``state`` now (for `eventually`)."""
    return leadership.state == state


def kill(log: ProcessLog) -> None:
    log.proc.send_signal(signal.SIGKILL)
    log.proc.wait(10)


async def holder(nc: Client, role: str) -> LeaderRecord | None:
    kv = await nc.jetstream().key_value(LEADERS_BUCKET)
    try:
        entry = await kv.get(role)
    except KeyNotFoundError:
        return None
    return msgspec.json.decode(entry.value or b"", type=LeaderRecord)


async def active_and_standby(
    nc: Client, role: str, logs: list[ProcessLog]
) -> tuple[ProcessLog, ProcessLog]:
    """The instance that holds ``role`` (by the bucket's pid) and the other."""

    async def held() -> LeaderRecord | None:
        return await holder(nc, role)

    record: LeaderRecord = await eventually(held, timeout_s=15)
    active = next(log for log in logs if log.pid == record.pid)
    return active, next(log for log in logs if log is not active)


# -- the lease ----------------------------------------------------------------------------------


async def test_two_instances_never_act_at_once_and_a_stop_hands_the_role_on(nc: Client) -> None:
    """In process: the second instance stands by while the first acts, takes over when it
    stops (the entry is deleted: at once, not after a TTL), and the first, started again,
    stands by."""
    kv = await ensure_bucket(nc.jetstream(), LEADERS_BUCKET, ttl_s=TTL_S)
    acting: list[str] = []
    overlaps: list[tuple[str, str]] = []

    def work(name: str) -> Any:
        async def act() -> None:
            if acting:
                overlaps.append((acting[0], name))
            acting.append(name)
            try:
                await asyncio.Event().wait()  # until cancelled, or stopped below
            finally:
                acting.remove(name)

        return act

    stops = {name: asyncio.Event() for name in ("a", "b")}
    first = Leadership(kv, "reaper", ttl_s=TTL_S, interval_s=0.5)
    second = Leadership(kv, "reaper", ttl_s=TTL_S, interval_s=0.5)
    running_a = asyncio.create_task(first.run(work("a"), stops["a"], stop_grace_s=0.5))

    async def a_acts() -> bool:
        return acting == ["a"]

    await eventually(a_acts)
    running_b = asyncio.create_task(second.run(work("b"), stops["b"], stop_grace_s=0.5))
    await asyncio.sleep(2 * TTL_S)  # two TTLs of renewals: b never takes it meanwhile
    assert (first.state, second.state, acting) == ("active", "standby", ["a"])

    stopped_at = time.monotonic()
    stops["a"].set()
    await running_a

    async def b_acts() -> bool:
        return acting == ["b"]

    await eventually(b_acts, timeout_s=TTL_S)
    handed_over_s = time.monotonic() - stopped_at
    record = await holder(nc, "reaper")
    assert record is not None and record.instance_id == second.instance_id
    print(f"role handed on {handed_over_s:.2f} s after a stop")

    again = Leadership(kv, "reaper", ttl_s=TTL_S, interval_s=0.5)
    stops["c"] = asyncio.Event()
    running_c = asyncio.create_task(again.run(work("c"), stops["c"], stop_grace_s=0.5))
    await asyncio.sleep(1.5)
    assert (again.state, acting) == ("standby", ["b"])
    for stop in stops.values():
        stop.set()
    await asyncio.gather(running_b, running_c)
    assert overlaps == []


async def test_an_active_instance_whose_renewals_are_not_stored_stops_before_its_lease_expires(
    nc: Client,
) -> None:
    """Renewals refused (another instance's entry written over this one's, as a standby's
    take-over of a stale entry would be): the active one stops acting and stands by."""
    kv = await ensure_bucket(nc.jetstream(), LEADERS_BUCKET, ttl_s=TTL_S)
    acting = asyncio.Event()
    stopped = asyncio.Event()

    async def act() -> None:
        acting.set()
        try:
            await asyncio.Event().wait()
        finally:
            stopped.set()

    stop = asyncio.Event()
    leader = Leadership(kv, "stats", ttl_s=TTL_S, interval_s=0.5)
    with capture_logs() as logs:
        running = asyncio.create_task(leader.run(act, stop, stop_grace_s=0.5))
        await asyncio.wait_for(acting.wait(), 5)
        entry = await kv.get("stats")
        theirs = msgspec.structs.replace(
            msgspec.json.decode(entry.value or b"", type=LeaderRecord),
            instance_id="someone-else",
            heartbeat_at=time.time(),
        )
        await kv.update("stats", msgspec.json.encode(theirs), last=entry.revision)
        await asyncio.wait_for(stopped.wait(), 5)
        # The leadership takes note a moment after the work's own clean-up has run.
        await eventually(partial(in_state, leader, "standby"), timeout_s=5)

        async def standing_by() -> bool:
            return any(e["event"] == "stats standing by" for e in logs)

        await eventually(standing_by, timeout_s=5)
        stop.set()
        await running
    assert any("stopped acting: its lease was taken over" in e["event"] for e in logs)
    entry = await kv.get("stats")  # the other instance's entry, left as it was
    assert msgspec.json.decode(entry.value or b"", type=LeaderRecord).instance_id == (
        "someone-else"
    )


async def test_an_active_instance_cut_off_from_nats_stops_before_its_lease_can_expire(
    nats_server: NatsServer,
) -> None:
    """Its renewals no longer stored (the server is gone), it stops acting while its entry is
    still fresh, so no standby can have begun; with the server back it acts again."""
    nc = await connect(nats_server.url, "test-leadership")
    try:
        kv = await ensure_bucket(nc.jetstream(), LEADERS_BUCKET, ttl_s=TTL_S)
        acting = asyncio.Event()
        stopped_at: list[float] = []

        async def act() -> None:
            acting.set()
            try:
                await asyncio.Event().wait()
            finally:
                stopped_at.append(time.time())

        stop = asyncio.Event()
        leader = Leadership(kv, "reaper", ttl_s=TTL_S, interval_s=0.5)
        with capture_logs() as logs:
            running = asyncio.create_task(leader.run(act, stop, stop_grace_s=0.5))
            await asyncio.wait_for(acting.wait(), 5)
            acting.clear()
            nats_server.stop()

            async def stopped() -> bool:
                return bool(stopped_at)

            await eventually(stopped, timeout_s=TTL_S + 2)
            last_stored = leader.lease.stored_at
            assert last_stored is not None
            assert stopped_at[0] < last_stored + TTL_S  # before anyone may judge it stale
            await eventually(partial(in_state, leader, "standby"), timeout_s=5)

            nats_server.start()
            await asyncio.wait_for(acting.wait(), 20)  # the role again, once back
            assert state_of(leader) == "active"
            stop.set()
            await running
        assert any("out of touch with NATS" in e["event"] for e in logs)
        assert await holder(nc, "reaper") is None  # handed on at the stop
    finally:
        await nc.close()


async def test_work_that_fails_hands_the_role_on(nc: Client) -> None:
    kv = await ensure_bucket(nc.jetstream(), LEADERS_BUCKET, ttl_s=TTL_S)
    took_over = asyncio.Event()

    async def broken() -> None:
        raise RuntimeError("a bug")

    async def sound() -> None:
        took_over.set()
        await asyncio.Event().wait()

    stop = asyncio.Event()
    first = Leadership(kv, "stats", ttl_s=TTL_S, interval_s=0.5)
    second = Leadership(kv, "stats", ttl_s=TTL_S, interval_s=0.5)
    with capture_logs() as logs:
        running = [asyncio.create_task(first.run(broken, stop, stop_grace_s=0.5))]
        await asyncio.sleep(0.2)
        running.append(asyncio.create_task(second.run(sound, stop, stop_grace_s=0.5)))
        await asyncio.wait_for(took_over.wait(), TTL_S)  # at once: the entry was deleted
        assert (first.state, second.state) == ("standby", "active")
        stop.set()
        await asyncio.gather(*running)
    failed = [e for e in logs if e["event"] == "stats work ended; handing the role on"]
    assert failed and "a bug" in failed[0]["error"]


# -- the reaper ---------------------------------------------------------------------------------


def doomed_worker(processes: Processes, url: str, ollama: FakeOllama, name: str) -> ProcessLog:
    env = clean_env(
        NATS_URL=url,
        OLLAMA_HOST=ollama.url,
        WORKER_ID=name,
        WORKER_HOST=f"host-{name}",
        HEARTBEAT_INTERVAL_S="0.5",
        WORKER_TTL_S="3",
        WORKER_MODELS=MODEL,
    )
    return ProcessLog(processes.start([COORDINATOR, "worker"], env))


async def running_on(events: TaskEvents, nc: Client, worker: str) -> str:
    """Route one task (it goes to ``worker``, the first by name among idle workers) and wait
    until it runs there."""
    body, _ = await request(nc, "coordinator.route", {"prompt": "1+1", "model": MODEL})
    task_id = str(body["task_id"])
    started = await events.wait_for(lambda e: isinstance(e, TaskStarted) and e.task_id == task_id)
    assert isinstance(started, TaskStarted) and started.worker == worker
    return task_id


async def test_two_reapers_one_acts_and_the_standby_takes_over_within_a_ttl_and_acts(
    nats_server: NatsServer,
    nc: Client,
    ollama: FakeOllama,
    runner: ServiceRunner,
    processes: Processes,
) -> None:
    url = nats_server.url
    runner.router(url)
    env = clean_env(NATS_URL=url, REAPER_INTERVAL_S="0.2", WORKER_TTL_S="3", GHOST_AFTER_S="30")
    reapers = [ProcessLog(processes.start([COORDINATOR, "reaper"], env)) for _ in range(2)]
    for reaper in reapers:
        await reaper.wait_for("reaper ready")
    active, standby = await active_and_standby(nc, "reaper", reapers)
    await standby.wait_for("reaper standing by")

    # Both answer their status, each saying which it is and who acts.
    seen: dict[str, dict[str, Any]] = {}
    for _ in range(40):
        body, _ = await request(nc, "coordinator.reaper.status", {}, timeout_s=2)
        seen[body["role"]] = body
        if len(seen) == 2:
            break
    assert set(seen) == {"active", "standby"}
    assert {body["active"]["pid"] for body in seen.values()} == {active.pid}

    with FakeOllama() as slow:
        async with TaskEvents(nc) as events:
            first = doomed_worker(processes, url, slow, "cpu-a1")
            await workers_live(nc, 1)
            runner.worker(url, ollama.url, "cpu-z")  # where moved tasks go
            await workers_live(nc, 2)
            slow.delay_s = 60.0  # after the sanity runs
            moved_first = await running_on(events, nc, "cpu-a1")
            kill(first)
            await events.first("completed", moved_first)

            # Only the active one acted, once (the stream would take a second move of the
            # same attempt as a duplicate: the logs say who acted).
            assert active.count("task moved") == 1
            assert standby.count("task moved") == 0

            slow.delay_s = 0.0
            second = doomed_worker(processes, url, slow, "cpu-a2")
            await workers_live(nc, 2)  # cpu-a1 is gone
            slow.delay_s = 60.0
            moved_second = await running_on(events, nc, "cpu-a2")
            killed_at = time.monotonic()
            kill(active)  # the reaper that acts, with no word to anyone
            kill(second)  # a dead worker that only the standby can now move
            took_over = await standby.wait_for("reaper active", timeout_s=TTL_S + 5)
            await events.first("completed", moved_second)

    takeover_s = took_over["_seen_at"] - killed_at
    print(f"standby reaper took over {takeover_s:.2f} s after the active one was killed")
    assert takeover_s <= TTL_S + 1.0  # a TTL after the last renewal, and the log line's way
    assert standby.count("task moved") == 1
    for task_id in (moved_first, moved_second):
        routed = [e for e in events.of(task_id, "routed") if isinstance(e, TaskRouted)]
        assert [e.attempt for e in routed] == [1, 2]
        assert len(events.of(task_id, "completed")) == 1
    record = await holder(nc, "reaper")
    assert record is not None and record.pid == standby.pid


# -- the stats service --------------------------------------------------------------------------


async def projection(dsn: str) -> dict[str, Any]:
    """What the read model holds, in an order that compares."""
    conn = await asyncpg.connect(dsn)
    try:
        return {
            "tracking": await conn.fetchrow(
                "SELECT count(*), count(DISTINCT stream_seq), min(stream_seq), max(stream_seq) "
                "FROM projection_tracking"
            ),
            "tasks": await conn.fetch(
                "SELECT task_id, status, model, domain, worker, attempt, attempts "
                "FROM tasks ORDER BY task_id"
            ),
            "outcomes": await conn.fetch(
                "SELECT task_id, attempt, model, domain, worker, ok FROM outcomes "
                "ORDER BY task_id, attempt"
            ),
            "figures": await conn.fetch(
                "SELECT model, domain, worker, count, failures FROM figures "
                "ORDER BY model, domain, worker"
            ),
        }
    finally:
        await conn.close()


async def projected(dsn: str) -> int:
    """Events the projection has applied (0 before the service made its tables)."""
    conn = await asyncpg.connect(dsn)
    try:
        return int(await conn.fetchval("SELECT count(*) FROM projection_tracking"))
    except asyncpg.UndefinedTableError:
        return 0
    finally:
        await conn.close()


async def assert_projected_once_in_order(nc: Client, dsn: str, count: int) -> None:
    """Every event of the log applied once, and the tables what a replay of the log in order
    makes of it (a task's end applied before its start would differ)."""
    # The figures of what the last batches touched, brought up to date as for an answer.
    await request(nc, "coordinator.stats", {}, timeout_s=10)
    live = await projection(dsn)
    assert tuple(live["tracking"]) == (count, count, 1, count)
    await rebuild(nc.jetstream(), dsn)
    assert await projection(dsn) == live


async def test_a_takeover_applies_in_order_what_the_previous_instance_had_in_hand(
    nats_server: NatsServer, nc: Client, runner: ServiceRunner, pg_dsn: str
) -> None:
    """A batch fetched and never acknowledged (the instance that fetched it died) is applied
    first and in order by the next one, not after its ack wait behind newer events."""
    js = nc.jetstream()
    await ensure_streams(js)
    count = 3000
    await publish(js, generate(count))
    await js.add_consumer(EVENTS_STREAM, consumer_config())
    in_hand = await js.pull_subscribe_bind(durable=STATS_CONSUMER, stream=EVENTS_STREAM)
    held = await in_hand.fetch(300, timeout=5)  # never acked: its ack wait is 30 s
    assert len(held) == 300

    started = time.monotonic()
    with capture_logs() as logs:
        runner.stats(nats_server.url, pg_dsn)

        async def all_in() -> bool:
            return await projected(pg_dsn) == count

        await eventually(all_in, timeout_s=20)
    assert time.monotonic() - started < 30  # well before the held batch would come again
    caught = [e for e in logs if e["event"] == "caught up"]
    assert [(e["first_seq"], e["last_seq"], e["fresh"]) for e in caught] == [(1, 300, 300)]
    await assert_projected_once_in_order(nc, pg_dsn, count)


async def test_two_stats_services_one_projects_and_a_takeover_projects_every_event_once(
    nats_server: NatsServer, nc: Client, processes: Processes, pg_dsn: str
) -> None:
    url = nats_server.url
    js = nc.jetstream()
    env = clean_env(NATS_URL=url, PG_DSN=pg_dsn, WORKER_TTL_S="3", BATCH_SIZE="50")
    first = ProcessLog(processes.start([COORDINATOR, "stats", "serve"], env))
    await first.wait_for("stats projecting")
    second = ProcessLog(processes.start([COORDINATOR, "stats", "serve"], env))
    await second.wait_for("stats standing by")
    active, standby = await active_and_standby(nc, "stats", [first, second])
    assert active is first

    # Both serve every endpoint; the figures, whichever instance takes the request, come
    # from the one that projects (the standby passes the request on).
    infos = await service_infos(nc, "coordinator-stats")
    assert len(infos) == 2 and infos[0] == infos[1] and {"stats", "task", "rebuild"} <= infos[0]
    for _ in range(8):
        body, headers = await request(nc, "coordinator.stats", {}, timeout_s=5)
        assert "Nats-Service-Error-Code" not in headers, body

    events = generate(6000)
    await publish(js, events[:2000])

    async def some_projected() -> bool:
        return await projected(pg_dsn) > 500

    await eventually(some_projected, timeout_s=20)
    await publish(js, events[2000:4000])
    killed_at = time.monotonic()
    kill(active)  # most likely with a batch in hand
    await publish(js, events[4000:])
    took_over = await standby.wait_for("stats projecting", timeout_s=TTL_S + 5)

    async def all_in() -> bool:
        return await projected(pg_dsn) == len(events)

    await eventually(all_in, timeout_s=25)  # within the ack wait: nothing waited for it
    takeover_s = took_over["_seen_at"] - killed_at
    print(f"standby stats service took over {takeover_s:.2f} s after the active one was killed")
    assert takeover_s <= TTL_S + 1.0

    # The standby pulled nothing before it took over.
    projecting_at = took_over["_seen_at"]
    batches = standby.events("batch projected")
    assert batches and all(b["_seen_at"] >= projecting_at for b in batches)
    await assert_projected_once_in_order(nc, pg_dsn, len(events))
    # It answers the figures now.
    body, headers = await request(nc, "coordinator.stats", {}, timeout_s=5)
    assert "Nats-Service-Error-Code" not in headers and body["figures"]


async def service_infos(nc: Client, name: str) -> list[set[str]]:
    """The endpoint names of every instance of micro service ``name`` (``$SRV.INFO``)."""
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    found: list[set[str]] = []
    try:
        await nc.publish(f"$SRV.INFO.{name}", b"", reply=inbox)
        while True:
            try:
                msg = await sub.next_msg(timeout=1.0)
            except Exception:
                break
            info = msgspec.json.decode(msg.data)
            found.append({endpoint["name"] for endpoint in info["endpoints"]})
    finally:
        await sub.unsubscribe()
    return found
