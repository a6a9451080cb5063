"""Least-privilege NATS: nats-server runs the committed deploy/nats/nats-server.conf, and each
service runs under its own user. The services do their work; a worker's user cannot touch
another worker's queue nor read the statistics' events."""

from __future__ import annotations

import asyncio
import dataclasses
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import nats
import pytest
from nats.aio.client import Client
from nats.js.api import AckPolicy, ConsumerConfig
from nats.js.errors import NotFoundError
from structlog.testing import capture_logs

from devtools.fakes.ollama import FakeOllama
from devtools.servers import NatsServer
from schemas.events import (
    ALIAS_EVENTS,
    AliasSet,
    ExclusionAdded,
    TaskCompleted,
    TaskFailed,
    TaskRouted,
)
from schemas.measures import Durations
from schemas.subjects import (
    EVENTS_STREAM,
    LEADERS_BUCKET,
    ROUTE,
    STATS,
    STATS_CONSUMER,
    TASK,
    TASKS_STREAM,
    cancel_from,
    inbox_prefix,
    task_event,
)
from services.cli.health import check_health, setup_streams
from services.cli.permissions import (
    EXAMPLE_WEB_WORKERS,
    EXAMPLE_WORKERS,
    NATS_ROLES,
    nats_user,
    password_variable,
)
from services.cli.roles import DEPLOY_DIR
from services.errors import BadRequest, NoResponder, Unavailable
from services.reaper.service import run as run_reaper
from services.reaper.settings import ReaperSettings
from services.runtime.aliases import AliasFollower
from services.runtime.bus import ensure_streams, publish_event
from services.runtime.outcomes import RouterReads, Sourced, stored_ends
from services.runtime.request import new_task_id
from services.runtime.settings import NatsAuth
from services.stats.service import run as run_stats
from services.stats.settings import StatsSettings
from tests.harness import (
    COORDINATOR,
    ServiceRunner,
    clean_env,
    eventually,
    request,
    workers_live,
)

USERS = [
    "admin",
    *NATS_ROLES,
    *(nats_user("worker", w) for w in EXAMPLE_WORKERS),
    *(nats_user("web-search", w) for w in EXAMPLE_WEB_WORKERS),
]
WORKER = EXAMPLE_WORKERS[0]
MODEL = "qwen2.5:0.5b"


def password(user: str) -> str:
    return f"pw-{user}"


@pytest.fixture
def secured() -> Iterator[NatsServer]:
    """nats-server with the committed configuration (its store moved to a temporary folder)."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="coord-nats-") as tmp:
        conf = (DEPLOY_DIR / "nats" / "nats-server.conf").read_text()
        assert "  store_dir: /var/lib/nats\n" in conf
        conf = conf.replace("  store_dir: /var/lib/nats\n", f"  store_dir: {tmp}/js\n")
        conf = conf.replace("http: 127.0.0.1:8222", "http: 127.0.0.1:0")
        path = Path(tmp) / "nats-server.conf"
        path.write_text(conf)
        env = {password_variable(user): password(user) for user in USERS}
        server = NatsServer(f"{tmp}/js", config=str(path), env=env).start()
        try:
            yield server
        finally:
            server.stop()


def run_fleet(
    runner: ServiceRunner,
    url: str,
    ollama_url: str,
    *,
    pg_dsn: str | None = None,
    reaper: bool = False,
) -> None:
    """The router and worker `WORKER` (and the stats service, the reaper), each under its
    own user of the shipped configuration."""
    if pg_dsn is not None:
        runner.start(
            run_stats,
            StatsSettings(
                nats_url=url, pg_dsn=pg_dsn, nats_user="stats", nats_password=password("stats")
            ),
        )
    runner.router(url, nats_user="router", nats_password=password("router"))
    if reaper:
        runner.start(
            run_reaper,
            ReaperSettings(nats_url=url, nats_user="reaper", nats_password=password("reaper")),
        )
    runner.worker(
        url,
        ollama_url,
        WORKER,
        nats_user=f"worker-{WORKER}",
        nats_password=password(f"worker-{WORKER}"),
    )


class Violations:
    """The server's permission errors a connection received."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    async def record(self, exc: Exception) -> None:
        self.seen.append(str(exc).lower())

    def about(self, subject: str) -> bool:
        return any("permissions violation" in e and subject.lower() in e for e in self.seen)


async def connect_as(server: NatsServer, user: str, errors: Violations | None = None) -> Client:
    options: dict[str, Any] = {
        "user": user,
        "password": password(user),
        "inbox_prefix": inbox_prefix(user),
    }
    if errors is not None:
        options["error_cb"] = errors.record
    return await nats.connect(server.url, **options)


@pytest.fixture
async def admin(secured: NatsServer) -> AsyncIterator[Client]:
    await setup_streams(
        secured.url,
        worker_ttl_s=3.0,
        events_max_age_s=0.0,
        auth=NatsAuth(user="admin", password=password("admin")),
    )
    client = await connect_as(secured, "admin")
    yield client
    await client.close()


async def test_each_service_does_its_work_under_its_own_user(
    secured: NatsServer, admin: Client, ollama: FakeOllama, runner: ServiceRunner, pg_dsn: str
) -> None:
    url = secured.url
    with capture_logs() as logs:
        run_fleet(runner, url, ollama.url, pg_dsn=pg_dsn, reaper=True)
        client = await connect_as(secured, "client")
        try:

            async def routed() -> dict[str, Any] | None:
                try:
                    body, _ = await request(
                        client,
                        ROUTE,
                        {"prompt": "1+1?", "model": "qwen2.5:0.5b", "wait": True},
                        timeout_s=5.0,
                    )
                except Exception:
                    return None
                return body if body.get("status") == "done" else None

            reply = await eventually(routed, timeout_s=20.0, interval_s=0.3)
            assert reply["worker"] == WORKER

            async def projected() -> dict[str, Any] | None:
                try:
                    body, _ = await request(client, TASK, {"task_id": reply["task_id"]}, 2.0)
                except Exception:
                    return None  # the stats service is still starting
                return body if body.get("status") == "done" else None

            await eventually(projected, timeout_s=10.0)
            # Each health check runs under its role's own user.
            for role in ("router", "stats", "reaper"):
                env = {
                    "NATS_URL": url,
                    "NATS_USER": role,
                    "NATS_PASSWORD": password(role),
                    "PG_DSN": pg_dsn,
                }
                assert await check_health(role, env) == "", role
        finally:
            await client.close()
        await runner.stop_all()
    denied = [e for e in logs if "permissions violation" in str(e.get("error", "")).lower()]
    assert denied == []


async def test_a_worker_cannot_use_another_workers_queue_nor_read_the_stats_events(
    secured: NatsServer, admin: Client
) -> None:
    ajs = admin.jetstream()
    await publish_event(
        ajs,
        ExclusionAdded(
            at=time.time(), exclusion_id="x-1", worker="cpu2", since=0.0, reason="polluted"
        ),
    )
    await publish_event(ajs, AliasSet(at=time.time(), alias="long:name", canonical="short"))
    await ajs.add_consumer(
        TASKS_STREAM,
        ConsumerConfig(
            name="worker-cpu2",
            durable_name="worker-cpu2",
            filter_subject="tasks.*.cpu2",
            ack_policy=AckPolicy.EXPLICIT,
            max_ack_pending=1,
        ),
    )
    await ajs.publish("tasks.cpu.cpu2", b"{}")

    errors = Violations()
    nc = await connect_as(secured, f"worker-{WORKER}", errors)
    js = nc.jetstream(timeout=1.0)
    own = ConsumerConfig(
        name=f"worker-{WORKER}",
        durable_name=f"worker-{WORKER}",
        filter_subject=f"tasks.*.{WORKER}",
        ack_policy=AckPolicy.EXPLICIT,
        max_ack_pending=1,
    )
    await ajs.add_consumer(TASKS_STREAM, own)  # as the router makes it for the worker
    try:
        # What it may: pull its own queue (never make or change it), its own events.
        mine = await js.pull_subscribe_bind(durable=f"worker-{WORKER}", stream=TASKS_STREAM)
        await ajs.publish(f"tasks.cpu.{WORKER}", b"{}")
        [msg] = await mine.fetch(1, timeout=2.0)
        await msg.ack()
        await js.publish(f"events.task.t1.{WORKER}.started", b"{}")  # on its own subject
        assert errors.seen == []

        # What it may not; each is refused by the server (the request gets no answer).
        others = await js.pull_subscribe_bind(durable="worker-cpu2", stream=TASKS_STREAM)
        attempts = [
            js.publish("tasks.cpu.cpu2", b"{}"),
            # Its own consumer with its limit lifted: one task at a time is the fleet's.
            js.add_consumer(TASKS_STREAM, dataclasses.replace(own, max_ack_pending=50)),
            js.add_consumer(
                TASKS_STREAM, ConsumerConfig(name=f"worker-{WORKER}", filter_subject="tasks.*.cpu2")
            ),
            others.fetch(1, timeout=1.0),
            js.subscribe("events.stats.>", stream=EVENTS_STREAM, ordered_consumer=True),
            js.add_consumer(
                EVENTS_STREAM,
                ConsumerConfig(name="peek", filter_subject="events.stats.exclusion.>"),
            ),
            js.add_consumer(
                EVENTS_STREAM, ConsumerConfig(name="stats", filter_subject=ALIAS_EVENTS)
            ),
            # Following the aliases itself: an ordered consumer on EVENTS per follow.
            AliasFollower(js).start(timeout_s=2.0),
            js.get_last_msg(EVENTS_STREAM, "events.stats.exclusion.added"),
            js.get_last_msg(EVENTS_STREAM, "events.stats.exclusion.added", direct=True),
            js.get_last_msg(EVENTS_STREAM, "events.task.t1.submitted", direct=True),
            # Another worker's start or outcome, or one as the router or the reaper.
            js.publish("events.task.t1.cpu2.completed", b"{}"),
            js.publish("events.task.t1.started", b"{}"),
            js.publish("events.task.t1.failed", b"{}"),
        ]
        results = await asyncio.gather(*attempts, return_exceptions=True)
        assert all(isinstance(r, Exception) for r in results), results
        await nc.subscribe("events.stats.>")
        await nc.flush()
        await asyncio.sleep(0.3)
    finally:
        await nc.close()

    for subject in (
        "tasks.cpu.cpu2",
        "$JS.API.CONSUMER.CREATE.TASKS.worker-cpu1.tasks.*.cpu1",
        "$JS.API.CONSUMER.CREATE.TASKS.worker-cpu1.tasks.*.cpu2",
        "$JS.API.CONSUMER.MSG.NEXT.TASKS.worker-cpu2",
        "$JS.API.CONSUMER.CREATE.EVENTS",
        "$JS.API.CONSUMER.CREATE.EVENTS.peek.events.stats.exclusion.>",
        "$JS.API.CONSUMER.CREATE.EVENTS.stats.events.stats.alias.>",
        "events.stats.alias.>",  # the follower's consumer, whatever its name
        "$JS.API.STREAM.MSG.GET.EVENTS",
        "$JS.API.DIRECT.GET.EVENTS.events.stats.exclusion.added",
        "$JS.API.DIRECT.GET.EVENTS.events.task.t1.submitted",
        'subscription to "events.stats.>"',
        "events.task.t1.cpu2.completed",
        'publish to "events.task.t1.started"',
        'publish to "events.task.t1.failed"',
    ):
        assert errors.about(subject), (subject, errors.seen)
    # The other worker's task is still there, untouched; its own limit stands.
    info = await ajs.consumer_info(TASKS_STREAM, "worker-cpu2")
    assert info.num_pending == 1
    assert (await ajs.consumer_info(TASKS_STREAM, f"worker-{WORKER}")).config.max_ack_pending == 1


async def test_a_worker_reads_what_its_redelivered_task_ended_with_through_the_router(
    secured: NatsServer, admin: Client, runner: ServiceRunner
) -> None:
    """A worker handed its task again (it was out of touch, or restarted) looks for an outcome
    already stored before running it. Its user may not read the event log (a ``*`` in a
    direct get's subject reads every task's answer): the router reads for it, the tasks
    routed to it only."""
    ajs = admin.jetstream()

    def ended(task_id: str, by: str) -> TaskCompleted:
        return TaskCompleted(
            at=time.time(),
            task_id=task_id,
            attempt=1,
            worker=by,
            model="qwen2.5:0.5b",
            response=f"the answer to {task_id}",
            durations=Durations(total_ms=1.0),
        )

    for task_id, to in (("t1", WORKER), ("t2", WORKER), ("t3", WORKER), ("t4", "cpu2")):
        routed = TaskRouted(
            at=time.time(), task_id=task_id, attempt=1, worker=to, queue=f"tasks.cpu.{to}"
        )
        await publish_event(ajs, routed)
    answered = ended("t1", WORKER)
    await publish_event(ajs, answered, by=WORKER)
    failed = TaskFailed(at=time.time(), task_id="t2", attempt=1, code="no_worker", reason="none")
    await publish_event(ajs, failed)
    await publish_event(ajs, ended("t4", "cpu2"), by="cpu2")  # another worker's task
    runner.router(secured.url, nats_user="router", nats_password=password("router"))

    errors = Violations()
    nc = await connect_as(secured, f"worker-{WORKER}", errors)
    try:
        reads = RouterReads(nc)

        async def router_answers() -> list[Sourced] | None:
            try:
                return await stored_ends(reads, "t1")
            except NoResponder:
                return None  # the router is starting

        [(completed, source, _)] = await eventually(router_answers)
        [(by_router, router_source, _)] = await stored_ends(reads, "t2")
        assert await stored_ends(reads, "t3") == []
        assert await stored_ends(reads, "t4") == []  # not routed to it: as if there were none
        for wrong in ("events.task.*.*.completed", "events.task.t1.submitted", "events.>"):
            with pytest.raises(BadRequest, match="not a task event a worker reads"):
                await reads.last(wrong)
        # Read itself, every task's last answer would come back: refused by the server.
        with pytest.raises(nats.errors.TimeoutError):
            await nc.request("$JS.API.DIRECT.GET.EVENTS.events.task.*.*.completed", timeout=1)
        assert errors.about("$JS.API.DIRECT.GET.EVENTS.events.task.*.*.completed")
    finally:
        await nc.close()
    assert (completed, source) == (answered, WORKER)
    assert (by_router, router_source) == (failed, None)


async def test_services_look_streams_up_and_only_setup_makes_or_changes_them(
    secured: NatsServer,
) -> None:
    worker = await connect_as(secured, f"worker-{WORKER}")
    try:
        with pytest.raises(Unavailable, match="run `coordinator setup` with the operator user"):
            await ensure_streams(worker.jetstream(timeout=1.0))
        admin_auth = NatsAuth(user="admin", password=password("admin"))
        await setup_streams(
            secured.url, worker_ttl_s=3.0, events_max_age_s=86400.0, auth=admin_auth
        )
        with capture_logs() as logs:
            await ensure_streams(worker.jetstream(timeout=1.0), worker_ttl_s=3.0)
        assert logs == []  # nothing to change, nothing tried
        info = await worker.jetstream().stream_info(EVENTS_STREAM)
        assert info.config.max_age == 86400.0  # a service leaves the retention to setup
        assert info.config.allow_direct
    finally:
        await worker.close()


def test_a_service_with_wrong_credentials_stops_at_once_saying_so(secured: NatsServer) -> None:
    """The server is up and refuses the user: waiting for it would never end, so the service
    exits with a configuration error naming the variables to check."""
    env = clean_env(NATS_URL=secured.url, NATS_USER="router", NATS_PASSWORD="not-the-password")
    done = subprocess.run(
        [COORDINATOR, "router"], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "refused this service's credentials" in done.stdout + done.stderr
    assert "NATS_USER/NATS_PASSWORD" in done.stdout + done.stderr


async def test_the_gateway_shows_the_fleet_under_its_own_user_and_writes_nothing(
    secured: NatsServer, admin: Client, ollama: FakeOllama, runner: ServiceRunner, pg_dsn: str
) -> None:
    """The dashboard's and the metrics' reads (the registry's watch, the event log through
    ordered consumers, the stream's state, the stats consumer's lag, the endpoints) all pass
    under the gateway's user; it may still publish no event nor re-filter the stats
    service's consumer."""
    from tests.integration.test_gateway import start_gateway

    with capture_logs() as logs:
        run_fleet(runner, secured.url, ollama.url, pg_dsn=pg_dsn, reaper=True)
        url = await start_gateway(
            runner, secured.url, nats_user="gateway", nats_password=password("gateway")
        )
        client = await connect_as(secured, "client")
        errors = Violations()
        gateway = await connect_as(secured, "gateway", errors)
        try:
            await workers_live(client, 1)
            body = {"prompt": "1+1?", "model": "qwen2.5:0.5b", "wait": True}
            reply, _ = await request(client, ROUTE, body, timeout_s=20.0)
            async with httpx.AsyncClient(base_url=url, timeout=10) as http:

                async def shown() -> dict[str, Any] | None:
                    state = (await http.get("/dashboard/state")).json()
                    summary, done = state["summary"], state["tasks"]["done"]
                    complete = (
                        not summary["unavailable"]
                        and summary["reaper"] is not None
                        and summary["event_log"] is not None
                        and summary["stats_lag"] == 0
                        and [w["worker_id"] for w in state["workers"]] == [WORKER]
                        and [d["task_id"] for d in done] == [reply["task_id"]]
                    )
                    return state if complete else None

                await eventually(shown, timeout_s=20.0, interval_s=0.3)
                metrics = (await http.get("/metrics")).text
            assert (
                'coordinator_task_outcomes_total{kind="inference",model="qwen2.5:0.5b",'
                f'outcome="done",worker="{WORKER}"}} 1.0'
            ) in metrics
            js = gateway.jetstream(timeout=1.0)
            attempts = await asyncio.gather(
                js.publish("events.task.t1.completed", b"{}"),
                js.add_consumer(
                    EVENTS_STREAM, ConsumerConfig(name=STATS_CONSUMER, filter_subject="events.>")
                ),
                return_exceptions=True,
            )
            assert all(isinstance(a, Exception) for a in attempts), attempts
            await asyncio.sleep(0.2)
            assert errors.about('publish to "events.task.t1.completed"'), errors.seen
            assert errors.about(f"$JS.API.CONSUMER.CREATE.EVENTS.{STATS_CONSUMER}.events.>")
        finally:
            await gateway.close()
            await client.close()
        await runner.stop_all()
    denied = [e for e in logs if "permissions violation" in str(e.get("error", "")).lower()]
    assert denied == []


async def test_two_of_each_service_share_the_work_under_their_own_users(
    secured: NatsServer, admin: Client, ollama: FakeOllama, runner: ServiceRunner, pg_dsn: str
) -> None:
    """Two routers, two reapers and two stats services: the reaper's and the stats service's
    leases, a router's read-back of the tasks under way and the routers' questions to each
    other (a cancel by reply subject, whichever router takes it) all pass under each role's
    user."""
    url = secured.url
    with capture_logs() as logs:
        run_fleet(runner, url, ollama.url, pg_dsn=pg_dsn, reaper=True)
        client = await connect_as(secured, "client")
        try:
            await workers_live(client, 1)
            # The worker busy with this one until the test cancels it, so the next task waits
            # in the queue, under way, while it is cancelled again and again.
            ollama.delay_s = 120.0
            queued, _ = await request(client, ROUTE, {"prompt": "1+1", "model": MODEL})
            # The second of each starts with a task in the log.
            runner.start(
                run_stats,
                StatsSettings(
                    nats_url=url, pg_dsn=pg_dsn, nats_user="stats", nats_password=password("stats")
                ),
            )
            runner.start(
                run_reaper,
                ReaperSettings(nats_url=url, nats_user="reaper", nats_password=password("reaper")),
            )
            runner.router(url, nats_user="router", nats_password=password("router"))
            leaders = await admin.jetstream().key_value(LEADERS_BUCKET)

            async def both_held() -> bool:
                roles = {"reaper", "stats"}
                return {e["event"] for e in logs} >= {f"{r} standing by" for r in roles} and all(
                    [await leaders.get(role) for role in roles]
                )

            await eventually(both_held, timeout_s=20.0)
            for _ in range(6):  # either stats service takes each; the standby passes it on
                figures, headers = await request(client, STATS, {}, 10.0)
                assert "Nats-Service-Error-Code" not in headers, figures
            inbox = client.new_inbox()
            answers = await client.subscribe(inbox)
            waiting = new_task_id()
            body = {"prompt": "2+2", "model": MODEL, "wait": True, "task_id": waiting}
            await client.publish(ROUTE, msgspec.json.encode(body), reply=inbox)
            await eventually(lambda: routed(admin, waiting))
            for _ in range(6):  # either router takes each: every one is a cancel
                cancel, headers = await request(
                    client, cancel_from("client"), {"reply_to": inbox}, 5.0
                )
                assert "Nats-Service-Error-Code" not in headers, cancel
            # The worker, freed, takes the cancelled one and ends it unrun.
            await request(client, cancel_from("client"), {"task_id": queued["task_id"]}, 5.0)
            final = msgspec.json.decode((await answers.next_msg(timeout=15)).data)
            assert final["failure"]["code"] == "cancelled"
            assert final["task_id"] == waiting
        finally:
            await client.close()
        await runner.stop_all()
    denied = [e for e in logs if "permissions violation" in str(e.get("error", "")).lower()]
    assert denied == []
    assert not [e for e in logs if e["event"].startswith("tasks under way not read back")]
    assert not [e for e in logs if "cannot reach the leaders bucket" in e["event"]]


async def routed(nc: Client, task_id: str) -> bool:
    """Has a router stored the task's ``routed`` (its waiting request held from then on)?"""
    try:
        await nc.jetstream().get_last_msg(EVENTS_STREAM, task_event(task_id, "routed"))
    except NotFoundError:
        return False
    return True


async def test_each_active_standby_role_may_hold_only_its_own_lease(
    secured: NatsServer, admin: Client
) -> None:
    for role, other in (("reaper", "stats"), ("stats", "reaper")):
        errors = Violations()
        nc = await connect_as(secured, role, errors)
        try:
            kv = await nc.jetstream(timeout=1.0).key_value(LEADERS_BUCKET)
            await kv.create(role, b'{"instance_id": "x", "heartbeat_at": 0}')
            assert (await kv.get(role)).value
            await kv.delete(role)
            assert errors.seen == []
            attempts = await asyncio.gather(
                kv.create(other, b"{}"),
                kv.put(other, b"{}"),
                kv.delete(other),
                return_exceptions=True,
            )
            assert all(isinstance(a, Exception) for a in attempts), attempts
            await asyncio.sleep(0.2)
            assert errors.about(f'publish to "$KV.{LEADERS_BUCKET}.{other}"'), errors.seen
        finally:
            await nc.close()
    worker = await connect_as(secured, f"worker-{WORKER}")
    try:
        with pytest.raises(Exception):  # noqa: B017 - any refusal: the server answers nothing
            kv = await worker.jetstream(timeout=1.0).key_value(LEADERS_BUCKET)
            await kv.create("reaper", b"{}")
    finally:
        await worker.close()
