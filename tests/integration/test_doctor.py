"""``coordinator doctor`` against a real nats-server, PostgreSQL and the running services."""

from __future__ import annotations

import asyncio
import signal
import socket
import time
from pathlib import Path

import msgspec
from nats.aio.client import Client
from nats.js.api import AckPolicy, ConsumerConfig

from benchmarks.up_stop import start_up, stop_up, up_env, wait_ready
from devtools.fakes.ollama import FakeOllama
from devtools.servers import NatsServer, free_port
from schemas.subjects import TASKS_STREAM, WORKERS_BUCKET
from schemas.workers import WorkerRecord
from services import __version__
from services.cli.doctor import run_doctor
from services.cli.health import check_health, setup_streams
from services.runtime.settings import WorkerSettings
from services.worker.service import run as run_worker
from tests.harness import ServiceRunner, clean_env, eventually, run_cli, workers_live


async def test_a_healthy_stack_passes_every_check(
    nats_server: NatsServer,
    nc: Client,
    ollama: FakeOllama,
    runner: ServiceRunner,
    pg_dsn: str,
    tmp_path: Path,
) -> None:
    runner.stats(nats_server.url, pg_dsn)
    runner.router(nats_server.url)
    # Its backend as its own probe says (the doctor never calls the model server itself).
    runner.start(
        run_worker,
        WorkerSettings(
            nats_url=nats_server.url,
            ollama_host=ollama.url,
            worker_id="cpu1",
            worker_host=socket.gethostname(),
            heartbeat_interval_s=0.5,
            worker_ttl_s=3.0,
        ),
    )
    await workers_live(nc, 1)

    async def stats_consumer() -> bool:
        names = [c.name for c in await nc.jetstream().consumers_info("EVENTS")]
        return "stats" in names

    for _ in range(100):
        if await stats_consumer():
            break
        await asyncio.sleep(0.1)
    checks = await run_doctor(nats_server.url, pg_dsn=pg_dsn, unit_dirs=[tmp_path])

    by_name = {c.name: c for c in checks}
    assert [c for c in checks if c.status == "problem"] == []
    assert by_name["nats"].detail.startswith("nats-server 2.")
    assert by_name["postgresql"].status == "ok"
    assert by_name["version skew"].detail == f"all on {__version__}"
    assert by_name["worker backends"].status == "ok"
    assert set(by_name) >= {
        "streams",
        "consumers",
        "duplicate consumers",
        "ghost queues",
        "stale registrations",
        "service units",
    }


async def test_a_ghost_queue_a_stale_entry_and_a_dead_backend_fail_the_doctor_by_name(
    nats_server: NatsServer, nc: Client, tmp_path: Path
) -> None:
    await setup_streams(nats_server.url, worker_ttl_s=60.0, events_max_age_s=0.0)
    js = nc.jetstream()
    # A consumer with a task waiting, and no worker alive to pull it.
    await js.add_consumer(
        TASKS_STREAM,
        ConsumerConfig(
            durable_name="worker-moon",
            filter_subject="tasks.*.moon",
            ack_policy=AckPolicy.EXPLICIT,
            max_ack_pending=1,
        ),
    )
    await js.publish("tasks.cpu.moon", b"{}")
    # A registration whose heartbeat stopped long ago; its model server is gone too.
    kv = await js.key_value(WORKERS_BUCKET)
    stale = WorkerRecord(
        worker_id="esxi",
        host=socket.gethostname(),
        instance_id="i",
        pid=4242,
        version=__version__,
        supports=["cpu_inference"],
        models=["gemma3:1b"],
        started_at=time.time() - 7200,
        heartbeat_at=time.time() - 3600,
        backend_url=f"http://127.0.0.1:{free_port()}",
    )
    await kv.put("esxi", msgspec.json.encode(stale))
    # A live worker whose own probe finds its model server gone (the doctor does not probe
    # it from here: it believes the worker beside it).
    degraded = msgspec.structs.replace(
        stale,
        worker_id="nuc",
        instance_id="j",
        heartbeat_at=time.time(),
        health="degraded",
        health_reason="backend_unavailable: Ollama at http://127.0.0.1:1 cannot be reached",
        health_since=time.time() - 30,
    )
    await kv.put("nuc", msgspec.json.encode(degraded))
    units = tmp_path / "units"
    units.mkdir()
    for name in ("ollama-worker.service", "coordinator-worker.service"):
        (units / name).write_text("[Service]\nExecStart=/home/u/venv/bin/python worker.py\n")

    result = await asyncio.to_thread(
        run_cli,
        "doctor",
        "--unit-dir",
        str(units),
        env=clean_env(NATS_URL=nats_server.url),
        timeout=30,
    )

    assert result.returncode == 1, result.stdout + result.stderr
    lines = {
        line.split()[0] + " " + line[9:31].strip(): line for line in result.stdout.splitlines()
    }
    assert (
        "worker-moon: 1 task(s) waiting, worker moon is not live" in lines["problem ghost queues"]
    )
    assert "esxi on" in lines["problem stale registrations"]
    assert "nuc (ollama at http" in lines["problem worker backends"]
    assert " s: backend_unavailable: Ollama at" in lines["problem worker backends"]
    assert "esxi" not in lines["problem worker backends"]  # stale: its own check says so
    assert "started by 2 units" in lines["problem service units"]
    assert "no 'stats' consumer" in lines["problem consumers"]
    assert lines["skipped postgresql"]


async def reaper_healthy(env: dict[str, str]) -> bool:
    return await check_health("reaper", env) == ""


async def test_health_says_whether_each_role_is_up(
    nats_server: NatsServer, nc: Client, ollama: FakeOllama, runner: ServiceRunner
) -> None:
    env = {"NATS_URL": nats_server.url}
    assert "does not answer PING" in await check_health("router", env)
    runner.router(nats_server.url)
    runner.worker(nats_server.url, ollama.url, "cpu1")
    await workers_live(nc, 1)

    assert await check_health("router", env) == ""
    assert "coordinator-reaper does not answer PING" in await check_health("reaper", env)
    runner.reaper(nats_server.url)
    await eventually(lambda: reaper_healthy(env), timeout_s=10)
    worker = {**env, "WORKER_ID": "cpu1", "WORKER_HOST": "host-cpu1"}
    assert await check_health("worker", worker) == ""
    assert "runs on host-cpu1, not here" in await check_health(
        "worker", {**worker, "WORKER_HOST": "elsewhere"}
    )
    assert "not registered" in await check_health("worker", {**worker, "WORKER_ID": "cpu9"})
    down = await check_health("stats", {"NATS_URL": f"nats://127.0.0.1:{free_port()}"})
    assert down.startswith("cannot reach NATS at")


def checks_of(stdout: str) -> dict[str, tuple[str, str]]:
    """The doctor's lines: each check's name, with its status and detail."""
    return {line[9:31].strip(): (line[:8].strip(), line[32:]) for line in stdout.splitlines()}


async def test_the_doctor_checks_the_postgresql_of_the_stack_up_runs_unless_pg_dsn_is_set(
    tmp_path: Path, ollama: FakeOllama
) -> None:
    home = tmp_path / "home"
    env = up_env(home, ollama.url, pg_dsn=None)  # PostgreSQL embedded, as on a fresh machine
    up = start_up(home, env)
    try:
        await asyncio.to_thread(wait_ready, up, home)
        found = await asyncio.to_thread(
            run_cli, "doctor", "--unit-dir", str(tmp_path), env=env, timeout=60
        )
        elsewhere = f"postgresql://postgres@127.0.0.1:{free_port()}/coordinator"
        told = await asyncio.to_thread(
            run_cli,
            "doctor",
            "--unit-dir",
            str(tmp_path),
            env={**env, "PG_DSN": elsewhere},
            timeout=60,
        )
    finally:
        trial = await asyncio.to_thread(stop_up, up, home, signal.SIGINT, 60.0)
    assert trial.ok, trial.describe()

    assert "PG_DSN" not in env
    status, detail = checks_of(found.stdout)["postgresql"]
    assert (status, detail.split()[0]) == ("ok", "PostgreSQL"), found.stdout + found.stderr
    status, detail = checks_of(told.stdout)["postgresql"]
    assert status == "problem" and detail.startswith("cannot connect: "), told.stdout
