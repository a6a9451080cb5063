"""``coordinator models advise``, as an operator runs it, on a recorded event log: a real
nats-server, the real router, workers and stats service on Ollama stand-ins, and a day of
demand published as the services publish it (`services.runtime.bus.publish_event`) with its
times inside the window. The command reads the fleet, the figures and the log, proposes, and
changes nothing."""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.aio.client import Client
from nats.errors import NoRespondersError

from devtools.fakes.ollama import FakeOllama
from devtools.servers import NatsServer
from schemas.events import (
    AnyEvent,
    Durations,
    TaskCompleted,
    TaskRouted,
    TaskStarted,
    TaskSubmitted,
    Tokens,
    WorkerAsleep,
    WorkerRegistered,
)
from schemas.subjects import EVENTS_STREAM, STATS
from schemas.work import Work
from services.cli.health import setup_streams
from services.cli.permissions import password_variable
from services.cli.roles import DEPLOY_DIR
from services.runtime.bus import publish_event
from services.runtime.settings import NatsAuth
from tests.harness import ServiceRunner, clean_env, eventually, request, run_cli, workers_live
from tests.integration.test_nats_permissions import USERS, WORKER, password, run_fleet

DAY_S = 86_400.0
HOUR_S = 3600.0
BIG = "qwen3:8b"  # 4.85 GB as the stand-in lists it
OTHER = "gemma3:4b"  # 2.45 GB
SMALL = "qwen2.5:0.5b"  # 0.35 GB
UNUSED = "gemma3:1b"  # 0.65 GB
SLEEPERS = "llama3.2:3b"  # 1.85 GB


def recorded_task(
    task_id: str, model: str, on: str, at: float, *, wait_s: float, load_ms: float
) -> list[AnyEvent]:
    """One task's events as the router and the worker record them: 100 tokens at 20 tok/s."""
    started = at + wait_s
    return [
        TaskSubmitted(at=at, task_id=task_id, model=model, work=Work(prompt="1+1"), timeout_s=60),
        TaskRouted(at=at, task_id=task_id, attempt=1, worker=on, queue=f"tasks.gpu.{on}"),
        TaskStarted(at=started, task_id=task_id, attempt=1, worker=on, host=f"host-{on}"),
        TaskCompleted(
            at=started + 7,
            task_id=task_id,
            attempt=1,
            worker=on,
            model=model,
            response="2",
            durations=Durations(total_ms=7000, load_ms=load_ms, eval_ms=5000),
            tokens=Tokens(prompt=20, eval=100),
        ),
    ]


def recorded_day(since: float) -> list[AnyEvent]:
    """A day of the fleet, from ``since``: the Mac (6 GB) asked for qwen3:8b every two minutes
    for 76 minutes and for gemma3:4b every four, each loaded cold (one pushes the other out);
    pc asleep from 1 h to 5 h and from 6 h on, llama3.2:3b asked for at 2, 3 and 4 h (each
    waited 40 s for pc to wake) and at 5.5 h."""
    events: list[AnyEvent] = []
    start = since + 2 * HOUR_S
    for n in range(38):
        events += recorded_task(f"big-{n}", BIG, "mac", start + n * 120, wait_s=3, load_ms=4000)
    for n in range(12):
        events += recorded_task(
            f"other-{n}", OTHER, "mac", start + 60 + n * 240, wait_s=1, load_ms=2500
        )
    events += [
        WorkerAsleep(at=since + HOUR_S, worker_id="pc", instance_id="a", models=[], idle_s=600),
        WorkerRegistered(
            at=since + 5 * HOUR_S,
            worker_id="pc",
            host="host-pc",
            instance_id="b",
            models=[SLEEPERS],
            supports=["gpu_inference"],
            version="1",
        ),
        WorkerAsleep(at=since + 6 * HOUR_S, worker_id="pc", instance_id="b", models=[], idle_s=60),
    ]
    for n, hours in enumerate((2, 3, 4, 5.5)):
        events += recorded_task(
            f"asleep-{n}", SLEEPERS, "pc", since + hours * HOUR_S, wait_s=40, load_ms=3000
        )
    return sorted(events, key=lambda e: e.at)


async def asleep(nc: Client, worker_id: str) -> bool:
    try:
        entry = await (await nc.jetstream().key_value("asleep")).get(worker_id)
    except Exception:
        return False
    return bool(entry.value)


async def last_seq(nc: Client) -> int:
    return int((await nc.jetstream().stream_info(EVENTS_STREAM)).state.last_seq or 0)


async def test_the_advice_on_a_recorded_day_pulls_what_thrashes_and_what_sleeps(
    nats_server: NatsServer, pg_dsn: str, nc: Client, runner: ServiceRunner, tmp_path: Path
) -> None:
    gpu = {"worker_supports": ["gpu_inference"]}
    with (
        FakeOllama(models=[BIG, OTHER]) as mac,
        FakeOllama(models=[SMALL, UNUSED]) as moon,
        FakeOllama(models=[SLEEPERS]) as pc,
    ):
        runner.router(nats_server.url)
        runner.stats(nats_server.url, pg_dsn)
        runner.worker(nats_server.url, mac.url, "mac", worker_memory_gb=6, **gpu)
        runner.worker(nats_server.url, moon.url, "moon", worker_memory_gb=16, **gpu)
        # pc goes to sleep as a sleeping machine does: its record in the asleep bucket.
        sleepy = {
            "wol_mac": "aa:bb:cc:dd:ee:ff",
            "idle_shutdown_sec": 0.5,
            "idle_check_interval_sec": 0.2,
            "shutdown_command": f"touch {tmp_path / 'pc-off'}",
        }
        await asyncio.wait_for(
            runner.worker(nats_server.url, pc.url, "pc", **gpu, **sleepy), timeout=20
        )
        assert await eventually(lambda: asleep(nc, "pc"))
        await workers_live(nc, 2)
        # moon's own tasks, run for real: its wait and speed are measured ones.
        for _ in range(3):
            asked = {"prompt": "1+1", "model": SMALL, "worker": "moon", "wait": True}
            reply, headers = await request(nc, "coordinator.route", asked)
            assert "Nats-Service-Error-Code" not in headers, reply
        js = nc.jetstream()
        for event in recorded_day(time.time() - DAY_S):
            await publish_event(js, event)

        async def counted() -> bool:
            try:
                body, _ = await request(nc, STATS, {"model": BIG})
            except NoRespondersError:
                return False  # the stats service is starting
            return bool(sum(f["count"] for f in body.get("figures", ())) == 38)

        await eventually(counted, timeout_s=20)
        before = await last_seq(nc)
        env = clean_env(NATS_URL=nats_server.url, COORDINATOR_HOME=str(tmp_path))
        as_json = await asyncio.to_thread(
            run_cli, "models", "advise", "--json", "--days", "1", env=env
        )
        table = await asyncio.to_thread(run_cli, "models", "advise", "--days", "1", env=env)
        matrix = await asyncio.to_thread(run_cli, "models", env=env)
        after = await last_seq(nc)

    assert as_json.returncode == 0, as_json.stderr
    advice: dict[str, Any] = json.loads(as_json.stdout)
    assert advice["days"] == 1.0 and advice["figures"] is True
    proposals = [(p["action"], p["model"], p["worker"], p["rule"]) for p in advice["proposals"]]
    assert proposals == [
        ("pull", BIG, "moon", "cold_loads"),
        ("pull", SLEEPERS, "moon", "asleep_when_asked"),
        ("remove", UNUSED, "moon", "unused"),
    ], json.dumps({k: advice[k] for k in ("notes", "demand")})
    big, sleepers, unused = advice["proposals"]
    # Asked every two minutes: kept in memory on moon, qwen3:8b would not load cold again.
    assert big["sources"] == ["mac"]
    assert big["before"] == {
        "cold_loads_per_day": 38.0,
        "asked_asleep_per_day": 0.0,
        "wait_p50_s": 3.0,
    }
    assert big["after"]["cold_loads_per_day"] == 0.0
    assert 0 < big["after"]["wait_p50_s"] < 3.0  # moon's own tasks, measured
    assert "mac cannot keep it (4.8 GB) beside gemma3:4b (2.5 GB) in 6.0 GB" in big["reason"]
    # Three requests found pc asleep; hours apart, each would load cold on moon too.
    assert sleepers["sources"] == ["pc"]
    assert sleepers["before"] == {
        "cold_loads_per_day": 4.0,
        "asked_asleep_per_day": 3.0,
        "wait_p50_s": 40.0,
    }
    assert sleepers["after"]["cold_loads_per_day"] == 3.0
    assert sleepers["after"]["asked_asleep_per_day"] == 0.0
    assert unused["frees_bytes"] == 650_000_000 and unused.get("before") is None
    # gemma3:4b fits on the Mac once qwen3:8b is pulled off it.
    assert any(
        n.startswith(f"{OTHER}: 12 cold loads a day on mac")
        and n.endswith(f"pulling {BIG} off makes room for it")
        for n in advice["notes"]
    )
    demand = {d["model"]: d for d in advice["demand"]}
    assert sorted(demand) == sorted([BIG, OTHER, SMALL, SLEEPERS])
    assert demand[BIG]["requests_per_day"] == 38.0
    assert demand[BIG]["cold_loads_per_day"] == {"mac": 38.0}
    assert demand[BIG]["tokens_per_day"] == 38 * 120.0
    assert demand[SMALL]["requests_per_day"] == 3.0
    assert demand[SMALL]["holders"] == ["moon"]
    assert demand[SLEEPERS]["holders"] == ["pc"]  # asleep: from the asleep bucket

    assert table.returncode == 0, table.stderr
    text = table.stdout
    assert "  1. pull qwen3:8b onto moon: 38 cold loads a day on mac would become 0; " in text
    assert "  2. pull llama3.2:3b onto moon: 3 requests a day that found pc asleep" in text
    assert "  3. remove gemma3:1b from moon (unused)" in text
    assert "     to do it: coordinator rm gemma3:1b --on moon" in text
    assert "the stats service did not answer" not in text

    # `coordinator models` without an action is still the matrix.
    assert matrix.returncode == 0, matrix.stderr
    assert matrix.stdout.splitlines()[0].split()[:4] == ["MODEL", "WORKER", "SIZE", "QUANT"]
    # It changed nothing: no event, and every model where it was.
    assert after == before
    assert (mac.models, moon.models) == ([BIG, OTHER], [SMALL, UNUSED])


async def test_events_older_than_the_window_are_not_demand(
    nats_server: NatsServer, nc: Client, runner: ServiceRunner, tmp_path: Path
) -> None:
    with FakeOllama(models=[SMALL, UNUSED]) as moon:
        runner.router(nats_server.url)
        runner.worker(nats_server.url, moon.url, "moon", worker_memory_gb=16)
        await workers_live(nc, 1)
        js = nc.jetstream()
        now = time.time()
        # Stored now, but recorded as three days ago (gemma3:1b) and an hour ago (qwen2.5).
        for event in [
            *recorded_task("old", UNUSED, "moon", now - 3 * DAY_S, wait_s=1, load_ms=5),
            *recorded_task("new", SMALL, "moon", now - HOUR_S, wait_s=2, load_ms=5),
        ]:
            await publish_event(js, event)
        env = clean_env(NATS_URL=nats_server.url, COORDINATOR_HOME=str(tmp_path))
        as_json = await asyncio.to_thread(
            run_cli, "models", "advise", "--json", "--days", "2", env=env
        )
        table = await asyncio.to_thread(run_cli, "models", "advise", env=env)
        refused = await asyncio.to_thread(run_cli, "models", "advise", "--days", "0", env=env)

    assert as_json.returncode == 0, as_json.stderr
    advice = json.loads(as_json.stdout)
    assert advice["figures"] is False  # no stats service: speeds from the window's own
    assert [(d["model"], d["requests_per_day"], d["wait_p50_s"]) for d in advice["demand"]] == [
        (SMALL, 0.5, 2.0)
    ]
    assert [(p["action"], p["model"], p["worker"]) for p in advice["proposals"]] == [
        ("remove", UNUSED, "moon")
    ]
    # Seven days (the default) reach the older task: nothing is unused then.
    assert table.returncode == 0, table.stderr
    assert "no proposal: the models are where their demand wants them" in table.stdout
    assert table.stdout.rstrip().endswith(
        "(the stats service did not answer: speeds are the window's own)"
    )
    assert refused.returncode == 2 and "days must be more than 0" in refused.stderr


@pytest.fixture
def shipped() -> Iterator[NatsServer]:
    """nats-server with the committed configuration: one user per role."""
    with tempfile.TemporaryDirectory(prefix="coord-nats-") as tmp:
        conf = (DEPLOY_DIR / "nats" / "nats-server.conf").read_text()
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


async def test_the_operator_reads_the_log_and_a_client_may_not(
    shipped: NatsServer, runner: ServiceRunner, tmp_path: Path
) -> None:
    admin = NatsAuth(user="admin", password=password("admin"))
    await setup_streams(shipped.url, worker_ttl_s=3.0, events_max_age_s=0.0, auth=admin)
    with FakeOllama(models=[SMALL]) as fake:
        run_fleet(runner, shipped.url, fake.url)
        nc = await nats.connect(shipped.url, user="admin", password=password("admin"))
        try:
            await workers_live(nc, 1)
            js = nc.jetstream()
            for event in recorded_task(
                "t", SMALL, WORKER, time.time() - HOUR_S, wait_s=2, load_ms=5
            ):
                await publish_event(js, event)
        finally:
            await nc.close()

        def as_user(user: str) -> dict[str, str]:
            return clean_env(
                NATS_URL=shipped.url,
                NATS_USER=user,
                NATS_PASSWORD=password(user),
                COORDINATOR_HOME=str(tmp_path),
            )

        operator = await asyncio.to_thread(
            run_cli, "models", "advise", "--json", env=as_user("operator")
        )
        client = await asyncio.to_thread(run_cli, "models", "advise", env=as_user("client"))

    assert operator.returncode == 0, operator.stderr
    demand = json.loads(operator.stdout)["demand"]
    assert [(d["model"], d["requests_per_day"], d["wait_p50_s"]) for d in demand] == [
        (SMALL, pytest.approx(1 / 7), 2.0)
    ]
    assert client.returncode == 1
    assert "error unavailable: cannot read the" in client.stderr
    assert "takes the operator's NATS user" in client.stderr
